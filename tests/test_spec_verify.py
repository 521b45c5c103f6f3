"""Speculative decoding's acceptance (server/core/spec/verify.py), its n-gram proposer and its config:
greedy acceptance keeps exactly the matching prefix; the rejection sampler's 3-token output over
2,000 seeded samples of a tiny Llama matches both the exact distribution and the non-speculative
sampler's (chi-square, p > 0.01), for a draft distribution q and for one-hot (n-gram) drafts, and a
seed reproduces it exactly."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphplan.models.counter_hash import seed_key
from graphplan.models.tiny_llama import TinyLlama
from graphplan.server.core.model import ModelSpec
from graphplan.server.core.sampling import Sampler
from graphplan.server.core.spec.config import (
    SpeculativeConfigError,
    check_plan,
    parse_speculative_config,
)
from graphplan.server.core.spec.ngram import ngram_propose
from graphplan.server.core.spec.verify import accepted, rejection_sample, target_tokens
from graphplan.server.sampling_params import SamplingParams

VOCAB, N, PROMPT = 6, 2000, [1, 4, 2]


# -- greedy acceptance --------------------------------------------------------------------------
@given(st.lists(st.integers(0, 3), max_size=6), st.data())
def test_accepted_is_the_matching_prefix_then_the_targets_token(drafts, data):
    target = data.draw(
        st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1)
    )
    got = accepted(drafts, target)
    a = next((j for j, (d, t) in enumerate(zip(drafts, target)) if d != t), len(drafts))
    assert got == drafts[:a] + [target[a]]


def test_accepted_wants_k_plus_1_target_tokens():
    with pytest.raises(ValueError, match="2 target tokens for 2 drafts"):
        accepted([1, 2], [1, 2])


# -- n-gram proposer ----------------------------------------------------------------------------
def _brute(seq: list[int], k: int, hi: int, lo: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if n >= len(seq):
            continue
        for i in range(len(seq) - n - 1, -1, -1):  # the most recent earlier occurrence
            if seq[i : i + n] == seq[-n:]:
                ext = list(seq)
                for _ in range(k):
                    ext.append(
                        ext[i + n + len(ext) - len(seq)]
                        if i + n + len(ext) - len(seq) < len(ext)
                        else ext[-1]
                    )
                return ext[len(seq) :]
    return []


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=30),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(1, 4),
)
def test_ngram_drafts_follow_the_most_recent_earlier_occurrence(seq, k, a, b):
    lo, hi = min(a, b), max(a, b)
    got = ngram_propose(seq, k, hi, lo)
    assert got == _brute(seq, k, hi, lo)
    assert len(got) in (0, k)


def test_ngram_examples():
    assert ngram_propose([1, 2, 3, 9, 1, 2], 3, 3, 1) == [3, 9, 1]  # 1 2 -> 3 9 1
    assert ngram_propose([5, 6, 5, 6], 4, 2, 2) == [5, 6, 5, 6]  # the period goes on
    assert ngram_propose([1, 2, 3], 2, 2, 1) == []
    assert ngram_propose([7], 2, 4, 1) == []
    # the longest n-gram wins over a more recent shorter one
    assert ngram_propose([1, 2, 8, 0, 2, 9, 1, 2], 1, 2, 1) == [8]


# -- config ---------------------------------------------------------------------------------------
def test_config_parses_vllms_spelling_and_checks_the_plan():
    c = parse_speculative_config(
        json.dumps(
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            }
        )
    )
    assert (c.method, c.k, c.prompt_lookup_max, c.prompt_lookup_min, c.query_len) == (
        "ngram",
        3,
        4,
        2,
        4,
    )
    check_plan(c, 4)
    with pytest.raises(
        SpeculativeConfigError,
        match="scheduler.decode_query_len 1: set scheduler.decode_query_len: 4",
    ):
        check_plan(c, 1)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        (
            '{"method": "ngram", "num_speculative_tokens": 0}',
            r"num_speculative_tokens: 0 must be an integer in 1..16",
        ),
        ('{"method": "ngram", "num_speculative_tokens": true}', "must be an integer"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}',
            "model applies to method 'draft_model' only",
        ),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not built"),
        ('{"method": "magic", "num_speculative_tokens": 2}', "'magic' is not a method"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3}',
            "exceeds prompt_lookup_max",
        ),
        ("x" * 5000, "5000 characters"),
    ],
)
def test_config_errors_name_the_field(text, message):
    with pytest.raises(SpeculativeConfigError, match=message) as e:
        parse_speculative_config(text)
    assert e.value.exit_code == 2


# -- rejection sampling over a tiny Llama's first 3 tokens ---------------------------------------
@pytest.fixture(scope="module")
def conditionals() -> dict[tuple[int, ...], torch.Tensor]:
    """The tiny Llama's next-token distribution (temperature 1) after PROMPT + each context of
    0..3 generated tokens."""
    spec = ModelSpec(layers=2, hidden=64, vocab_size=VOCAB, max_model_len=16, seed=3)
    model = TinyLlama(spec.config(1), seed=3)
    out = {}
    with torch.no_grad():
        for n in range(4):
            for ctx in itertools.product(range(VOCAB), repeat=n):
                seq = PROMPT + list(ctx)
                logits = model(**model.make_batch([(0, 0, seq)]))[-1]
                out[ctx] = torch.softmax(logits.double(), -1)
    return out


def _draft_q(p: torch.Tensor, ctx: tuple[int, ...]) -> torch.Tensor:
    """A draft distribution unlike p (flatter, shifted by the context)."""
    g = torch.roll(p, 1 + len(ctx)) * 0.5 + 0.5 / VOCAB
    return g / g.sum()


def _speculative(conditionals, seeds: list[int], k: int, one_hot: bool) -> list[tuple[int, ...]]:
    """Each seed's first 3 tokens, drawn in rounds of k drafts (the draft's own draws from q, or a
    fixed guess per context as an n-gram's) verified by ``rejection_sample``."""
    keys = torch.tensor([seed_key(s) for s in seeds])
    gen = torch.Generator().manual_seed(1234)
    got: list[list[int]] = [[] for _ in seeds]
    while any(len(g) < 3 for g in got):
        idx = [i for i, g in enumerate(got) if len(g) < 3]
        kk = min(k, 3 - len(got[idx[0]]) - 1) if len({len(got[i]) for i in idx}) == 1 else 0
        drafts, ps, qs = [], [], []
        for i in idx:
            ctx, d, pi, qi = tuple(got[i]), [], [], []
            for _ in range(kk):
                q = _draft_q(conditionals[ctx], ctx)
                t = int(q.argmax()) if one_hot else int(torch.multinomial(q, 1, generator=gen))
                qi.append(
                    torch.nn.functional.one_hot(torch.tensor(t), VOCAB).double() if one_hot else q
                )
                pi.append(conditionals[ctx])
                d.append(t)
                ctx = ctx + (t,)
            pi.append(conditionals[ctx])
            drafts.append(d)
            ps.append(torch.stack(pi))
            qs.append(torch.stack(qi) if qi else torch.zeros(0, VOCAB, dtype=torch.float64))
        steps = torch.tensor([len(got[i]) for i in idx])
        n_acc, toks = rejection_sample(
            torch.stack(ps),
            torch.stack(qs),
            torch.tensor(drafts, dtype=torch.int64).view(len(idx), kk),
            keys[idx],
            steps,
        )
        for i, a, t in zip(idx, n_acc.tolist(), toks.tolist()):
            got[i] += t[: a + 1]
    return [tuple(g[:3]) for g in got]


def _plain(conditionals, seeds: list[int]) -> list[tuple[int, ...]]:
    """The non-speculative sampler (server/core/sampling.py), 3 steps per seed."""
    s = Sampler(len(seeds), VOCAB, penalties=False)
    for slot, seed in enumerate(seeds):
        s.set_row(slot, SamplingParams(temperature=1.0, seed=seed, max_tokens=None))
    slots = torch.arange(len(seeds))
    got: list[tuple[int, ...]] = [() for _ in seeds]
    for _ in range(3):
        logits = torch.stack([conditionals[g].log().float() for g in got])
        toks = s.sample(logits, slots, logprobs=False).token_ids
        s.update(slots, toks)
        got = [g + (t,) for g, t in zip(got, toks.tolist())]
    return got


def _chi2_p(counts_a: dict, counts_b: dict | None, expected: dict | None) -> float:
    """p-value of a two-sample (counts_b) or goodness-of-fit (expected probabilities) test, bins
    with too few expected counts merged."""
    keys = sorted(set(counts_a) | set(counts_b or {}) | set(expected or {}))
    if expected is not None:
        exp = [expected[k] * N for k in keys]
        obs = [counts_a.get(k, 0) for k in keys]
        bins, cur_o, cur_e = [], 0.0, 0.0
        for o, e in sorted(zip(obs, exp), key=lambda t: t[1]):
            cur_o, cur_e = cur_o + o, cur_e + e
            if cur_e >= 5:
                bins.append((cur_o, cur_e))
                cur_o = cur_e = 0.0
        if cur_e:
            o, e = bins.pop()
            bins.append((o + cur_o, e + cur_e))
        x = sum((o - e) ** 2 / e for o, e in bins)
        df = len(bins) - 1
    else:
        assert counts_b is not None
        pairs = sorted(((counts_a.get(k, 0), counts_b.get(k, 0)) for k in keys), key=sum)
        bins, ca, cb = [], 0, 0
        for a, b in pairs:
            ca, cb = ca + a, cb + b
            if ca + cb >= 10:
                bins.append((ca, cb))
                ca = cb = 0
        if ca + cb:
            a, b = bins.pop()
            bins.append((a + ca, b + cb))
        x = 0.0
        for a, b in bins:
            for o, tot in ((a, sum(p[0] for p in bins)), (b, sum(p[1] for p in bins))):
                e = tot * (a + b) / (2 * N)
                x += (o - e) ** 2 / e
        df = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(x / 2.0)))


def _counts(samples) -> dict:
    out: dict = {}
    for s in samples:
        out[s] = out.get(s, 0) + 1
    return out


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-q", "one-hot"])
def test_rejection_sampling_gives_the_targets_distribution_and_seeds_reproduce(
    conditionals, one_hot
):
    seeds = list(range(N))
    spec = _speculative(conditionals, seeds, 2, one_hot)
    plain = _plain(conditionals, list(range(N, 2 * N)))
    exact = {
        (a, b, c): float(conditionals[()][a] * conditionals[(a,)][b] * conditionals[(a, b)][c])
        for a, b, c in itertools.product(range(VOCAB), repeat=3)
    }
    assert _chi2_p(_counts(spec), None, exact) > 0.01
    assert _chi2_p(_counts(plain), None, exact) > 0.01
    assert _chi2_p(_counts(spec), _counts(plain), None) > 0.01
    assert _speculative(conditionals, seeds[:300], 2, one_hot) == spec[:300]  # seeds reproduce
    # the draft matters: acceptance is partial, so both branches ran
    assert len(set(spec)) > 20


def test_a_degenerate_test_fails():
    """The chi-square helper rejects a wrong distribution (so the test above can fail)."""
    exact = {(a,): 1 / VOCAB for a in range(VOCAB)}
    skewed = {(0,): N // 2, **{(a,): N // (2 * (VOCAB - 1)) for a in range(1, VOCAB)}}
    assert _chi2_p(skewed, None, exact) < 1e-6


def test_target_tokens_at_offsets_are_the_samplers_later_steps():
    """Scoring k + 1 positions at once draws what the sampler draws at those steps one by one
    (the coupling that makes one-hot acceptance give the non-speculative tokens per seed)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    a, b = Sampler(2, 50, penalties=False), Sampler(2, 50, penalties=False)
    for s in (a, b):
        s.set_row(0, SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=None))
    one = []
    for j in range(4):
        t = a.sample(logits[j : j + 1], torch.tensor([0]), logprobs=False).token_ids
        a.update([0], t)
        one += t.tolist()
    together = target_tokens(
        b, logits, torch.zeros(4, dtype=torch.int64), torch.arange(4), logprobs=False
    )
    assert together.token_ids.tolist() == one
