"""Async scheduling (server/core/pipeline.py): launching step N+1 before step N's tokens are read gives
exactly the tokens and finish reasons of the synchronous engine, in every workload (stops mid-
pipeline, seeded sampling, arrivals, cancellations, preemption, n > 1), speculates in the steady
decode state, drops a stopped request's token of the step after, and leaks no seat or KV block."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import load_table_from_text, plan_text

from graphplan.server import Engine, ModelSpec
from graphplan.server.core.batching import PLACEHOLDER, ContinuousBatcher, TokenEvent
from graphplan.server.core.hf_model import HFSpec
from graphplan.server.requests import GREEDY, QueueSink, Request
from graphplan.server.sampling_params import SamplingParams

from hf_models import write_model_dir

SPEC = ModelSpec(layers=2, hidden=64, vocab_size=128, max_model_len=48, seed=0)


def _engine(spec, plan: str, async_scheduling: bool, device: str = "cpu", **kw) -> Engine:
    e = Engine(
        load_table_from_text(plan),
        "plan.yaml",
        spec=spec,
        device=device,
        progress=False,
        async_scheduling=async_scheduling,
        **kw,
    )
    e.start()
    assert e.wait_ready(60), e.error
    return e


@pytest.fixture(scope="module")
def engines():
    pair = {a: _engine(SPEC, plan_text(), a) for a in (False, True)}
    yield pair
    for e in pair.values():
        e.stop(5)


def _wait_idle(e: Engine, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not (e._live or e._waiting or e.pipeline.busy) and e.kv_blocks_used() == 0:
            assert not e.batcher.has_work()
            return
        time.sleep(0.005)
    raise AssertionError(f"engine not idle: {e.kv_blocks_used()} KV blocks used")


def run(e: Engine, waves, cancel_after: dict | None = None) -> dict:
    """``waves``: lists of (prompt, max_tokens, stop, params); wave k+1 is submitted once the
    first request of wave k has 2 tokens. ``cancel_after``: {request index: tokens} cancels it
    after that many tokens. Returns {index: (tokens, finish reason or error status)}."""
    sink = QueueSink()
    reqs: list[Request] = []
    results: dict = {}
    cancel_after = cancel_after or {}

    def submit(wave):
        batch = [
            Request(list(p), m, sink, params, tag=len(reqs) + i, stop=tuple(stop))
            for i, (p, m, stop, params) in enumerate(wave)
        ]
        reqs.extend(batch)
        e.enqueue(batch)

    submit(waves[0])
    starts, next_wave = [0], 1
    toks: dict[int, list[int]] = {}
    while len(results) < sum(map(len, waves)):
        tag, kind, value = sink.get(30)
        if kind == "token":
            toks.setdefault(tag, []).append(value.token)
            if tag in cancel_after and len(toks[tag]) == cancel_after[tag]:
                e.cancel([reqs[tag]])
        elif kind == "done":
            results[tag] = (toks.get(tag, []), value)
        elif kind == "error":
            results[tag] = (toks.get(tag, []), value.status)
        first = starts[-1]
        if next_wave < len(waves) and (len(toks.get(first, [])) >= 2 or first in results):
            starts.append(len(reqs))
            submit(waves[next_wave])
            next_wave += 1
    _wait_idle(e)
    return results


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 120 + 3 for i in range(n)]


def greedy_waves(k: int = 10):
    return [[(prompt(i, 3 + i % 5), 4 + (i * 7) % 17, (), GREEDY) for i in range(k)]]


def test_greedy_requests_of_different_lengths_match_and_speculate(engines):
    before = engines[True].pipeline.speculated
    waves = greedy_waves(10)
    assert run(engines[True], waves) == run(engines[False], waves)
    assert engines[True].pipeline.speculated > before
    assert engines[False].pipeline.speculated == 0


def test_the_steady_decode_state_speculates_every_step_but_the_last(engines):
    """Four requests of 20 tokens: a prefill step (synchronous), 19 decode steps, of which every
    one but the last (each request's 20th token: max_tokens) launches the next before its read."""
    before = engines[True].pipeline.speculated
    waves = [[(prompt(i, 4), 20, (), GREEDY) for i in range(4)]]
    assert run(engines[True], waves) == run(engines[False], waves)
    assert engines[True].pipeline.speculated - before == 18
    # /metrics says how many: graphplan_server_async_steps
    assert (
        engines[True].metrics.value("graphplan_server_async_steps_total")
        == engines[True].pipeline.speculated
    )
    assert engines[False].metrics.value("graphplan_server_async_steps_total") == 0


def test_stop_tokens_hit_at_different_steps_mid_pipeline(engines):
    free = run(engines[False], greedy_waves(8))
    waves = [[]]
    for i in range(8):
        toks = free[i][0]
        stop = (toks[min(1 + i % 4, len(toks) - 1)],)  # a token it generates: stops there
        waves[0].append((prompt(i, 3 + i % 5), 4 + (i * 7) % 17, stop, GREEDY))
    sync = run(engines[False], waves)
    assert run(engines[True], waves) == sync
    assert sum(r == "stop" for _, r in sync.values()) >= 6


def test_seeded_sampling_and_n_choices_match(engines):
    def params(i):
        return SamplingParams(temperature=1.0, seed=7 + i % 3, top_k=20, presence_penalty=0.3)

    # n=3 as the server sends it: three requests of one prompt, seeds seed + index
    waves = [[(prompt(i // 3, 5), 12 + i % 4, (), params(i)) for i in range(9)]]
    assert run(engines[True], waves) == run(engines[False], waves)


def test_arrivals_while_others_decode(engines):
    waves = [
        [(prompt(i, 4), 20, (), GREEDY) for i in range(3)],
        [(prompt(10 + i, 6), 8 + i, (), GREEDY) for i in range(3)],
        [(prompt(20 + i, 2), 5, (), GREEDY) for i in range(2)],
    ]
    assert run(engines[True], waves) == run(engines[False], waves)


def test_a_cancellation_mid_stream(engines):
    waves = greedy_waves(6)
    waves[0][2] = (prompt(2, 4), 20, (), GREEDY)
    got = {a: run(engines[a], waves, cancel_after={2: 3}) for a in (False, True)}
    for a in (False, True):
        assert got[a].pop(2)[1] == 499
    assert got[True] == got[False]


def test_the_batcher_drops_the_token_after_a_stop():
    """Exact token lists: step N speculated, N+1 scheduled on the placeholder, N stops the
    request; N+1's token is dropped, and the other request gets both."""
    b = ContinuousBatcher(max_num_seqs=4, token_budget=8, max_model_len=32, num_cache_rows=4)
    b.add("a", [1, 2], 10, stop_token_ids=[99])
    b.add("b", [3], 10)
    b.commit_tokens(first := b.schedule(), [5, 6])  # prefill; first tokens
    assert first is not None
    n = b.schedule()
    assert n is not None and n.reqs == ((0, 2, (5,)), (1, 1, (6,)))
    assert b.speculate(n)
    n1 = b.schedule()  # scheduled before N's tokens are known
    assert n1 is not None and n1.reqs == ((0, 3, (PLACEHOLDER,)), (1, 2, (PLACEHOLDER,)))
    assert b.resolve(n, [99, 7]) == [
        TokenEvent(request_id="a", token=99, finished=True),
        TokenEvent(request_id="b", token=7, finished=False),
    ]
    assert b.finished["a"] == [5, 99]
    assert b.commit_tokens(n1, [42, 8]) == [TokenEvent(request_id="b", token=8, finished=False)]
    assert b.finished["a"] == [5, 99]
    n2 = b.schedule()
    assert n2 is not None and n2.reqs == ((1, 3, (8,)),)


def test_speculation_leaves_out_a_request_at_its_last_token_and_backs_off_for_one_that_could_join():
    b = ContinuousBatcher(max_num_seqs=2, token_budget=8, max_model_len=32, num_cache_rows=2)
    b.add("a", [1], 4)
    b.commit_tokens(b.schedule(), [5])
    n = b.schedule()
    assert n is not None
    b.add("w", [2, 3], 3)  # arrives mid-step: a seat is free, so the next step would admit it
    assert not b.speculate(n)
    b.commit_tokens(n, [6])
    n = b.schedule()  # admits "w" (a 2-token prompt): not a steady decode
    assert n is not None and n.num_reqs == 2 and not b.speculate(n)
    b.commit_tokens(n, [7, 9])
    n = b.schedule()  # a's token at n is its last (its 4th), whatever it is; w goes on
    assert n is not None and b.speculate(n)
    n2 = b.schedule()
    assert n2 is not None and n2.request_ids == ("w",)  # the next step leaves a out
    assert b.resolve(n, [8, 10]) == [
        TokenEvent(request_id="a", token=8, finished=True),
        TokenEvent(request_id="w", token=10, finished=False),
    ]
    assert b.finished["a"] == [5, 6, 7, 8] and [r.id for r in b._running] == ["w"]
    assert not b.speculate(n2)  # w's token at n2 is its last: no next step of these


def test_a_request_waiting_for_a_seat_does_not_stop_speculation():
    """Every seat taken: the next step is the same decodes whether or not someone waits."""
    b = ContinuousBatcher(max_num_seqs=1, token_budget=8, max_model_len=32, num_cache_rows=1)
    b.add("a", [1], 4)
    b.commit_tokens(b.schedule(), [5])
    b.add("w", [2], 3)  # waits for the seat
    n = b.schedule()
    assert n is not None and n.request_ids == ("a",)
    assert b.speculate(n)  # a's placeholder, then the next step is a's again
    n2 = b.schedule()
    assert n2 is not None and n2.request_ids == ("a",)
    assert b.resolve(n, [6]) == [TokenEvent(request_id="a", token=6, finished=False)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("hf") / "m")


def test_a_small_kv_pool_preempts_and_speculation_backs_off(hf_dir):
    """Four requests in a pool of six 16-token blocks: preemption happens; async == sync."""
    spec = HFSpec(model=str(hf_dir), max_model_len=64, kv_cache_tokens=96, block_size=16)
    plan = plan_text(mode="FULL_DECODE_ONLY", sizes=(1, 2, 4))

    def params(i):
        return SamplingParams(temperature=1.0, seed=i, presence_penalty=0.5)

    waves = [[([10 + i] * 12, 36, (), params(i)) for i in range(4)]]
    got = {}
    for a in (False, True):
        e = _engine(spec, plan, a)
        try:
            got[a] = run(e, waves)
            assert e.metrics.value("graphplan_server_preemptions_total") > 0
            if a:
                assert e.pipeline.speculated > 0
        finally:
            e.stop(5)
    assert got[True] == got[False]


_lock = threading.Lock()


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 9))
    reqs = []
    for _ in range(n):
        seed = draw(st.integers(0, 50))
        stop = draw(st.lists(st.integers(3, 127), max_size=3))
        reqs.append((prompt(seed, draw(st.integers(1, 8))), draw(st.integers(1, 14)), stop, GREEDY))
    cut = draw(st.integers(1, n))
    return [reqs[:cut], reqs[cut:]] if cut < n else [reqs]


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(waves=workloads())
def test_async_equals_sync_on_random_workloads(engines, waves):
    with _lock:
        assert run(engines[True], waves) == run(engines[False], waves)


def test_a_queue_for_the_seats_keeps_speculating_and_matches(engines):
    """Twenty requests for eight seats, all sent at once: while the seats are all taken the
    waiting requests cannot join, so the decodes keep speculating (the old rule stopped at any
    waiting request: only the last eight would); every request's tokens equal the sync engine's."""
    before = engines[True].pipeline.speculated
    waves = [[(prompt(i, 3), 12 + i % 5, (), GREEDY) for i in range(20)]]
    assert run(engines[True], waves) == run(engines[False], waves)
    assert engines[True].pipeline.speculated - before > 20  # 27 here; the old rule: 10


def logprob_runs(engines) -> dict[bool, tuple[dict[int, list], int]]:
    """Five requests, three asking for 3 logprobs, greedy and seeded: per engine (async or not),
    each request's Sampled values and the steps speculated."""
    got = {}
    for a in (False, True):
        e, sink = engines[a], QueueSink()
        before = e.pipeline.speculated
        reqs = [
            Request(
                prompt(i, 4),
                10,
                sink,
                GREEDY if i % 2 else SamplingParams(temperature=1.0, seed=i),
                tag=i,
                logprobs=3 if i < 3 else None,
            )
            for i in range(5)
        ]
        e.enqueue(reqs)
        out: dict[int, list] = {}
        done = 0
        while done < len(reqs):
            tag, kind, value = sink.get(30)
            if kind == "token":
                out.setdefault(tag, []).append(value)
            elif kind in ("done", "error"):
                done += 1
        _wait_idle(e)
        got[a] = (out, e.pipeline.speculated - before)
    return got


def test_requests_asking_for_logprobs_speculate_and_get_the_sync_logprobs(engines):
    """A token's logprobs ride along with it (the step's [rows, 2 + 2k] output, its first column
    the next step's input ids): the same Sampled values, logprobs and top alternatives included,
    as the synchronous engine's."""
    got = logprob_runs(engines)
    assert got[True][0] == got[False][0]
    assert all(s.logprob is not None and len(s.top) == 3 for s in got[True][0][0])
    assert got[True][1] > 0 and got[False][1] == 0


def test_requests_of_different_lengths_keep_speculating_past_each_end(engines):
    """Eight requests of 6..20 tokens: a request at its last token is left out of the next step,
    so the others go on speculating: 18 of the 19 decode steps (the prefill gives each its first
    token), only the step where the last of them ends is synchronous (the old rule stopped at
    every request's last token: 11)."""
    before = engines[True].pipeline.speculated
    waves = [[(prompt(i, 4), 6 + 2 * i, (), GREEDY) for i in range(8)]]
    assert run(engines[True], waves) == run(engines[False], waves)
    assert engines[True].pipeline.speculated - before == 18
