"""graphplan-serve with a plan of ``parallel.data_parallel_size`` 2 (server/core/dp_serving.py,
server/wire/engines.py): two engine processes stepping together through the DP agreement (Gloo on
the CPU), started as a user starts the server and driven with the official openai client. The
greedy ids (the tiny Llama, DP=2) and text (a saved Llama, DP=2 x TP=2: four processes) are one
engine's; both engines serve requests and step in lockstep (equal steps, waves ending together,
dummy steps while the peer works); SIGTERM lets the streams in flight finish (exit 0); an engine
SIGKILLed under streaming clients errors them and ends every process with exit 1; what DP does not
run is refused by name."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_process import (
    PROMPTS,
    _greedy,
    _left,
    _start_cli,
    _stream_all,
    _streamed,
    _until_admitted,
)
from test_engine_process import plan as plan
from test_server import exchange
from test_tp_serve import (
    PLAN,
    StubModel,
    _answers,
    _serve_flags,
    _workers,
    hf_decode_table,
    one_rank_answers_on_cuda,
)
from test_tp_serve import llama as llama

from graphplan.compiler.errors import GraphplanError, TableError
from graphplan.server.core.dp_serving import check_serving, engine_device
from graphplan.server.core.model import check_fits
from graphplan.server.wire.engines import Router, merge_metrics, server_state

from served import openai_client, start_server

DP2 = ["--set", "parallel.data_parallel_size=2"]


def _dp_metrics(port: int) -> dict[tuple[str, str], float]:
    """(series with its labels, engine) -> value, for the DP and request series of /metrics."""
    text = exchange(("127.0.0.1", port), "GET", "/metrics")[1]
    out = {}
    for m in re.finditer(
        r'^(graphplan_(?:dp_steps|server_requests)_total)\{engine="(\d)"(.*)\} (\S+)$', text, re.M
    ):
        out[m.group(1) + m.group(3), m.group(2)] = float(m.group(4))
    return out


def _lockstep(port: int, deadline: float = 10.0) -> dict:
    """/metrics once both engines are between waves: equal steps and waves (idle steps)."""
    end = time.monotonic() + deadline
    while True:
        got = _dp_metrics(port)
        steps = [
            sum(v for (k, e), v in got.items() if k.startswith("graphplan_dp") and e == d)
            for d in "01"
        ]
        idle = [got.get(('graphplan_dp_steps_total,kind="idle"', d)) for d in "01"]
        if (steps[0] == steps[1] and idle[0] == idle[1]) or time.monotonic() > end:
            return got
        time.sleep(0.1)


def test_two_engines_serve_the_ids_of_one_in_lockstep_and_drain_on_sigterm(plan):
    one, port1, _ = _start_cli(plan)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port1}/v1", api_key="x", max_retries=0)
        want = _greedy(c, "tiny-llama"), _streamed(c, "tiny-llama", PROMPTS[0], 9)
        one.send_signal(signal.SIGTERM)
        assert one.wait(30) == 0
    finally:
        if one.poll() is None:
            one.kill()
        one.stderr.close()
    proc, port, _ = _start_cli(plan, "--drain-timeout", "300", *DP2)  # far above the drain
    try:
        engines = _workers(proc.pid)
        assert len(engines) == 2
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert (_greedy(c, "tiny-llama"), _streamed(c, "tiny-llama", PROMPTS[0], 9)) == want
        got = _lockstep(port)
        done = [got[('graphplan_server_requests_total,code="200"', d)] for d in "01"]
        assert sorted(done) == [3, 4]  # 6 prompts in turn, then the stream to the less loaded
        kinds = {
            k: [got[(f'graphplan_dp_steps_total,kind="{k}"', d)] for d in "01"]
            for k in ("work", "dummy", "idle")
        }
        assert kinds["work"][0] + kinds["dummy"][0] == kinds["work"][1] + kinds["dummy"][1]
        assert kinds["idle"][0] == kinds["idle"][1] >= 1  # the waves ended together
        assert max(kinds["dummy"]) >= 8  # the stream's engine decoded while its peer waited

        async def run():
            clients = asyncio.create_task(_stream_all(port, 6, 40))
            await _until_admitted(port, 6)  # on a loaded machine a fixed wait may be too short
            proc.send_signal(signal.SIGTERM)
            return await clients

        outcomes = asyncio.run(run())
        assert [o for o, _ in outcomes] == ["whole"] * 6
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "SIGTERM: drained, stopped" in err and "data parallelism: engine 1 of 2" in err
        assert not _left(engines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_an_engine_killed_under_streaming_clients_errors_them_and_ends_every_process(plan):
    proc, port, _ = _start_cli(plan, "--max-model-len", "320", *DP2)
    try:
        engines = _workers(proc.pid)

        async def run():  # streams of 300 tokens: still streaming when the engine is killed
            clients = asyncio.create_task(_stream_all(port, 8, 300))
            await _until_admitted(port, 8)
            os.kill(engines[1], signal.SIGKILL)
            return time.monotonic(), await clients

        killed, outcomes = asyncio.run(run())
        kinds = {o.split(":")[0] for o, _ in outcomes}
        assert kinds <= {"whole", "error"} and "error" in kinds, outcomes
        assert proc.wait(30) == 1 and time.monotonic() - killed < 30
        assert "engine process 1 died" in proc.stderr.read()
        assert not _left(engines, within=5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def _dp2tp2_plan(tmp_path_factory):
    """The TP=2 test plan with two data-parallel engines."""
    path = tmp_path_factory.mktemp("plan") / "dp2tp2.yaml"
    path.write_text(
        PLAN.replace("tensor_parallel_size: 2", "tensor_parallel_size: 2, data_parallel_size: 2")
    )
    return path


def test_dp2_by_tp2_serves_the_greedy_text_and_ids_of_one_rank(llama, tmp_path_factory):
    one = start_server(tmp_path_factory, llama, PLAN.replace("size: 2", "size: 1"), 32)
    try:
        want = _answers(openai_client(one))
    finally:
        one.stop()
    path = _dp2tp2_plan(tmp_path_factory)
    proc, port, _ = _start_cli(path, *_serve_flags(llama), spec_args=[])
    try:
        engines = _workers(proc.pid)
        assert len(engines) == 2 and all(len(_workers(e)) == 1 for e in engines)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert _answers(c) == want
        got = _lockstep(port)
        assert all(got[('graphplan_server_requests_total,code="200"', d)] >= 2 for d in "01")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert err.count("tensor-parallel rank 1: stopped after") == 2
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def _table(**overrides):
    return hf_decode_table(**{"parallel.data_parallel_size": 2, **overrides})


@pytest.mark.parametrize(
    "kw, sets, message",
    [
        (dict(processes=False), {}, "runs one engine process per DP rank: drop --single-process"),
        (dict(speculative=object()), {}, "with --speculative-config is not built"),
        ({}, {"parallel.ubatch.enabled": "true"}, "with parallel.ubatch.enabled is not built"),
    ],
)
def test_what_data_parallel_serving_does_not_run_is_refused_by_name(root, kw, sets, message):
    os.chdir(root)
    args = dict(device="cpu", processes=True, speculative=None) | kw
    with pytest.raises(GraphplanError, match="parallel.data_parallel_size=2 " + re.escape(message)):
        check_serving(_table(**sets), **args)
    check_serving(_table(**{"parallel.data_parallel_size": 1}), **args)  # one engine: anything


def test_a_reload_cannot_start_data_parallel_engines(root):
    os.chdir(root)
    with pytest.raises(TableError, match="a reload cannot start data-parallel engines; restart"):
        check_fits(_table(), StubModel())


def test_engine_devices_follow_each_other_with_their_tensor_parallel_ranks():
    assert [engine_device("cuda:1", d, 2) for d in range(3)] == ["cuda:1", "cuda:3", "cuda:5"]
    assert engine_device("cpu", 1, 2) == "cpu"


def test_the_router_sends_to_the_least_loaded_engine_ties_in_turn():
    r = Router(3)
    assert [r.pick() for _ in range(4)] == [0, 1, 2, 0]
    r.done(1)
    r.done(2)
    assert [r.pick() for _ in range(3)] == [1, 2, 1] and r.load == [2, 2, 1]


def test_the_server_state_is_every_engines():
    assert server_state(["ready", "starting"]) == "starting"
    assert server_state(["ready", "ready"]) == "ready"
    assert server_state(["stopped", "ready"]) == "draining"
    assert server_state(["stopped", "stopped"]) == "stopped"
    assert server_state(["failed", "ready"]) == "failed"


def test_metrics_of_two_engines_label_each_sample_once_per_family():
    a = '# HELP x_total X.\n# TYPE x_total counter\nx_total{code="200"} 3.0\n# HELP y Y.\n# TYPE y gauge\ny 1\n'
    b = '# HELP x_total X.\n# TYPE x_total counter\nx_total{code="200"} 4.0\n# HELP y Y.\n# TYPE y gauge\ny 2\n'
    assert merge_metrics([a, b]) == (
        "# HELP x_total X.\n# TYPE x_total counter\n"
        'x_total{engine="0",code="200"} 3.0\nx_total{engine="1",code="200"} 4.0\n'
        '# HELP y Y.\n# TYPE y gauge\ny{engine="0"} 1\ny{engine="1"} 2\n'
    )


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 50), min_size=1, max_size=3),  # counter increments per code
            st.floats(-1e6, 1e6, allow_nan=False),  # a gauge
            st.lists(st.floats(0, 100, allow_nan=False), max_size=6),  # histogram observations
        ),
        min_size=1,
        max_size=4,
    )
)
def test_merged_metrics_parse_as_every_engines_samples_labelled(engines):
    """prometheus_client's own exposition of a counter with labels, a gauge and a histogram per
    engine, merged, parses with prometheus_client's parser into exactly each engine's samples
    with ``engine="d"`` added."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    texts = []
    for counts, level, observed in engines:
        reg = CollectorRegistry()
        c = Counter("req", "Requests.", ["code"], registry=reg)
        for i, n in enumerate(counts):
            c.labels(code=str(200 + i)).inc(n)
        Gauge("level", "Level.", registry=reg).set(level)
        h = Histogram("lat_seconds", "Latency.", buckets=(0.5, 5, 50), registry=reg)
        for x in observed:
            h.observe(x)
        texts.append(generate_latest(reg).decode())

    def samples(text, engine=None):
        out = set()
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                labels = dict(smp.labels)
                if engine is not None:
                    labels["engine"] = str(engine)
                out.add((fam.name, fam.type, smp.name, tuple(sorted(labels.items())), smp.value))
        return out

    want = set().union(*(samples(t, d) for d, t in enumerate(texts)))
    merged = merge_metrics(texts)
    assert samples(merged) == want
    assert merged.count("# HELP req_total ") == 1 and merged.count("# TYPE lat_seconds ") == 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_dp2_by_tp2_on_four_gpus_serves_the_greedy_text_and_ids_of_one(llama, tmp_path_factory):
    flags = [*_serve_flags(llama), "--dtype", "float32"]
    want = one_rank_answers_on_cuda(llama, tmp_path_factory)
    path = _dp2tp2_plan(tmp_path_factory)
    proc, port, _ = _start_cli(path, *flags, spec_args=[], device="cuda")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert _answers(c) == want
        got = _lockstep(port)
        assert all(got[('graphplan_server_requests_total,code="200"', d)] >= 2 for d in "01")
        engines = _workers(proc.pid)
        everyone = [*engines, *(w for e in engines for w in _workers(e))]
        assert len(everyone) == 4
        os.kill(everyone[-1], signal.SIGKILL)  # a worker rank of engine 1
        assert proc.wait(30) == 1
        assert not _left(everyone, within=5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
