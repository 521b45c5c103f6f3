"""server/core/sampling.py and server/sampling_params.py: the batched sampler's rules on the CPU, with
exact expectations (which tokens can be sampled, the formulas of the penalties, reproducible seeds)
and a fixed-seed chi-square check of its distribution; no host read inside a step."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreted import run_interpreted

from graphplan.runtime.graphs import CpuGraphStandIn
from graphplan.server.core.sampling import Sampler, mix32, seed_key
from graphplan.server.frontend.openai_protocol import APIError
from graphplan.server.sampling_params import SamplingParams

PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
LOGITS = torch.tensor(PROBS).log()


def sample_once(sampler, params, logits, rows=256):
    """One token from each of ``rows`` slots, slot i seeded with i."""
    for i in range(rows):
        sampler.set_row(i, SamplingParams(seed=i, **params))
    slots = sampler.load_slots(list(range(rows)))
    return sampler.sample(logits.expand(rows, -1), slots).token_ids


# SamplingParams


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("temperature", 2.5, r"'temperature' must be at least 0 and at most 2, not 2.5"),
        ("temperature", -0.1, r"'temperature' must be at least 0"),
        ("temperature", float("nan"), r"'temperature' must be at least 0"),
        ("temperature", "1", r"'temperature' must be a number, not '1'"),
        ("temperature", True, r"'temperature' must be a number, not True"),
        ("top_p", 0, r"'top_p' must be above 0 and at most 1, not 0"),
        ("top_p", 1.01, r"'top_p' must be above 0"),
        ("top_k", -2, r"'top_k' must be at least -1, not -2"),
        ("top_k", 2.0, r"'top_k' must be an integer, not 2.0"),
        ("min_p", 1.5, r"'min_p' must be at least 0 and at most 1"),
        ("presence_penalty", -2.01, r"'presence_penalty' must be at least -2 and at most 2"),
        ("frequency_penalty", 3, r"'frequency_penalty' must be at least -2 and at most 2"),
        ("repetition_penalty", 0, r"'repetition_penalty' must be above 0, not 0"),
        ("repetition_penalty", math.inf, r"'repetition_penalty' must be above 0, not inf"),
        ("n", 0, r"'n' must be at least 1 and at most 128, not 0"),
        ("logprobs", 21, r"'logprobs' must be at least 0 and at most 20, not 21"),
        ("seed", 2**64, r"'seed' must be at least -9223372036854775808 and at most"),
        ("seed", 1.5, r"'seed' must be an integer"),
        ("stop", [""], r"'stop' strings must have 1..256 characters; string 0 has 0"),
        ("stop", ["x"] * 17, r"'stop' has 17 strings; the limit is 16"),
        ("stop", [1], r"'stop' must be a string or a list of strings, not \[1\]"),
        ("stop_token_ids", [-1], r"'stop_token_ids' must be a list of token ids \(>= 0\)"),
        ("ignore_eos", "false", r"'ignore_eos' must be true or false, not 'false'"),
        ("max_tokens", 0, r"'max_tokens' must be at least 1, not 0"),
    ],
)
def test_a_value_out_of_range_is_a_400_naming_the_field(field, value, match):
    with pytest.raises(APIError, match=match) as e:
        SamplingParams(**{field: value})
    assert (e.value.status, e.value.param) == (400, field)


def test_stop_takes_a_string_or_a_list_and_numbers_become_floats():
    p = SamplingParams(stop="\n", top_p=1, temperature=0)
    assert p.stop == ("\n",) and SamplingParams(stop=["a", "b", "a"]).stop == ("a", "b")
    assert isinstance(p.top_p, float) and p.greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams().greedy and not SamplingParams().penalised
    assert SamplingParams(repetition_penalty=1.1).penalised


def test_each_of_n_choices_is_a_row_of_its_own_with_seed_plus_its_index():
    p = SamplingParams(n=3, seed=2**64 - 2)
    assert [c.seed for c in map(p.for_choice, range(3))] == [2**64 - 2, 2**64 - 1, 0]
    assert p.for_choice(1).n == 1 and SamplingParams(n=2).for_choice(1).seed is None
    with pytest.raises(ValueError, match=r"choice 3 is outside 0..2"):
        p.for_choice(3)


def test_max_new_tokens_is_checked_against_the_context_and_stop_ids_against_the_vocabulary():
    assert SamplingParams(max_tokens=10).max_new_tokens(5, vocab_size=50, max_model_len=15) == 10
    assert SamplingParams(max_tokens=None).max_new_tokens(5, vocab_size=50, max_model_len=15) == 10
    with pytest.raises(APIError, match=r"prompt has 6 tokens and max_tokens is 10") as e:
        SamplingParams(max_tokens=10).max_new_tokens(6, vocab_size=50, max_model_len=15)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(APIError, match=r"'stop_token_ids' 50 is outside the vocabulary 0..49"):
        SamplingParams(stop_token_ids=[50]).max_new_tokens(1, vocab_size=50, max_model_len=15)


# the sampler


def test_the_hash_is_the_same_on_python_ints_and_on_tensors():
    xs = [0, 1, 2**31, 2**32 - 1, 12345]
    assert mix32(torch.tensor(xs)).tolist() == [mix32(x) for x in xs]
    assert all(0 <= mix32(x) < 2**32 for x in xs) and len({mix32(x) for x in range(1000)}) == 1000
    assert seed_key(-1) == seed_key(2**64 - 1)


def test_greedy_rows_take_the_argmax_whatever_their_other_parameters():
    sampler = Sampler(8, 50)
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    for i in range(8):
        sampler.set_row(i, SamplingParams(temperature=0 if i % 2 else 1e-6, top_k=3, seed=i))
    out = sampler.sample(logits, sampler.load_slots(list(range(8))))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize(
    "params, support",
    [
        (dict(), {0, 1, 2, 3, 4, 5}),
        (dict(top_k=-1), {0, 1, 2, 3, 4, 5}),
        (dict(top_k=2), {0, 1}),
        (dict(top_k=1, temperature=2.0), {0}),
        (dict(top_p=0.5), {0, 1}),  # 0.4 + 0.25 reach it; 0.4 alone does not
        (dict(top_p=0.7), {0, 1, 2}),
        (dict(top_p=0.3), {0}),
        (dict(top_p=0.5, temperature=2.0), {0, 1, 2}),  # top-p after the temperature
        (dict(min_p=0.3), {0, 1, 2}),  # p >= 0.3 * 0.4
        (dict(min_p=0.5), {0, 1}),
        (dict(min_p=0.3, temperature=0.5), {0, 1}),  # (p / 0.4) ** 2 >= 0.3
        (dict(top_k=3, top_p=0.75), {0, 1}),  # top-p over the renormalised top 3
        (dict(top_p=0.75), {0, 1, 2}),
        (dict(temperature=0, top_p=0.3), {0}),
    ],
)
def test_truncation_leaves_exactly_the_tokens_it_should(params, support):
    sampler = Sampler(256, 6)
    seen = set()
    for _ in range(2):  # two steps of 256 seeds
        seen |= set(sample_once(sampler, params, LOGITS).tolist())
    assert seen == support


@given(
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    penalty=st.sampled_from([0.0, 0.7]),
    scale=st.sampled_from([1.0, 30.0, 300.0]),  # 300: most tokens have probability 0 in float32
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_leaving_out_the_sort_or_the_penalties_changes_no_token(temperature, penalty, scale, seed):
    """``truncate=False`` (no row truncates) and ``penalise=False`` (no row is penalised) give
    the tokens and raw logprobs of the full sampler, over logits where most tokens have
    probability 0 (which the full sampler's threshold drops and Gumbel-max can never pick)."""
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 6, 97
    sampler = Sampler(rows, vocab, max_logprobs=3)
    for i in range(rows):
        sampler.set_row(
            i, SamplingParams(temperature=temperature, seed=seed + i, presence_penalty=penalty)
        )
    slots = sampler.load_slots(list(range(rows)))
    for _ in range(3):
        logits = torch.randn(rows, vocab, generator=gen) * scale
        full = sampler.sample(logits, slots)
        lean = sampler.sample(logits, slots, truncate=False, penalise=penalty != 0)
        assert torch.equal(lean.token_ids, full.token_ids)
        assert lean.logprobs is not None and full.logprobs is not None
        assert torch.equal(lean.logprobs, full.logprobs)
        sampler.update(slots, full.token_ids)


def test_a_step_without_truncation_never_sorts_and_one_with_it_does(monkeypatch):
    sampler = Sampler(2, 50)
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    sampler.set_row(0, SamplingParams(temperature=0.8, seed=1))
    logits = torch.randn(1, 50)
    sampler.sample(logits, sampler.load_slots([0]), truncate=False)
    assert sorts == []
    sampler.sample(logits, sampler.load_slots([0]))
    assert sorts == [1]


def test_which_params_truncate_and_which_penalise():
    assert [
        SamplingParams(**kw).truncates
        for kw in (
            dict(),
            dict(top_k=-1),
            dict(top_k=0, top_p=1, min_p=0),
            dict(top_k=5),
            dict(top_p=0.9),
            dict(min_p=0.1),
            dict(temperature=0, top_k=5),  # greedy: nothing to truncate
        )
    ] == [False, False, False, True, True, True, False]
    assert [
        SamplingParams(**kw).penalised
        for kw in (dict(), dict(presence_penalty=0.1), dict(repetition_penalty=1.0))
    ] == [False, True, False]


def test_ties_with_the_kth_logit_are_kept_by_top_k():
    logits = torch.tensor([3.0, 1.0, 1.0, 0.0])
    assert set(sample_once(Sampler(256, 4), dict(top_k=2), logits).tolist()) == {0, 1, 2}


@pytest.mark.parametrize(
    "params, expected, critical",
    [
        (dict(temperature=0.7), torch.softmax(LOGITS / 0.7, 0), 20.52),  # chi2(5) at p=0.001
        (dict(top_k=3), torch.tensor([0.5, 0.3125, 0.1875, 0, 0, 0]), 13.82),  # chi2(2)
    ],
)
def test_samples_follow_softmax_of_the_kept_logits_over_the_temperature(params, expected, critical):
    rows, steps = 1000, 20
    sampler = Sampler(rows, 6, penalties=False)
    for i in range(rows):
        sampler.set_row(i, SamplingParams(seed=1000 + i, **params))
    slots = sampler.load_slots(list(range(rows)))
    counts = torch.zeros(6)
    for _ in range(steps):
        tokens = sampler.sample(LOGITS.expand(rows, -1), slots).token_ids
        sampler.update(slots, tokens)
        counts += torch.bincount(tokens, minlength=6)
    want = expected * rows * steps
    kept = want > 0
    assert counts[~kept].sum() == 0
    chi2 = ((counts[kept] - want[kept]) ** 2 / want[kept]).sum().item()
    assert chi2 < critical, (counts.tolist(), want.tolist(), chi2)


def run(sampler, slots_of, params_of, steps=12, vocab=40):
    """Drive ``sampler`` for ``steps`` steps: request r sits in slot slots_of[r] and sees logits
    that depend on its own last token only; returns each request's tokens."""
    table = torch.randn(vocab + 1, vocab, generator=torch.Generator().manual_seed(7)) * 2
    for r, slot in slots_of.items():
        sampler.set_row(slot, params_of[r], prompt_ids=[1, 2, 3])
    order = list(slots_of)
    out = {r: [] for r in order}
    for _ in range(steps):
        last = [out[r][-1] if out[r] else vocab for r in order]
        slots = sampler.load_slots([slots_of[r] for r in order], size=len(order) + 2)
        logits = torch.cat([table[last], table[:2]])  # two padding rows
        tokens = sampler.sample(logits, slots).token_ids
        sampler.update(slots, tokens)
        for r, t in zip(order, tokens.tolist()):
            out[r].append(t)
        order = order[1:] + order[:1]  # batch order changes every step
    return out


def test_a_seeded_request_gets_the_same_tokens_alone_or_batched_in_any_row():
    x = SamplingParams(temperature=0.9, top_p=0.95, seed=42, repetition_penalty=1.3)
    others = {
        "g": SamplingParams(temperature=0),
        "u": SamplingParams(temperature=1.5, top_k=5),  # unseeded
        "s": SamplingParams(temperature=0.8, seed=7, presence_penalty=1.0),
    }
    alone = run(Sampler(8, 40), {"x": 0}, {"x": x})["x"]
    batched = run(Sampler(8, 40), {"g": 1, "u": 2, "x": 5, "s": 7}, {"x": x, **others})
    assert batched["x"] == alone and len(set(alone)) > 3  # really sampled
    assert batched["s"] != alone


def test_different_seeds_give_different_tokens_and_unseeded_rows_differ_too():
    flat = {r: SamplingParams(seed=r) for r in range(3)}
    tokens = run(Sampler(8, 40), {r: r for r in range(3)}, flat)
    assert tokens[0] != tokens[1] != tokens[2]
    unseeded = {r: SamplingParams() for r in range(2)}
    tokens = run(Sampler(8, 40), {0: 0, 1: 1}, unseeded)
    assert tokens[0] != tokens[1]


def test_penalties_change_the_logits_exactly_as_the_formulas_say():
    vocab = 8
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5, -0.5, 0.0, 3.0, 1.0]])
    params = SamplingParams(
        temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25
    )
    sampler = Sampler(2, vocab, max_logprobs=vocab, logprobs_mode="processed")
    sampler.set_row(1, params, prompt_ids=[1, 2, 2])
    for token in (6, 3, 6, 2):  # four steps' tokens
        sampler.update([1], [token])
    want = logits[0].clone()
    for v in (1, 2, 3, 6):  # in the prompt or generated: the repetition penalty, once
        want[v] = want[v] / 1.5 if want[v] > 0 else want[v] * 1.5
    count = torch.tensor([0, 0, 1, 1, 0, 0, 2, 0], dtype=torch.float32)
    want -= 0.5 * count + 0.25 * (count > 0)
    out = sampler.sample(logits, torch.tensor([1]))
    got = torch.empty(vocab).scatter_(0, out.top_ids[0], out.top_logprobs[0])
    torch.testing.assert_close(got, torch.log_softmax(want, 0), rtol=0, atol=1e-6)
    sampler.set_row(0, SamplingParams(temperature=0, frequency_penalty=2.0))
    sampler.update([0], [6])
    assert sampler.sample(logits, torch.tensor([0])).token_ids.tolist() == [0]  # 3 - 2 < 2
    sampler.set_row(0, SamplingParams(temperature=0))  # a new request starts clean
    assert sampler.sample(logits, torch.tensor([0])).token_ids.tolist() == [6]


def test_raw_logprobs_are_the_models_own_and_top_logprobs_come_largest_first():
    sampler = Sampler(2, 6, max_logprobs=3)
    sampler.set_row(0, SamplingParams(temperature=0.5, top_k=2, presence_penalty=2.0, seed=1))
    sampler.update([0], [0])
    out = sampler.sample(LOGITS[None], torch.tensor([0]))
    lp = torch.log_softmax(LOGITS, 0)
    assert out.token_ids.tolist()[0] in (0, 1)
    torch.testing.assert_close(out.logprobs, lp[out.token_ids])
    torch.testing.assert_close(out.top_logprobs[0], lp[:3])
    assert out.top_ids[0].tolist() == [0, 1, 2]


def test_a_step_reads_nothing_back_and_a_replay_with_new_params_matches_eager():
    vocab = 40
    gen = torch.Generator().manual_seed(3)

    def make():
        sampler = Sampler(6, vocab, max_logprobs=5, rng=random.Random(0))
        sampler.set_row(0, SamplingParams(temperature=0))
        sampler.set_row(3, SamplingParams(temperature=1.2, top_p=0.8, seed=5), prompt_ids=[4])
        return sampler

    graphed, eager = make(), make()
    logits = torch.randn(4, vocab, generator=gen)
    slots = graphed.load_slots([3, 0], size=4)
    segment = CpuGraphStandIn("cpu").open_segment()  # raises HostSyncInCapture on a host read
    out = graphed.sample(logits, slots)
    graph = segment.close()
    graphed.update(slots, out.token_ids)
    eager.update(torch.tensor([3, 0, 6, 6]), out.token_ids)
    for step, params in enumerate(
        [
            SamplingParams(temperature=0.7, top_k=4, seed=9, frequency_penalty=1.0),
            SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, seed=2),
            SamplingParams(temperature=0),
        ]
    ):
        for s in (graphed, eager):
            s.set_row(1, params, prompt_ids=[step])
        logits.copy_(torch.randn(4, vocab, generator=gen))
        graph_slots = graphed.load_slots([1, 3, 0], size=4)
        graph.replay()
        want = eager.sample(logits, eager.load_slots([1, 3, 0], size=4))
        for field in ("token_ids", "logprobs", "top_logprobs", "top_ids"):
            assert torch.equal(getattr(out, field), getattr(want, field)), (step, field)
        graphed.update(graph_slots, out.token_ids)
        eager.update(graph_slots, want.token_ids)


def test_bad_slots_and_disabled_penalties_are_refused():
    sampler = Sampler(2, 8, penalties=False)
    with pytest.raises(ValueError, match=r"slot 2 is outside 0..1"):
        sampler.set_row(2, SamplingParams())
    with pytest.raises(ValueError, match=r"built with penalties=False"):
        sampler.set_row(0, SamplingParams(presence_penalty=0.5))
    with pytest.raises(ValueError, match=r"cannot pad 3 slots to 3 rows: .* max_num_seqs \(2\)"):
        sampler.load_slots([0, 1, 0])
    with pytest.raises(ValueError, match=r"logits must be \[rows, 8\], not \[1, 9\]"):
        sampler.sample(torch.zeros(1, 9), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"prompt token ids must be in 0..7"):
        Sampler(2, 8).set_row(0, SamplingParams(repetition_penalty=2.0), prompt_ids=[8])


def test_a_cleared_row_is_greedy_again():
    sampler = Sampler(2, 6)
    sampler.set_row(0, SamplingParams(temperature=2.0, seed=0))
    sampler.clear_row(0)
    flat = torch.zeros(1, 6)
    flat[0, 4] = 0.1
    assert sampler.sample(flat, torch.tensor([0])).token_ids.tolist() == [4]


def test_the_benchmark_runs_at_smoke_size(tmp_path, monkeypatch):
    import sampling_bench

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    out = tmp_path / "sampling.md"
    assert sampling_bench.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 4 |")]
    assert [row.count("|") for row in rows] == [13, 9]  # the sampler's parts; the engine's step
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[5:7] == ["n/a", "n/a"]  # the fused kernel: no CUDA and no interpreter here
    assert all(float(c) > 0 for c in cells[1:5] + cells[7:10])


def test_the_fused_kernel_gives_the_torch_forms_tokens_under_tritons_interpreter():
    run_interpreted("sampling_interpreted.py")


def test_a_fused_sampler_needs_a_device_its_kernel_runs_on(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        ValueError, match=r"fused=True needs a CUDA device \(or TRITON_INTERPRET=1\)"
    ):
        Sampler(2, 50, fused=True)
