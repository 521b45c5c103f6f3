"""Speculative decoding in the engine (server/core/spec/): the same greedy tokens and finish reasons
as without it, alone, in busy batches with arrivals and stops, and with preemption in a small KV
pool (no block leaked); the same seeded samples and logprobs; uniform steps of q = 1 + k tokens a
request replay the table's q-multiple FULL graphs, exactly the routes ``table.route`` gives for
every step; a plan whose decode_query_len is not 1 + k is refused, at start and at reload."""

from __future__ import annotations

from collections import Counter

import pytest
from test_async_scheduling import _wait_idle, prompt, run
from test_server import load_table_from_text

from graphplan.server import Engine, ModelSpec
from graphplan.server.core.hf_model import HFSpec
from graphplan.server.core.spec.config import SpeculativeConfigError, parse_speculative_config
from graphplan.server.errors import RequestError
from graphplan.server.requests import GREEDY, QueueSink, Request
from graphplan.server.sampling_params import SamplingParams

from hf_models import write_model_dir

SPEC = ModelSpec(layers=2, hidden=64, vocab_size=128, max_model_len=64, seed=0)
K = 3
NGRAM = parse_speculative_config(
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
)


def plan(
    q: int, mode: str = "FULL_AND_PIECEWISE", seqs: int = 8, sizes=(1, 2, 4, 8, 16, 32)
) -> str:
    return (
        f"version: 1\nname: spec{q}\n"
        f"scheduler: {{max_num_seqs: {seqs}, max_num_batched_tokens: 64, decode_query_len: {q}}}\n"
        f"cudagraph: {{mode: {mode}, attention_support: ALWAYS, splitting_ops: [attention], "
        f"capture_sizes: {list(sizes)}}}\n"
    )


def _engine(spec, text: str, speculative) -> Engine:
    e = Engine(
        load_table_from_text(text), "plan.yaml", spec=spec, progress=False, speculative=speculative
    )
    e.start()
    assert e.wait_ready(60), e.error
    return e


@pytest.fixture(scope="module")
def engines():
    pair = {False: _engine(SPEC, plan(1), None), True: _engine(SPEC, plan(1 + K), NGRAM)}
    yield pair
    for e in pair.values():
        e.stop(5)


def repeating(i: int, n: int) -> list[int]:
    """A prompt that repeats a short pattern (n-gram drafts find it)."""
    pat = prompt(i, 2 + i % 3)
    return (pat * n)[:n]


def _accepted(e: Engine) -> float:
    return e.metrics.value("graphplan_spec_decode_num_accepted_tokens_total")


def test_greedy_alone_is_identical_and_drafts_are_accepted(engines):
    before = _accepted(engines[True])
    for p in ([7] * 6, [1, 2, 3, 1, 2, 3, 1, 2]):  # the random model repeats a token after these
        waves = [[(p, 30, (), GREEDY)]]
        assert run(engines[True], waves) == run(engines[False], waves)
    assert _accepted(engines[True]) >= before + 8


def test_greedy_in_busy_batches_with_arrivals_and_stops_is_identical(engines):
    free = run(engines[False], [[(repeating(i, 6 + i), 20, (), GREEDY) for i in range(6)]])
    waves = [
        [
            (repeating(i, 6 + i), 20, (free[i][0][5 + i % 7],) if i % 2 else (), GREEDY)
            for i in range(6)
        ],
        [(prompt(10 + i, 5), 9 + i, (), GREEDY) for i in range(4)],
        [(repeating(20 + i, 3), 25 - i, (), GREEDY) for i in range(3)],
    ]
    got = run(engines[True], waves)
    assert got == run(engines[False], waves)
    assert sum(reason == "stop" for _, reason in got.values()) >= 3
    assert all(len(t) == 20 for i, (t, r) in got.items() if i < 6 and r == "length")


def test_seeded_sampling_and_logprobs_are_the_same_tokens(engines):
    """One-hot (n-gram) acceptance is coupled to the sampler's noise: a seed gives the very tokens
    it gives without speculation, and each token's logprobs come from the row that produced it."""

    def params(i):
        return SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=100 + i, max_tokens=None)

    def collect(e):
        sink = QueueSink()
        reqs = [Request(repeating(i, 8), 16, sink, params(i), tag=i, logprobs=3) for i in range(4)]
        e.enqueue(reqs)
        got: dict = {}
        done = 0
        while done < len(reqs):
            tag, kind, value = sink.get(30)
            if kind == "token":
                got.setdefault(tag, []).append(
                    (
                        value.token,
                        round(value.logprob, 4),
                        tuple((t, round(v, 4)) for t, v in value.top),
                    )
                )
            elif kind in ("done", "error"):
                done += 1
        _wait_idle(e)
        return got

    assert collect(engines[True]) == collect(engines[False])


def replays_and_routes(e, work) -> tuple[Counter, Counter, list]:
    """Run ``work()`` on engine ``e`` recording each runner step's (tokens, requests, longest
    query): the replays per graph it made, the replays ``table.route`` gives for those steps, and
    the uniform q = 1 + k steps with their routes."""
    steps: list[tuple[int, int, int]] = []
    runner_step = e.runner.step

    def recording(inputs, num_reqs=None, max_query_len=None, *args, **kw):
        steps.append((int(inputs["input_ids"].shape[0]), num_reqs, max_query_len))
        return runner_step(inputs, num_reqs, max_query_len, *args, **kw)

    before = {g["id"]: g["replays"] for g in e.runner.stats()["graphs"]}
    e.runner.step = recording
    try:
        work()
    finally:
        del e.runner.step
    after = {g["id"]: g["replays"] for g in e.runner.stats()["graphs"]}
    got = Counter({g: after[g] - before.get(g, 0) for g in after if after[g] != before.get(g, 0)})
    routes = [e.table.route(n, r, q) for n, r, q in steps]
    want = Counter(rt.graph_id for rt in routes if rt.graph_id >= 0)
    uniform = [(s, rt) for s, rt in zip(steps, routes) if s[2] == 1 + K and s[0] == (1 + K) * s[1]]
    return got, want, uniform


def test_uniform_steps_replay_the_q_multiple_full_graphs_the_table_routes(engines):
    e = engines[True]
    got, want, uniform = replays_and_routes(
        e, lambda: run(e, [[(repeating(i, 5), 24, (), GREEDY) for i in range(3)]])
    )
    assert got == want
    assert len(uniform) >= 5
    assert all(rt.mode.name == "FULL" and rt.padded_tokens % (1 + K) == 0 for _, rt in uniform)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("hf") / "m")


def test_preemption_in_a_small_kv_pool_is_identical_and_leaks_no_block(hf_dir):
    spec = HFSpec(model=str(hf_dir), max_model_len=64, kv_cache_tokens=96, block_size=16)
    waves = [[(repeating(i, 12), 36, (), GREEDY) for i in range(4)]]
    got = {}
    for speculative in (None, NGRAM):
        e = _engine(
            spec,
            plan(
                1 + K if speculative else 1, mode="FULL_DECODE_ONLY", seqs=4, sizes=(1, 2, 4, 8, 16)
            ),
            speculative,
        )
        try:
            got[speculative is not None] = run(e, waves)
            assert e.metrics.value("graphplan_server_preemptions_total") > 0
            assert e.kv_blocks_used() == 0 and e.kv_blocks_free() == 6
            if speculative:
                assert _accepted(e) > 0
        finally:
            e.stop(5)
    assert got[True] == got[False]


def test_a_plan_without_q_equal_1_plus_k_is_refused(engines):
    with pytest.raises(
        SpeculativeConfigError, match="decode_query_len 1: set scheduler.decode_query_len: 4"
    ):
        Engine(load_table_from_text(plan(1)), "plan.yaml", spec=SPEC, speculative=NGRAM)
    e = engines[True]
    # a reload to a plan of another q keeps the old one (422)
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.yaml")
        with open(path, "w") as f:
            f.write(plan(2))
        with pytest.raises(RequestError) as err:
            e.reload(path)
    assert err.value.status == 422 and "decode_query_len 2" in err.value.message
    assert e.table.q == 1 + K


def _draft(path, k: int = K):
    import json

    return parse_speculative_config(
        json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": k})
    )


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("hf") / "other", seed=5)


def test_a_draft_model_equal_to_the_target_is_always_accepted(hf_dir, other_dir):
    """Greedy output identical with a draft model: the target itself (acceptance 1: every draft
    kept) and another model of the same vocabulary (some rejected), in a busy batch, and with
    preemption in a small KV pool."""
    spec = HFSpec(model=str(hf_dir), max_model_len=64, kv_cache_tokens=96, block_size=16)
    waves = [
        [(prompt(i, 5 + i), 30 - i, (), GREEDY) for i in range(4)],
        [(repeating(9, 7), 12, (), GREEDY)],
    ]
    got = {}
    for name, speculative in (
        ("off", None),
        ("self", _draft(hf_dir)),
        ("other", _draft(other_dir)),
    ):
        e = _engine(
            spec, plan(1 + K if speculative else 1, seqs=4, sizes=(1, 2, 4, 8, 16)), speculative
        )
        try:
            got[name] = run(e, waves)
            assert e.metrics.value("graphplan_server_preemptions_total") > 0
            assert e.kv_blocks_used() == 0
            drafted = e.metrics.value("graphplan_spec_decode_num_draft_tokens_total")
            if name == "self":
                assert drafted > 30 and _accepted(e) == drafted
            if name == "other":
                assert drafted > 30 and _accepted(e) < drafted  # a random model: mostly rejected
        finally:
            e.stop(5)
    assert got["self"] == got["off"] and got["other"] == got["off"]


def test_a_draft_with_another_vocabulary_is_refused(hf_dir, tmp_path):
    other = write_model_dir(tmp_path / "v", vocab=200)
    e = Engine(
        load_table_from_text(plan(1 + K)),
        "plan.yaml",
        progress=False,
        speculative=_draft(other),
        spec=HFSpec(model=str(hf_dir), max_model_len=64),
    )
    e.start()
    assert not e.wait_ready(60)
    assert isinstance(e.error, SpeculativeConfigError) and "vocab_size 200" in str(e.error)
