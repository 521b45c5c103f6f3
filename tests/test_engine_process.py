"""The engine core in a process of its own (graphplan-serve's default): the same tokens as the
one-process server through the official openai client (the tiny Llama and a saved Qwen3 with its
tokenizer), N front ends on one port, and the processes' lives: the engine SIGKILLed under
streaming clients (every client answered within 1 s, exit non-zero, no process left, a restart
serves exactly), SIGTERM draining the streams in flight (exit 0), a front end's death freeing its
requests, and the metrics that count a stop string as served."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from test_server import SPEC, SPEC_ARGS, exchange, plan_text

from graphplan.server import Server

from hf_models import write_model_dir
from served import alive, openai_client, start_server

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 2, 77], [100], [3] * 11, [7, 1], [42] * 5, [9, 8, 7, 6, 5, 4]]


def _greedy(client, model: str, n: int = 12) -> list[list[int]]:
    res = client.completions.create(model=model, prompt=PROMPTS, max_tokens=n, temperature=0)
    return [c.token_ids for c in res.choices]


def _streamed(client, model: str, prompt, n: int) -> list[int]:
    out: list[int] = []
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True
    ):
        out += chunk.choices[0].token_ids or []
    return out


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    path.write_text(plan_text())
    return path


def test_the_tiny_llama_gives_the_same_tokens_in_one_process_and_in_two(plan):
    got = {}
    for processes in (False, True):
        s = Server(plan, spec=SPEC, progress=False, processes=processes).start()
        try:
            assert s.wait_ready(120), s.engine.health()
            c = openai_client(s)
            got[processes] = (_greedy(c, "tiny-llama"), _streamed(c, "tiny-llama", [1, 2, 3], 20))
            assert s.engine.health()["status"] == "ready"
        finally:
            assert s.stop() is True  # drained: nothing was cut short
    assert got[True] == got[False]
    assert [len(t) for t in got[True][0]] == [12] * len(PROMPTS) and len(got[True][1]) == 20


QWEN_PLAN = (
    "version: 1\nname: hf-t\nscheduler: {max_num_seqs: 4, max_num_batched_tokens: 32}\n"
    "cudagraph: {mode: FULL_AND_PIECEWISE, attention_support: ALWAYS, capture_sizes: [1, 2, 4]}\n"
)


def test_a_saved_qwen3_with_its_tokenizer_gives_the_same_text_in_both_modes(tmp_path_factory):
    model_dir = write_model_dir(tmp_path_factory.mktemp("hf") / "tiny-qwen3")
    got = {}
    for processes in (False, True):
        s = start_server(
            tmp_path_factory, model_dir, QWEN_PLAN, max_model_len=32, processes=processes
        )
        try:
            c = openai_client(s)
            res = c.completions.create(
                model="tiny-qwen3", prompt="w1 w7 w30", max_tokens=8, temperature=0
            )
            stream = [
                ch.choices[0].text
                for ch in c.completions.create(
                    model="tiny-qwen3", prompt="w4 w2", max_tokens=6, temperature=0, stream=True
                )
            ]
            got[processes] = (res.choices[0].text, res.choices[0].token_ids, "".join(stream))
        finally:
            s.stop()
    assert got[True] == got[False] and got[True][1] and got[True][2]


def test_two_front_ends_on_one_port_serve_the_same_tokens(plan):
    s = Server(plan, spec=SPEC, progress=False, processes=True, api_server_count=2).start()
    try:
        assert s.wait_ready(120)
        # the second front end joins the listening socket once its process has started
        deadline = time.monotonic() + 60
        pids = set()
        while len(pids) < 2 and time.monotonic() < deadline:
            for _ in range(8):  # new connections: the kernel hands them to either process
                resp, _ = exchange(s.address, "GET", "/healthz")
                assert resp.status == 200
                pids.add(resp.getheader("x-graphplan-frontend"))
        assert pids == {"0", "1"}

        async def many():
            c = openai_client(s, openai.AsyncOpenAI)
            tasks = [
                c.completions.create(model="tiny-llama", prompt=p, max_tokens=10, temperature=0)
                for p in PROMPTS * 3
            ]
            return [r.choices[0].token_ids for r in await asyncio.gather(*tasks)]

        one = Server(plan, spec=SPEC, progress=False).start()
        try:
            assert one.wait_ready(60)
            want = _greedy(openai_client(one), "tiny-llama", 10) * 3
        finally:
            one.stop()
        assert asyncio.run(many()) == want
    finally:
        assert s.stop()


def _start_cli(
    plan, *flags, spec_args=SPEC_ARGS, device="cpu"
) -> tuple[subprocess.Popen, int, int]:
    """graphplan-serve as a user starts it: (process, port, engine pid), once ready
    (``spec_args``: the model's flags, the tiny Llama's by default)."""
    cmd = [sys.executable, "-m", "graphplan.server", "--plan", str(plan), "--port", "0"]
    cmd += ["--device", device, "--no-progress", *spec_args, *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    port = engine = None
    deadline = time.monotonic() + 90
    while (port is None or engine is None) and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if m := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
            port = int(m.group(1))
        if m := re.search(r"engine process (\d+)", line):
            engine = int(m.group(1))
        assert line or proc.poll() is None, "the server exited while starting"
    assert port and engine
    while exchange(("127.0.0.1", port), "GET", "/healthz")[0].status != 200:
        assert time.monotonic() < deadline, "not ready in 90 s"
        time.sleep(0.05)
    return proc, port, engine


def _left(pids: list[int], within: float = 3.0) -> list[int]:
    """Those of ``pids`` still running ``within`` seconds from now (multiprocessing's resource
    tracker, a child too, ends once the pipes it reads close)."""
    deadline = time.monotonic() + within
    while (running := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


async def _stream_all(
    port: int, n: int, max_tokens: int, model: str = "tiny-llama"
) -> list[tuple[str, float]]:
    """``n`` streaming clients; each one's outcome ("whole", "error: ...") and when it ended."""
    c = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
    )

    async def one(i: int) -> tuple[str, float]:
        got = 0
        try:
            stream = await c.completions.create(
                model=model, prompt=[1 + i % 100, 2], max_tokens=max_tokens, stream=True
            )
            async for chunk in stream:
                got += len(chunk.choices[0].token_ids or []) if chunk.choices else 0
            return ("whole" if got == max_tokens else f"short {got}"), time.monotonic()
        except (openai.APIError, openai.APIConnectionError) as e:
            return f"error: {type(e).__name__}: {e}", time.monotonic()

    return list(await asyncio.gather(*(one(i) for i in range(n))))


@contextlib.contextmanager
def _cli(plan: Path, *args: str):
    """``_start_cli``'s server for the block: (its process, port, engine pid); killed if still
    running at the end, its stderr closed."""
    proc, port, engine = _start_cli(plan, *args)
    try:
        yield proc, port, engine
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_the_engine_killed_under_streaming_clients_answers_every_client_within_1_s(plan):
    with _cli(plan, "--drain-timeout", "5") as (proc, port, engine):
        front = [p for p in _children(proc.pid) if p != engine]

        async def run():
            clients = asyncio.create_task(_stream_all(port, 256, 40))
            await asyncio.sleep(1.5)  # they are streaming
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            return killed, await clients

        killed, outcomes = asyncio.run(run())
        kinds = {o.split(":")[0].split(" ")[0] for o, _ in outcomes}
        assert kinds <= {"whole", "error"} and "error" in kinds, outcomes
        late = [round(t - killed, 2) for o, t in outcomes if t - killed > 1.0]
        assert not late, late
        if proc.poll() is None:  # still stopping: it says why
            try:
                assert exchange(("127.0.0.1", port), "GET", "/healthz")[0].status == 503
            except ConnectionError:
                pass
        assert proc.wait(15) == 1
        assert "the engine process died" in proc.stderr.read()
        assert not _left([engine, *front])
    # a restart serves exactly
    with _cli(plan) as (proc, port, _):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        one = Server(plan, spec=SPEC, progress=False).start()
        try:
            assert one.wait_ready(60)
            assert _greedy(c, "tiny-llama") == _greedy(openai_client(one), "tiny-llama")
        finally:
            one.stop()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


async def _until_admitted(port: int, n: int, timeout: float = 30.0) -> None:
    """Wait until the engines hold ``n`` requests (running or queued for a seat), per /metrics
    (summed over a data-parallel server's ``engine`` labels)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, text = await asyncio.to_thread(exchange, ("127.0.0.1", port), "GET", "/metrics")
        held = sum(
            float(m)
            for m in re.findall(
                r"^graphplan_server_(?:queue_depth|running_requests)(?:\{[^}]*\})? ([\d.e+]+)$",
                text,
                re.M,
            )
        )
        if held >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine did not hold {n} requests within {timeout} s")


def test_sigterm_lets_16_streams_finish_then_exits_0(plan):
    # streams of 300 tokens in two waves of 8 seats: the drain lasts well past the refusal below
    # a drain timeout far above the drain: on a loaded 2-core machine the 16 streams may take
    # longer than the default 30 s, and the timeout's own path is tests/test_server_lifecycle.py's
    with _cli(
        plan, "--api-server-count", "2", "--max-model-len", "320", "--drain-timeout", "300"
    ) as (proc, port, engine):
        children = _children(proc.pid)

        async def run():
            clients = asyncio.create_task(_stream_all(port, 16, 300))
            await _until_admitted(port, 16)  # on a loaded machine 0.8 s may not be enough
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            post = (("127.0.0.1", port), "POST", "/generate", {"prompt": [1]})
            refused = await asyncio.to_thread(exchange, *post)
            return refused, await clients

        (resp, text), outcomes = asyncio.run(run())
        assert [o for o, _ in outcomes] == ["whole"] * 16
        assert resp.status == 503 and resp.getheader("retry-after") == "5", text
        assert proc.wait(30) == 0
        assert "SIGTERM: drained, stopped" in proc.stderr.read()
        assert not _left([engine, *children])


def test_a_drain_past_its_timeout_fails_what_is_left_and_exits_128_plus_n(plan):
    # --drain-timeout 0: the drain ends at once, so the 8 streams of 300 tokens still held by the
    # engine are failed (an error, never a short answer passed off as whole) and the exit is 143
    with _cli(plan, "--max-model-len", "320", "--drain-timeout", "0") as (proc, port, engine):
        children = _children(proc.pid)

        async def run():
            clients = asyncio.create_task(_stream_all(port, 8, 300))
            await _until_admitted(port, 8)
            proc.send_signal(signal.SIGTERM)
            return await clients

        outcomes = asyncio.run(run())
        assert all(o.startswith("error: APIError") for o, _ in outcomes), outcomes
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert "SIGTERM: stopped before every request finished" in proc.stderr.read()
        assert not _left([engine, *children])


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_dead_front_end_frees_its_requests_seats_and_blocks(tmp_path):
    long = dataclasses.replace(SPEC, max_model_len=4096)  # streams that outlive the test's steps
    plan = tmp_path / "plan.yaml"  # 32 seats: connections land on a front end as the kernel
    plan.write_text(plan_text(seqs=32))  # picks, and none waits for a seat while both get one
    s = Server(plan, spec=long, progress=False, processes=True, api_server_count=2).start()
    conns: dict[str, list] = {"0": [], "1": []}
    try:
        assert s.wait_ready(120)
        child = s._supervisor.frontends[0]
        while not (conns["0"] and conns["1"]) and sum(map(len, conns.values())) < 32:
            conn = http.client.HTTPConnection(*s.address, timeout=30)
            body = b'{"prompt": [1, 2], "max_tokens": 4000, "stream": true}'
            conn.request("POST", "/generate", body)
            resp = conn.getresponse()
            assert resp.readline()  # running
            conns[resp.getheader("x-graphplan-frontend")].append(conn)
        assert conns["0"] and conns["1"], {k: len(v) for k, v in conns.items()}
        os.kill(child.pid, signal.SIGKILL)  # its streams' requests are orphans now
        # Each of the dead front end's requests ends once: 499 (freed), or 200 where a slow
        # machine finished it whole first; the live front end's are all still running.
        text, deadline = "", time.monotonic() + 60

        def ended(text):
            return sum(
                _metric(text, f'graphplan_server_requests_total{{code="{c}"}}') for c in (200, 499)
            )

        while time.monotonic() < deadline:
            text = exchange(s.address, "GET", "/metrics")[1]
            if ended(text) == len(conns["1"]):
                break
            time.sleep(0.05)
        assert ended(text) == len(conns["1"])
        assert _metric(text, 'graphplan_server_requests_total{code="499"}') >= 1
        assert _metric(text, "graphplan_server_running_requests") == len(conns["0"])
    finally:
        for c in conns["0"]:
            c.close()
        s.stop()
