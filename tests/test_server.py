"""graphplan's server on loopback (CPU stand-in for graphs, ephemeral ports): readiness, greedy
correctness under continuous batching, bad requests, metrics, plan swaps, SIGHUP, shutdown."""

import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from graphplan.models.tiny_llama import greedy, greedy_mismatch, reference_generate
from graphplan.runtime import GraphRunner
from graphplan.server import ModelSpec, Server, build_model, load_table

ROOT = Path(__file__).resolve().parents[1]

SPEC = ModelSpec(layers=2, hidden=64, vocab_size=128, max_model_len=48, seed=0)
SPEC_ARGS = ["--layers", "2", "--hidden", "64", "--vocab-size", "128", "--max-model-len", "48"]
TOKEN = "test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def plan_text(name="t", sizes=(1, 2, 4, 8), mode="FULL_AND_PIECEWISE", seqs=8) -> str:
    return (
        f"version: 1\nname: {name}\n"
        f"scheduler: {{max_num_seqs: {seqs}, max_num_batched_tokens: 64}}\n"
        f"cudagraph: {{mode: {mode}, attention_support: ALWAYS, splitting_ops: [attention], "
        f"capture_sizes: {list(sizes)}}}\n"
    )


@pytest.fixture
def plan_file(tmp_path):
    p = tmp_path / "plan.yaml"
    p.write_text(plan_text())
    return p


@pytest.fixture
def server(plan_file):
    s = Server(plan_file, spec=SPEC, progress=False, max_body_bytes=4096, admin_token=TOKEN).start()
    assert s.wait_ready(30)
    yield s
    s.stop()


@lru_cache(maxsize=None)
def _reference(prompt: tuple, max_tokens: int, device: str = "cpu") -> list[int]:
    """Offline greedy for this prompt alone, on a model built like the server's."""
    return reference_generate(_ref_model(device), [list(prompt)], max_tokens)[0]


@lru_cache(maxsize=None)
def _ref_model(device: str):
    if device == "cpu":
        return build_model(SPEC, load_table_from_text(plan_text()), device)
    return build_model(ModelSpec(), load_table(ROOT / "plans" / "tiny-llama.yaml"), device)


def load_table_from_text(text):
    import yaml

    from graphplan.compiler import compile_plan

    return compile_plan(yaml.safe_load(text))


def exchange(
    server, method, path, body=None, headers=None, raw: bytes | None = None, timeout: float = 60
):
    """One HTTP request to ``server`` (a running app, or (host, port)): (response, body text).
    ``body`` is sent as JSON, ``raw`` as is."""
    host, port = server.address if hasattr(server, "address") else server
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    try:
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        return resp, resp.read().decode()
    finally:
        conn.close()


def request(server, method, path, body=None, headers=None, raw: bytes | None = None):
    resp, text = exchange(server, method, path, body, headers, raw)
    ctype = resp.getheader("Content-Type", "")
    if "ndjson" in ctype:
        return resp.status, [json.loads(line) for line in text.splitlines()]
    return resp.status, json.loads(text) if "json" in ctype else text


def random_prompts(n, seed):
    rng = random.Random(seed)
    return [
        ([rng.randrange(SPEC.vocab_size) for _ in range(rng.randint(1, 20))], rng.randint(1, 12))
        for _ in range(n)
    ]


def run_concurrently(fns):
    out = [None] * len(fns)

    def call(i):
        out[i] = fns[i]()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def generate(server, prompt, max_tokens, stream=False):
    status, body = request(
        server, "POST", "/generate", {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    )
    assert status == 200, body
    if stream:
        assert [line["token"] for line in body[:-1]] == body[-1]["tokens"] and body[-1]["done"]
        return body[-1]["tokens"]
    return body["tokens"]


def test_healthz_is_503_until_the_graphs_are_captured_then_200(plan_file, monkeypatch):
    gate = threading.Event()
    real_capture = GraphRunner.capture

    def slow_capture(self, *a, **kw):
        assert gate.wait(30)
        return real_capture(self, *a, **kw)

    monkeypatch.setattr(GraphRunner, "capture", slow_capture)
    s = Server(plan_file, spec=SPEC, progress=False).start()
    try:
        status, body = request(s, "GET", "/healthz")
        assert status == 503 and body["status"] == "starting"
        status, body = request(s, "POST", "/generate", {"prompt": [1, 2], "max_tokens": 2})
        assert status == 503 and "capturing graphs" in body["error"]["message"]
        gate.set()
        assert s.wait_ready(30)
        status, body = request(s, "GET", "/healthz")
        assert status == 200 and body["status"] == "ready" and body["plan"] == "t"
    finally:
        gate.set()
        s.stop()


def record_logits(server) -> dict:
    """Wraps the sampler's launch (synchronous steps and async scheduling's alike): request -> the
    logits rows its tokens were picked from. Async scheduling may launch one step more for a
    request that stopped (its token dropped): compare the first ``len(out)`` rows."""
    rows: dict = {}
    sampler = server.engine.sampler
    launch = sampler.launch

    def recording(batch, logits, **kw):  # a StepLogits (server/core/step_logits.py)
        for rid, i in zip(batch.request_ids, batch.sample_rows):
            if i >= 0:
                row = logits.rows(torch.tensor([i], device=logits.device))[0]
                rows.setdefault(rid, []).append(row.to("cpu", torch.float32, copy=True))
        return launch(batch, logits, **kw)

    sampler.launch = recording
    return rows


def assert_logits_equal_offline(rows: dict, device: str = "cpu") -> None:
    """Each request's logits equal those of offline greedy decoding of its prompt alone, fed the
    same tokens (teacher forcing), within tiny_llama.LOGIT_TOL of the model dtype."""
    ref = _ref_model(device)
    assert rows
    for r, got in rows.items():
        assert len(r.out) <= len(got) <= len(r.out) + 1
        _, want = greedy(ref, [r.prompt], len(r.out), forced=[r.out])
        bad = greedy_mismatch([r.out], [torch.stack(got[: len(r.out)])], want, ref.kv_cache.dtype)
        assert bad is None, (r.prompt, bad)


def test_concurrent_generates_equal_offline_greedy_for_each_prompt_alone(server):
    rows = record_logits(server)
    work = random_prompts(20, seed=1)  # more requests than KV rows (8): queueing and row reuse
    outs = run_concurrently(
        [
            lambda p=p, n=n, i=i: generate(server, p, n, stream=i % 3 == 0)
            for i, (p, n) in enumerate(work)
        ]
    )
    assert outs == [_reference(tuple(p), n) for p, n in work]
    assert len(rows) == 20
    assert_logits_equal_offline(rows)  # logits too, not only tokens
    status, body = request(
        server, "POST", "/generate", {"prompts": [p for p, _ in work[:3]], "max_tokens": 5}
    )
    assert status == 200
    assert [r["tokens"] for r in body["results"]] == [_reference(tuple(p), 5) for p, _ in work[:3]]
    status, lines = request(
        server,
        "POST",
        "/generate",
        {"prompts": [p for p, _ in work[:2]], "max_tokens": 3, "stream": True},
    )
    finals = {x["prompt"]: x["tokens"] for x in lines if x.get("done")}
    assert status == 200 and finals == {i: _reference(tuple(work[i][0]), 3) for i in range(2)}
    assert len([x for x in lines if "token" in x]) == 6
    m = server.engine.metrics
    mixed = m.value("graphplan_server_steps_total", kind="mixed")
    decode = m.value("graphplan_server_steps_total", kind="decode")
    assert mixed > 0 and decode > 0
    assert m.value("graphplan_server_step_tokens_total") > mixed + decode  # steps did batch
    assert server.engine.num_running() == 0 and not server.engine.batcher.has_work()


BAD = [  # (raw body or None for the JSON object, JSON object, headers, status, message)
    (b"{not json", None, {}, 400, "malformed JSON"),
    (b"[1, 2]", None, {}, 400, "must be a JSON object"),
    (None, {"max_tokens": 3}, {}, 400, "exactly one of 'prompt'"),
    (None, {"prompt": [1], "prompts": [[1]]}, {}, 400, "exactly one of 'prompt'"),
    (None, {"prompt": [1], "max_token": 3}, {}, 400, "did you mean 'max_tokens'"),
    (None, {"prompt": "hello"}, {}, 400, "list of integer token ids"),
    (None, {"prompt": [1, 2.5]}, {}, 400, "list of integer token ids"),
    (None, {"prompt": [1, True]}, {}, 400, "list of integer token ids"),
    (None, {"prompt": [1], "max_tokens": "3"}, {}, 400, "must be an integer"),
    (None, {"prompt": [1], "stream": "yes"}, {}, 400, "'stream' must be true or false"),
    (None, {"prompts": []}, {}, 400, "non-empty list"),
    (None, {"prompt": []}, {}, 422, "is empty"),
    (None, {"prompt": [1, 128]}, {}, 422, r"\[1\]: token id 128 is outside the vocabulary 0..127"),
    (None, {"prompt": [-1]}, {}, 422, "outside the vocabulary"),
    (None, {"prompt": [1], "max_tokens": 0}, {}, 422, "must be >= 1"),
    (None, {"prompt": [1], "max_tokens": -4}, {}, 422, "must be >= 1"),
    (None, {"prompt": [1] * 48}, {}, 422, "has 48 tokens; the limit is 47"),
    (None, {"prompt": [1] * 40, "max_tokens": 9}, {}, 422, "exceed max_model_len=48"),
    (None, {"prompts": [[1], [1, 999]]}, {}, 422, r"'prompts'\[1\]\[1\]"),
    (b"x" * 5000, None, {}, 413, "over the limit of 4096"),
]


def test_every_bad_request_gets_a_4xx_with_a_clear_message_and_the_server_keeps_serving(server):
    for raw, obj, headers, status, message in BAD:
        got, body = request(server, "POST", "/generate", obj, headers, raw=raw)
        assert got == status, (raw, obj, body)
        assert re.search(message, body["error"]["message"]), body
    # a request without Content-Length, unknown endpoints
    conn = http.client.HTTPConnection(*server.address, timeout=10)
    conn.putrequest("POST", "/generate")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 411 and "Content-Length" in json.loads(resp.read())["error"]["message"]
    conn.close()
    assert request(server, "GET", "/nope")[0] == 404
    assert request(server, "POST", "/nope", {})[0] == 404
    assert generate(server, [3, 1, 4], 6) == _reference((3, 1, 4), 6)
    assert server.engine.metrics.value("graphplan_server_step_errors_total") == 0


def test_a_failing_step_fails_only_its_requests_with_500_and_the_loop_continues(server):
    runner = server.engine.runner
    calls = []

    def broken_once(*a, **kw):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected")
        return type(runner).step(runner, *a, **kw)

    runner.step = broken_once
    status, body = request(server, "POST", "/generate", {"prompt": [5, 6], "max_tokens": 3})
    assert status == 500 and "injected" in body["error"]["message"]
    assert generate(server, [5, 6], 3) == _reference((5, 6), 3)
    assert server.engine.metrics.value("graphplan_server_step_errors_total") == 1
    assert not server.engine.batcher.has_work()


def test_metrics_expose_the_runner_and_server_series(server):
    generate(server, [1, 2, 3], 4)
    status, text = request(server, "GET", "/metrics")
    assert status == 200
    fp, stats = server.engine.table.fingerprint, server.engine.runner.stats()
    assert stats["replays"] + sum(stats["eager_steps"].values()) == 4  # 1 prefill + 3 decodes
    for series in (
        f'graphplan_plan_info{{plan="t",fingerprint="{fp}",backend="cpu-stand-in"}} 1',
        f'graphplan_graph_replays_total{{fingerprint="{fp}",graph=',
        "graphplan_graph_padding_tokens_total{",
        "# TYPE graphplan_eager_steps_total counter",
        "graphplan_capture_seconds ",
        "graphplan_capture_bytes ",
        f"graphplan_captured_graphs {stats['capture']['graphs']}",
        'graphplan_server_requests_total{code="200"} 1',
        "graphplan_server_generated_tokens_total 4",
        "graphplan_server_prompt_tokens_total 3",
        "graphplan_server_queue_depth 0",
        "graphplan_server_running_requests 0",
        'graphplan_server_steps_total{kind="decode"} 3',
        "# TYPE graphplan_server_step_seconds histogram",
        'graphplan_server_step_seconds_bucket{le="+Inf"} 4',
        "graphplan_server_step_seconds_count 4",
        'graphplan_server_request_seconds_bucket{le="+Inf"} 1',
    ):
        assert series in text, series


def _series(text: str, name: str) -> dict[str, float]:
    """{labels: value} of one Prometheus series."""
    return {
        m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)
    }


def test_metrics_count_every_response_by_code(server):
    generate(server, [1, 2], 2)
    assert request(server, "POST", "/generate", {"prompt": [], "max_tokens": 2})[0] == 422
    assert request(server, "GET", "/nowhere")[0] == 404
    assert request(server, "GET", "/healthz")[0] == 200
    text = request(server, "GET", "/metrics")[1]
    got = _series(text, "graphplan_server_http_responses_total")
    assert got == {
        'code="200",endpoint="/generate"': 1,
        'code="422",endpoint="/generate"': 1,
        'code="404",endpoint="other"': 1,
        'code="200",endpoint="/healthz"': 1,
    }
    text = request(server, "GET", "/metrics")[1]  # the first scrape is counted by the next
    assert (
        _series(text, "graphplan_server_http_responses_total")['code="200",endpoint="/metrics"']
        == 1
    )


def test_replay_counters_stay_cumulative_per_plan_fingerprint_across_reloads(
    server, plan_file, tmp_path
):
    other = plan_file.parent / "other-cumulative.yaml"  # inside the reload directory
    other.write_text(plan_text(name="t2", sizes=(1, 2, 4), mode="FULL"))
    fp_a = server.engine.table.fingerprint

    def replays(fp):
        text = request(server, "GET", "/metrics")[1]
        return sum(
            v
            for k, v in _series(text, "graphplan_graph_replays_total").items()
            if f'fingerprint="{fp}"' in k
        )

    generate(server, [1, 2, 3], 4)
    a1 = replays(fp_a)
    assert a1 > 0
    status, body = request(server, "POST", "/admin/reload", {"path": str(other)}, ADMIN)
    assert status == 200 and body["previous"] == fp_a
    fp_b = body["fingerprint"]
    assert replays(fp_a) == a1  # the swapped-out plan's counters are kept, not reset
    generate(server, [4, 5], 3)
    b1 = replays(fp_b)
    assert b1 > 0 and replays(fp_a) == a1
    status, body = request(server, "POST", "/admin/reload", {"path": str(plan_file)}, ADMIN)
    assert status == 200 and body["fingerprint"] == fp_a
    generate(server, [1, 2, 3], 4)
    assert replays(fp_a) == 2 * a1 and replays(fp_b) == b1  # A continues from its total
    text = request(server, "GET", "/metrics")[1]
    eager = sum(_series(text, "graphplan_eager_steps_total").values())
    steps = sum(_series(text, "graphplan_server_steps_total").values())
    assert replays(fp_a) + replays(fp_b) + eager == steps  # every step of every plan counted


def test_reload_with_a_good_plan_switches_between_steps_and_requests_in_flight_finish(
    server, tmp_path
):
    new = tmp_path / "new.yaml"
    new.write_text(plan_text(name="t2", sizes=(1, 2, 4), mode="FULL", seqs=4))  # fewer seats
    old_fp = server.engine.table.fingerprint
    work = random_prompts(12, seed=2)
    work = [(p, 30 - len(p) % 7) for p, _ in work]  # long enough to straddle the swap
    results = []
    clients = threading.Thread(
        target=lambda: results.extend(
            run_concurrently(
                [lambda p=p, n=n: generate(server, p, n, stream=True) for p, n in work]
            )
        )
    )
    clients.start()
    deadline = time.monotonic() + 20
    while server.engine.num_running() <= 4 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert server.engine.num_running() > 4  # more than the new plan seats: the switch waits
    status, body = request(server, "POST", "/admin/reload", {"path": str(new)}, ADMIN)
    in_flight = server.engine.num_running()
    clients.join(60)
    assert status == 200 and body["previous"] == old_fp and body["plan"] == "t2", body
    assert in_flight > 0
    assert body["fingerprint"] == server.engine.table.fingerprint != old_fp
    assert request(server, "GET", "/healthz")[1]["fingerprint"] == body["fingerprint"]
    assert results == [_reference(tuple(p), n) for p, n in work]
    assert server.engine.runner.stats()["replays"] > 0  # the new runner served the tail
    status, body = request(server, "POST", "/admin/reload", {"path": str(new)}, ADMIN)
    assert status == 200 and body["unchanged"]
    table = tmp_path / "table.json"  # a compiled table loads without the YAML stack
    load_table_from_text(plan_text(name="t3", sizes=(1, 8), mode="FULL")).save(table)
    status, body = request(server, "POST", "/admin/reload", {"path": str(table)}, ADMIN)
    assert status == 200 and body["plan"] == "t3" and body["capture"]["graphs"] == 2
    status, body = request(
        server,
        "POST",
        "/admin/reload",
        {"path": str(table), "set": {"cudagraph.mode": "NONE"}},
        ADMIN,
    )
    assert status == 422 and "applies to plans, not to a compiled table" in body["error"]["message"]
    assert generate(server, [8, 1], 4) == _reference((8, 1), 4)


def test_reload_with_a_bad_plan_is_rejected_and_the_old_plan_kept(server, tmp_path):
    fp = server.engine.table.fingerprint
    bad = tmp_path / "bad.yaml"
    bad.write_text(plan_text(mode="FULL_DECODE"))
    too_big = tmp_path / "big.yaml"
    too_big.write_text(plan_text(seqs=16))
    for body, status, message in [
        ({"path": str(bad)}, 422, r"bad\.yaml:\d+:\d+: error.*did you mean 'FULL_DECODE_ONLY'"),
        ({"path": str(too_big)}, 422, "max_num_seqs=16, but this server's KV cache has 8 rows"),
        ({"path": str(tmp_path / "missing.yaml")}, 422, "missing.yaml: error.*no such file"),
        ({"path": 3}, 400, "'path' must be a non-empty string"),
        ({"set": ["x"]}, 400, "'set' must be an object"),
        (None, 400, "malformed JSON"),
    ]:
        raw = b"{" if body is None else None
        got, reply = request(server, "POST", "/admin/reload", body, ADMIN, raw=raw)
        assert got == status and re.search(message, reply["error"]["message"]), reply
        assert status == 400 or f"still serving {fp[:19]}" in reply["error"]["message"]
        assert server.engine.table.fingerprint == fp
    got, reply = request(
        server,
        "POST",
        "/admin/reload",  # the bad plan, fixed by an override
        {"path": str(bad), "set": {"cudagraph.mode": "NONE"}},
        ADMIN,
    )
    assert got == 200 and server.engine.runner.stats()["capture"]["graphs"] == 0, reply
    m = server.engine.metrics
    assert [m.value("graphplan_server_reloads_total", result=r) for r in ("rejected", "ok")] == [
        3,
        1,
    ]
    assert generate(server, [9, 9], 4) == _reference((9, 9), 4)


def test_sighup_rereads_the_start_up_plan_and_keeps_the_old_one_if_it_is_bad(server, plan_file):
    fp = server.engine.table.fingerprint
    plan_file.write_text(plan_text(mode="FULL_DECODE"))
    server.handle_sighup(signal.SIGHUP, None).join(30)
    assert server.engine.table.fingerprint == fp
    plan_file.write_text(plan_text(sizes=(1, 2, 8), mode="FULL"))
    server.handle_sighup(signal.SIGHUP, None).join(30)
    assert server.engine.table.fingerprint != fp
    assert server.engine.runner.stats()["capture"]["graphs"] == 3
    assert generate(server, [7, 7, 7], 5) == _reference((7, 7, 7), 5)


def test_stop_drains_in_flight_requests_and_leaves_no_threads(plan_file):
    before = set(threading.enumerate())
    s = Server(plan_file, spec=SPEC, progress=False).start()
    assert s.wait_ready(30)
    idle = http.client.HTTPConnection(*s.address, timeout=10)
    idle.request("GET", "/healthz")  # a keep-alive connection left open and idle
    assert idle.getresponse().read()
    got = []
    t = threading.Thread(target=lambda: got.append(generate(s, [4, 2], 20)))
    t.start()
    while s.engine.num_running() == 0 and t.is_alive():
        time.sleep(0.002)
    s.stop()
    t.join(10)
    assert got == [_reference((4, 2), 20)]  # the request in flight finished
    assert s.engine.state == "stopped"
    idle.close()
    assert set(threading.enumerate()) - before == set()


def _wait_for_port(proc, deadline):
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            return int(m.group(1))
        if not line and proc.poll() is not None:
            break
    raise AssertionError("".join(lines))


def test_cli_refuses_a_bad_plan_with_the_compiler_message_and_exit_code(tmp_path, capsys):
    from graphplan.server.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(plan_text(mode="FULL_DECODE"))
    assert main(["--plan", str(bad), "--port", "0", "--device", "cpu", *SPEC_ARGS]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'FULL_DECODE_ONLY'" in err and "Traceback" not in err
    assert main(["--plan", str(bad), "--set", "cudagraph.mode", "--device", "cpu"]) == 1
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_cli_serves_reloads_on_sighup_and_stops_cleanly_on_sigterm(plan_file):
    cmd = [
        sys.executable,
        "-m",
        "graphplan.server",
        "--plan",
        str(plan_file),
        "--port",
        "0",
        "--device",
        "cpu",
        "--no-progress",
        *SPEC_ARGS,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        port = _wait_for_port(proc, time.monotonic() + 60)
        addr = ("127.0.0.1", port)
        deadline = time.monotonic() + 60
        while request(addr, "GET", "/healthz")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        fp = request(addr, "GET", "/healthz")[1]["fingerprint"]
        assert generate(addr, [1, 2, 3], 4) == _reference((1, 2, 3), 4)
        plan_file.write_text(plan_text(sizes=(1, 4)))
        proc.send_signal(signal.SIGHUP)
        while request(addr, "GET", "/healthz")[1]["fingerprint"] == fp:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert generate(addr, [1, 2, 3], 4) == _reference((1, 2, 3), 4)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # nothing in flight: drained at once, exit 0, says so
        assert proc.wait(30) == 0 and time.monotonic() - t0 < 10
        assert "SIGTERM: drained, stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


@pytest.mark.gpu
def test_server_on_cuda_generates_offline_greedy_tokens_with_graphs():
    s = Server(ROOT / "plans" / "tiny-llama.yaml", device="cuda", progress=False).start()
    try:
        assert s.wait_ready(120), s.engine.error
        rows = record_logits(s)
        rng = random.Random(3)
        work = [
            ([rng.randrange(2048) for _ in range(rng.randint(1, 40))], rng.randint(1, 40))
            for _ in range(24)
        ]
        outs = run_concurrently([lambda p=p, n=n: generate(s, p, n) for p, n in work])
        assert_logits_equal_offline(rows, "cuda")  # float32: LOGIT_TOL 1e-3
        assert outs == [_reference(tuple(p), n, "cuda") for p, n in work]
        stats = s.engine.runner.stats()
        assert stats["backend"] == "cuda" and stats["replays"] > 0
        assert torch.cuda.is_available()
    finally:
        s.stop()
