"""graphplan-serve with a plan of ``parallel.tensor_parallel_size`` 2 (server/core/tp_serving.py,
tp_worker.py): the engine process is rank 0 and starts the worker rank, 2 Gloo ranks on the CPU,
started as a user starts the server and driven with the official openai client. The greedy text and
ids, streamed and not, are TP=1's; with prefix caching (rank 0 decides every KV block and sends
them) ``cached_tokens`` is exact and the answers are TP=1's without the cache, also in a pool that
preempts; a worker SIGKILLed under streaming clients errors every open stream and ends every
process with exit 1; SIGTERM lets the streams in flight finish (exit 0, the worker stopped); what
TP does not run is refused by name."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest
import torch
from test_engine_process import _children, _left, _start_cli, _stream_all, _until_admitted
from test_server import ADMIN, TOKEN, exchange
from test_tp import save

from graphplan.compiler import compile_plan
from graphplan.compiler.errors import GraphplanError, TableError
from graphplan.server import Server
from graphplan.server.core.hf_model import HFSpec
from graphplan.server.core.model import check_fits
from graphplan.server.core.tp_serving import check_serving

from hf_models import sharpen_attention, small_config, write_tokenizer
from served import openai_client, start_server

PLAN = (
    "version: 1\nname: hf-tp\nscheduler: {max_num_seqs: 4, max_num_batched_tokens: 32}\n"
    "cudagraph: {mode: FULL_AND_PIECEWISE, attention_support: ALWAYS, capture_sizes: [1, 2, 4]}\n"
    "parallel: {tensor_parallel_size: 2}\n"
)
PROMPTS = ["w1 w7 w30", "w4 w2", "w9 w9 w9 w9 w9 w9 w9 w9 w9 w9 w9", "w100"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama with one KV head (replicated to both ranks) and its tokenizer, as saved."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    return write_tokenizer(save(path, "llama", kv_heads=1))


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    path.write_text(PLAN)
    return path


def _workers(engine: int) -> list[int]:
    """The engine process's worker ranks (not multiprocessing's resource tracker)."""
    out = []
    for pid in _children(engine):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                out.append(pid)
    return out


def _serve_flags(llama, max_model_len=32) -> list[str]:
    return ["--model", str(llama), "--max-model-len", str(max_model_len)]


def _answers(client) -> tuple:
    """Greedy text and ids (batched, streamed), a seeded sample, a stop string's answer, and the
    openai exceptions of a too-long request and of chat without a template."""
    res = client.completions.create(model="llama", prompt=PROMPTS, max_tokens=8, temperature=0)
    streamed = [
        [
            (ch.choices[0].text, tuple(ch.choices[0].token_ids or ()))
            for ch in client.completions.create(
                model="llama", prompt=p, max_tokens=6, temperature=0, stream=True
            )
        ]
        for p in PROMPTS[:2]
    ]
    seeded = client.completions.create(
        model="llama", prompt=PROMPTS[0], max_tokens=8, temperature=0.8, seed=7
    ).choices[0]
    stopped = client.completions.create(
        model="llama", prompt=PROMPTS[1], max_tokens=8, temperature=0, stop=[" "]
    ).choices[0]
    errors = []
    for call in (
        lambda: client.completions.create(model="llama", prompt=PROMPTS[0], max_tokens=10_000),
        lambda: client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "w1"}], max_tokens=4
        ),
    ):
        with pytest.raises(openai.APIStatusError) as e:
            call()
        errors.append((type(e.value).__name__, e.value.status_code))
    return (
        [(c.text, c.token_ids) for c in res.choices],
        streamed,
        (seeded.text, seeded.token_ids),
        (stopped.text, stopped.finish_reason),
        errors,
    )


def test_two_ranks_serve_the_greedy_text_and_ids_of_one(plan, llama, tmp_path_factory):
    one = start_server(tmp_path_factory, llama, PLAN.replace("size: 2", "size: 1"), 32)
    try:
        want = _answers(openai_client(one))
    finally:
        one.stop()
    flags = [*_serve_flags(llama), "--admin-token", TOKEN]
    proc, port, engine = _start_cli(plan, *flags, spec_args=[])
    try:
        assert len(_workers(engine)) == 1
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        got = _answers(c)
        reload = exchange(("127.0.0.1", port), "POST", "/admin/reload", {}, ADMIN)
        assert reload[0].status == 409 and "not built for tensor-parallel" in reload[1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert (
        got == want
        and all(ids for _, ids in got[0])
        and all(sum(len(i) for _, i in s) == 6 for s in got[1])
    )
    assert "tensor parallelism: 2 ranks" in err and "async scheduling off" in err
    assert "tensor-parallel rank 1: stopped after" in err


def test_a_worker_killed_under_streaming_clients_errors_them_and_ends_every_process(plan, llama):
    proc, port, engine = _start_cli(plan, *_serve_flags(llama, 96), spec_args=[])
    try:
        workers = _workers(engine)
        front = [p for p in _children(proc.pid) if p != engine]

        async def run():
            clients = asyncio.create_task(_stream_all(port, 8, 80, model="llama"))
            await _until_admitted(port, 8)  # held by the engine: none can be whole yet
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            return time.monotonic(), await clients

        killed, outcomes = asyncio.run(run())
        kinds = {o.split(":")[0] for o, _ in outcomes}
        assert kinds <= {"whole", "error"} and "error" in kinds, outcomes
        assert proc.wait(30) == 1 and time.monotonic() - killed < 30
        assert "tensor-parallel rank 1 died" in proc.stderr.read()
        assert not _left([engine, *workers, *front], within=5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_sigterm_lets_the_streams_in_flight_finish_and_stops_the_worker(plan, llama):
    proc, port, engine = _start_cli(
        plan, *_serve_flags(llama, 64), "--drain-timeout", "300", spec_args=[]
    )
    try:
        workers = _workers(engine)

        async def run():
            clients = asyncio.create_task(_stream_all(port, 6, 40, model="llama"))
            await _until_admitted(port, 6)
            proc.send_signal(signal.SIGTERM)
            return await clients

        outcomes = asyncio.run(run())
        assert [o for o, _ in outcomes] == ["whole"] * 6
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "SIGTERM: drained, stopped" in err and "tensor-parallel rank 1: stopped" in err
        assert not _left([engine, *workers])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_ranks_that_do_not_divide_the_heads_fail_start_up_by_name(plan, llama):
    cmd = [sys.executable, "-m", "graphplan.server", "--plan", str(plan), "--port", "0"]
    cmd += ["--device", "cpu", "--no-progress", *_serve_flags(llama)]
    cmd += ["--set", "parallel.tensor_parallel_size=3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "TensorParallelError" in out.stderr and "Traceback" not in out.stderr
    assert "the engine failed" in out.stderr


@pytest.mark.parametrize(
    "name, value, why",
    [
        ("GRAPHPLAN_TP_SYMM_ALGO", "three", "one of auto, one_shot, two_shot"),
        ("GRAPHPLAN_TP_SYMM_MAX_BYTES", "8M", "a non-negative integer of bytes, e.g. 1048576"),
    ],
)
def test_a_bad_symmetric_memory_setting_is_refused_before_anything_starts(
    plan, llama, name, value, why
):
    """The TP ranks' symmetric-memory settings are read by graphplan-serve itself first: a value
    they do not take is a usage error (exit 2) naming the variable and what it takes, before a
    port is bound or a process spawned."""
    cmd = [sys.executable, "-m", "graphplan.server", "--plan", str(plan), "--port", "0"]
    cmd += ["--device", "cpu", "--no-progress", *_serve_flags(llama)]
    cmd += ["--set", "parallel.tensor_parallel_size=2"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, name: value}
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1].endswith(f"error: {name}={value!r}: {why}"), out.stderr
    assert "Traceback" not in out.stderr and "listening" not in out.stderr


def hf_decode_table(**sets):
    """plans/hf-decode.yaml compiled with ``--set key=value`` for each of ``sets``."""
    from graphplan.compiler.cli.inputs import parse_overrides

    return compile_plan(
        "plans/hf-decode.yaml", parse_overrides([f"{k}={v}" for k, v in sets.items()])
    )


def _table(**overrides):
    return hf_decode_table(**{"parallel.tensor_parallel_size": 2, **overrides})


class StubModel:
    """What ``check_fits`` reads of a built model: its KV-cache rows."""

    class cfg:
        num_cache_rows = 64


def one_rank_answers_on_cuda(llama, tmp_path_factory):
    """The float32 answers of the test Llama served by one in-process rank on cuda:0."""
    path = tmp_path_factory.mktemp("plan") / "one.yaml"
    path.write_text(PLAN.replace("size: 2", "size: 1"))
    spec = HFSpec(model=str(llama), max_model_len=32, dtype="float32")
    one = Server(path, spec=spec, device="cuda", progress=False).start()
    try:
        assert one.wait_ready(120), one.engine.error
        return _answers(openai_client(one))
    finally:
        one.stop()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(processes=False), "runs one process per rank: drop --single-process"),
        (dict(speculative=object()), "with --speculative-config: the worker ranks would not"),
        (dict(compile="inductor"), "with --compile is not built: drop --compile"),
    ],
)
def test_what_tensor_parallel_serving_does_not_run_is_refused_by_name(root, kw, message):
    os.chdir(root)
    args = dict(device="cpu", processes=True, speculative=None, compile="") | kw
    with pytest.raises(GraphplanError, match="parallel.tensor_parallel_size=2 " + message):
        check_serving(_table(), **args)
    check_serving(_table(**{"parallel.tensor_parallel_size": 1}), **args)  # one rank: anything


def test_a_reload_cannot_start_tensor_parallel_ranks(root):
    os.chdir(root)
    with pytest.raises(TableError, match="a reload cannot start tensor-parallel ranks; restart"):
        check_fits(_table(), StubModel())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpu_ranks_serve_the_greedy_text_and_ids_of_one(plan, llama, tmp_path_factory):
    flags = [*_serve_flags(llama), "--dtype", "float32"]
    want = one_rank_answers_on_cuda(llama, tmp_path_factory)
    proc, port, engine = _start_cli(plan, *flags, spec_args=[], device="cuda")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert _answers(c) == want
        workers = _workers(engine)
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(30) == 1
        assert not _left([engine, *workers], within=5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


@pytest.fixture(scope="module")
def sharp_llama(tmp_path_factory):
    """The Llama with its attention sharpened (hf_models.sharpen_attention), as saved: logits the
    context moves, so a rank that read other KV blocks than rank 0's would change the answers."""
    from graphplan.models.hf import load_model

    path = tmp_path_factory.mktemp("sharp") / "llama"  # served as "llama"
    model = load_model(
        small_config("llama", kv_heads=1), seed=0, attn_implementation="eager", random_weights=True
    )
    sharpen_attention(model).save_pretrained(path)
    return write_tokenizer(path)


@contextlib.contextmanager
def _serving(plan, *flags):
    """graphplan-serve of ``plan`` (process, port), killed at the end unless it exited."""
    proc, port, _ = _start_cli(plan, *flags, spec_args=[])
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


SHARED = " ".join(f"w{i}" for i in range(3, 43))  # 40 words: 2 whole 16-token blocks and more


def _cached_answer(client, prompt, n: int = 16) -> tuple[list, list[list[float]], list[int]]:
    """(text and ids, token logprobs, cached tokens) of each choice of one request."""
    res = client.completions.create(
        model="llama", prompt=prompt, max_tokens=n, temperature=0, logprobs=0
    )
    details = res.usage.prompt_tokens_details
    answers = [(ch.text, ch.token_ids) for ch in res.choices]
    lps = [ch.logprobs.token_logprobs for ch in res.choices]
    return answers, lps, [details.cached_tokens if details else 0]


def _close(a: list[list[float]], b: list[list[float]], tol: float = 1e-3) -> bool:
    """Logprobs equal within ``tol`` (a cached prefix's K/V read, not recomputed, and TP's sums
    change float rounding only; a follower reading other blocks changes them by far more)."""
    return all(
        len(x) == len(y) and max(map(abs, map(float.__sub__, x, y))) < tol for x, y in zip(a, b)
    )


@pytest.mark.parametrize("kv_tokens", [None, 96])
def test_two_ranks_keep_prefix_caching_with_exact_cached_tokens_and_tp1s_answers(
    plan, sharp_llama, tmp_path_factory, kv_tokens
):
    """Rank 0 decides every KV block (cached ones too) and sends each step's new blocks: the
    second prompt sharing a 40-word start finds its first two 16-token blocks cached (32 tokens),
    the answers are TP=1's without the cache, also in a 6-block pool that preempts."""
    prompts = [SHARED + " w1 w2", SHARED + " w5", SHARED + " w9 w8 w7", "w4 " + SHARED]
    one = start_server(
        tmp_path_factory,
        sharp_llama,
        PLAN.replace("size: 2", "size: 1"),
        64,
        enable_prefix_caching=False,
    )
    try:
        c1 = openai_client(one)
        want = _cached_answer(c1, prompts)
    finally:
        one.stop()
    flags = _serve_flags(sharp_llama, 64) + (
        ["--kv-cache-tokens", str(kv_tokens)] if kv_tokens else []
    )
    with _serving(plan, *flags) as (proc, port):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        first, second = (_cached_answer(c, p) for p in prompts[:2])
        assert (first[2], second[2]) == ([0], [32])
        assert first[0] + second[0] == want[0][:2] and _close(first[1] + second[1], want[1][:2])
        got = _cached_answer(c, prompts)  # together: sharing blocks, and preempting in 6 blocks
        assert got[0] == want[0] and _close(got[1], want[1])
        assert got[2] == [3 * 32]  # every prompt but "w4 ...": its first two blocks
        text = exchange(("127.0.0.1", port), "GET", "/metrics")[1]
        preempted = float(re.search(r"^graphplan_server_preemptions_total (\S+)$", text, re.M)[1])
        assert (preempted > 0) == (kv_tokens is not None)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
    assert "rank 0 decides every KV block (prefix caching as configured)" in err
