"""server/core/step_sampler.py on the CPU stand-in (runtime/graphs.py records each graph as a tape of
aten calls on the static buffers, as a CUDA graph holds their addresses): replayed sampler graphs
give exactly the eager sampler's tokens and logprobs for any mix of greedy, sampled and penalised
requests, padded or not, and a padding row never touches a real slot."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphplan.runtime.graphs import HostSyncInCapture
from graphplan.server import ModelSpec, Server
from graphplan.server.core import sampling
from graphplan.server.core.batching import StepBatch
from graphplan.server.core.sampling import PROMPT_BIT, Sampler
from graphplan.server.core.step_sampler import MAX_LOGPROBS, StepSampler, Work, graph_sizes
from graphplan.server.requests import QueueSink, Request
from graphplan.server.sampling_params import SamplingParams

VOCAB = 48
SLOTS = 8
PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.3, seed=2),
    SamplingParams(
        temperature=1.3, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5, seed=3
    ),
    SamplingParams(temperature=0, frequency_penalty=1.0),  # greedy but penalised: not the argmax
    SamplingParams(temperature=0.6, top_k=4, top_p=0.7, min_p=0.01, seed=4),
    SamplingParams(temperature=0.9, seed=5),  # no truncation: a step of these skips the sort
    SamplingParams(temperature=0.7, presence_penalty=0.4, seed=6),  # penalised, no truncation
]


def request(kind: int, logprobs: int | None = None) -> Request:
    return Request([kind, kind + 1, 2], 100, QueueSink(), PARAMS[kind], logprobs=logprobs)


def step_batch(placed: list[tuple[Request, int]]) -> StepBatch:
    """A step where each request has two tokens (a prompt chunk of one request ahead of them
    samples nothing): its logits row is its second token's."""
    chunk = request(0)
    reqs = [(SLOTS - 1, 0, (1, 2, 3))] + [(slot, 5, (1, 2)) for _, slot in placed]
    return StepBatch(
        reqs=tuple(reqs),
        request_ids=(chunk, *(r for r, _ in placed)),
        sample_rows=(-1, *(4 + 2 * i for i in range(len(placed)))),
        num_tokens=3 + 2 * len(placed),
        max_query_len=3,
    )


def samplers() -> tuple[StepSampler, StepSampler]:
    """A graphed sampler whose Python sampler raises once captured (a step must replay), and an
    eager one."""
    graphed = StepSampler(SLOTS, VOCAB, "cpu", graphs=True)

    def no_eager_step(*args, **kwargs):
        raise AssertionError("a captured sampler ran Sampler.sample eagerly")

    graphed.sampler.sample = no_eager_step  # type: ignore[method-assign]
    return graphed, StepSampler(SLOTS, VOCAB, "cpu", graphs=False)


def drive(pair, steps: list[list[tuple[int, int]]], logprobs: dict[int, int], seed: int = 0):
    """Run both samplers over ``steps`` (each a list of (request key, slot); a key's request, of
    kind key mod len(PARAMS) with ``logprobs.get(key)``, is made on first use) and assert that
    every step's results are equal."""
    gen = torch.Generator().manual_seed(seed)
    made: list[dict[int, Request]] = [{}, {}]
    for step in steps:
        logits = torch.randn(3 + 2 * len(step), VOCAB, generator=gen) * 3
        got = []
        for s, reqs in zip(pair, made):
            for key, _ in step:
                if key not in reqs:
                    reqs[key] = request(key % len(PARAMS), logprobs.get(key))
            got.append(s.sample(step_batch([(reqs[key], slot) for key, slot in step]), logits))
        assert got[0] == got[1], step
        for x, (key, _) in zip(got[0], step):
            k = logprobs.get(key)
            assert (x.logprob is None) == (k is None) and len(x.top) == (k or 0)


def test_graph_sizes_are_powers_of_two_below_the_slots_and_the_slots_largest_first():
    assert graph_sizes(8) == (8, 4, 2, 1)
    assert graph_sizes(6) == (6, 4, 2, 1)
    assert graph_sizes(1) == (1,)
    assert StepSampler(5, VOCAB, "cpu").sizes == (5, 4, 2, 1)


def test_replays_give_the_eager_tokens_and_logprobs_at_every_batch_size():
    pair = samplers()
    assert pair[0].backend is not None and pair[0].backend.name == "cpu-stand-in"
    steps = []
    for n in [1, 2, 3, 4, 5, 6, 7, 8, 3, 1, 8, 2]:  # every size of the ladder and between
        steps += [[(i, i) for i in range(n)]] * 2
    drive(pair, steps, logprobs={2: MAX_LOGPROBS, 4: 3})  # steps with 3+ rows ask for logprobs
    for slot in range(SLOTS):  # the same counters and histories: padding changed no real slot
        assert pair[0].sampler.slot_state(slot) == pair[1].sampler.slot_state(slot)
    assert pair[0].sampler.slot_state(SLOTS)[0] > 0  # the pad slot was sampled (and counted)


def test_a_padded_row_never_changes_a_real_slots_state():
    graphed, _ = samplers()
    pad_steps = graphed.sampler.slot_state(SLOTS)[0]  # the capture's own runs counted there
    reqs = [request(k) for k in (1, 2, 3)]  # 3 rows pad to 4
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        graphed.sample(
            step_batch([(r, 2 * i) for i, r in enumerate(reqs)]),
            torch.randn(9, VOCAB, generator=gen),
        )
    for slot in (0, 2, 4):
        steps, history = graphed.sampler.slot_state(slot)
        assert steps == 5 and sum(h & (PROMPT_BIT - 1) for h in history) == 5
    assert all(graphed.sampler.slot_state(s) == (0, [0] * VOCAB) for s in (1, 3, 5, 6, 7))
    assert graphed.sampler.slot_state(SLOTS)[0] == pad_steps + 5  # one padding row per step


def test_a_seeded_request_gets_the_same_tokens_alone_and_in_a_padded_batch():
    table = torch.randn(VOCAB + 1, VOCAB, generator=torch.Generator().manual_seed(7)) * 2

    def tokens(sampler, others: int, slot: int) -> list[int]:
        x = request(2)  # top-k, repetition penalty, seeded
        placed = [(request(1 + k % 5), s) for k, s in zip(range(others), [0, 1, 3, 4, 6, 7])]
        placed.insert(others // 2, (x, slot))
        out = []
        for _ in range(10):
            logits = table[out[-1] if out else VOCAB].expand(3 + 2 * len(placed), -1)
            out.append(sampler.sample(step_batch(placed), logits)[others // 2].token)
        return out

    alone = tokens(samplers()[0], 0, 2)  # 1 row
    assert tokens(samplers()[0], 4, 5) == alone  # 5 rows padded to 8
    assert tokens(StepSampler(SLOTS, VOCAB, "cpu", graphs=False), 2, 2) == alone
    assert len(set(alone)) > 2  # really sampled


def test_an_all_greedy_step_takes_the_argmax_and_binds_no_slot():
    graphed, _ = samplers()
    logits = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(2))
    out = graphed.sample(step_batch([(request(0), 3), (request(0), 1), (request(0), 0)]), logits)
    assert [s.token for s in out] == logits[[4, 6, 8]].argmax(dim=-1).tolist()
    assert all(graphed.sampler.slot_state(s)[0] == 0 for s in range(SLOTS))


def test_a_step_does_the_work_its_rows_ask_for_and_no_more(monkeypatch):
    """The step's ``Work``: a sort only when a row truncates, the history only when a row is
    penalised, logprobs only when a row asks; the graphs replay each variant like eager."""
    reqs = [request(kind) for kind in range(len(PARAMS))]
    works = [Work.of([r]) for r in reqs]
    assert [(w.truncate, w.penalise) for w in works] == [
        (False, False),  # greedy (the argmax path never reaches the sampler)
        (True, False),
        (True, True),
        (True, True),
        (False, True),
        (True, False),
        (False, False),
        (False, True),
    ]
    assert Work.of([reqs[6], reqs[7], request(1, logprobs=2)]) == Work(True, True, True)
    assert len(set(Work.every())) == 8 and Work.ALL in Work.every()

    _, eager = samplers()
    calls = []
    for owner, name in ((Sampler, "_threshold"), (sampling, "_penalised")):  # sort; history
        real = getattr(owner, name)
        monkeypatch.setattr(
            owner, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k)
        )
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(3))
    for kinds, want in [((6, 6), []), ((6, 7), ["_penalised"]), ((6, 1), ["_threshold"])]:
        calls.clear()
        eager.sample(step_batch([(request(k), i) for i, k in enumerate(kinds)]), logits[:7])
        assert calls == want, kinds
    monkeypatch.undo()
    drive(samplers(), [[(6, 0), (14, 6)], [(7, 1), (6, 0)], [(6, 0), (1, 2)]], {})


def test_after_release_steps_run_eagerly_with_the_same_results():
    graphed, eager = samplers()
    steps = [[(0, 0), (1, 1), (3, 5)]] * 3
    drive((graphed, eager), steps, {1: 2})
    graphed.release_graphs()
    assert graphed.backend is None
    del graphed.sampler.sample  # the Python step runs again
    drive((graphed, eager), steps, {1: 2}, seed=1)


def test_a_failed_capture_keeps_nothing_and_says_why(monkeypatch):
    made = []
    real = StepSampler._capture

    def capture(self):
        made.append(self)
        monkeypatch.setattr(self.sampler, "update", lambda *a: torch.zeros(1).item())
        real(self)

    monkeypatch.setattr(StepSampler, "_capture", capture)
    with pytest.raises(HostSyncInCapture, match=r"_local_scalar_dense"):
        StepSampler(SLOTS, VOCAB, "cpu")  # a host read inside the step: refused at capture
    assert made[0].backend is None  # the pool was returned


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(0, 11), min_size=1, max_size=SLOTS, unique_by=lambda k: k % SLOTS),
        min_size=2,
        max_size=8,
    ),
    st.lists(st.sampled_from([None, None, 0, 3, MAX_LOGPROBS]), min_size=12, max_size=12),
)
def test_any_batch_composition_replays_like_eager(steps, logprobs):
    """Requests 0..11 (kinds: PARAMS), any subset of them per step in any order, request k in
    slot k mod 8 (k and k + 8 take turns: the slot is bound again), any of them asking for
    logprobs: graph == eager."""
    placed = [[(key, key % SLOTS) for key in step] for step in steps]
    drive(samplers(), placed, {k: lp for k, lp in enumerate(logprobs) if lp is not None})


def test_the_engine_captures_the_sampler_graphs_and_releases_them_at_stop(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "version: 1\nname: t\nscheduler: {max_num_seqs: 4, max_num_batched_tokens: 32}\n"
        "cudagraph: {mode: FULL_DECODE_ONLY, capture_sizes: [1, 2, 4]}\n"
    )
    spec = ModelSpec(layers=1, hidden=32, vocab_size=64, max_model_len=32, seed=0)
    s = Server(plan, spec=spec, progress=False).start()
    try:
        assert s.wait_ready(30)
        sampler = s.engine.sampler
        assert sampler is not None and sampler.backend is not None
        assert sampler.sizes == (4, 2, 1)
    finally:
        s.stop()
    assert sampler.backend is None
