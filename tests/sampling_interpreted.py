"""The sampler's Triton kernel (server/core/sampling_kernels.py) on the CPU, under Triton's interpreter,
against the sampler's torch form (server/core/sampling.py): the same tokens, exactly, for greedy and
sampled rows, with and without truncation, over vocabularies of one tile and of several (ragged
last tile), and ties broken toward the smallest token id as torch.argmax breaks them. Not
collected with the suite: tests/test_sampling.py runs it in a process with TRITON_INTERPRET=1
(tests/interpreted.py):

    TRITON_INTERPRET=1 python -m pytest -q tests/sampling_interpreted.py
"""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (see the docstring)", allow_module_level=True)
pytest.importorskip("triton")

from graphplan.server.core import sampling_kernels  # after the interpreter check above
from graphplan.server.core.sampling import Sampler, gumbel_noise, noise_row_keys, vocab_keys
from graphplan.server.sampling_params import SamplingParams

TILE = sampling_kernels.TILE


def torch_form(scaled, threshold, keys, steps, greedy):
    noise = gumbel_noise(keys, steps, vocab_keys(scaled.shape[1]))
    noisy = scaled + noise.masked_fill_(greedy[:, None], 0.0)
    return noisy.masked_fill_(scaled < threshold[:, None], -math.inf).argmax(dim=-1)


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([1, 7, TILE, TILE + 1, 2 * TILE + 333]),
    seed=st.integers(0, 2**31 - 1),
    cut=st.sampled_from([None, 0.5, 0.99]),  # no threshold, or keep the top half / top 1 %
)
def test_the_kernel_picks_the_torch_forms_token(rows, vocab, seed, cut):
    gen = torch.Generator().manual_seed(seed)
    scaled = torch.randn(rows, vocab, generator=gen) * 3
    keys = torch.randint(0, 2**32, (rows,), generator=gen)
    steps = torch.randint(0, 1000, (rows,), generator=gen)
    greedy = torch.rand(rows, generator=gen) < 0.3
    if cut is None:
        threshold = torch.full((rows,), -math.inf)
    else:
        threshold = scaled.quantile(cut, dim=1).where(~greedy, -math.inf)
    got = sampling_kernels.gumbel_argmax(scaled, threshold, noise_row_keys(keys, steps), greedy)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch_form(scaled, threshold, keys, steps, greedy))
    assert bool((scaled.gather(1, got[:, None])[:, 0] >= threshold).all())


def test_ties_across_tiles_go_to_the_smallest_token_id():
    scaled = torch.zeros(2, 3 * TILE)
    scaled[:, [5, TILE + 9, 2 * TILE + 1]] = 4.0  # one maximum in each tile
    greedy = torch.tensor([True, True])
    threshold = torch.full((2,), -math.inf)
    got = sampling_kernels.gumbel_argmax(
        scaled, threshold, torch.zeros(2, dtype=torch.int64), greedy
    )
    assert got.tolist() == [5, 5]
    scaled[1, 5] = 0.0
    got = sampling_kernels.gumbel_argmax(
        scaled, threshold, torch.zeros(2, dtype=torch.int64), greedy
    )
    assert got.tolist() == [5, TILE + 9]


def test_a_fused_sampler_gives_the_torch_samplers_tokens_step_after_step():
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.3, seed=2),
        SamplingParams(temperature=1.3, min_p=0.05, presence_penalty=0.5, seed=3),
        SamplingParams(temperature=0.9, seed=4),
    ]
    vocab = TILE + 77
    fused, plain = (Sampler(len(params), vocab, max_logprobs=2, fused=f) for f in (True, False))
    for s in (fused, plain):
        for i, p in enumerate(params):
            s.set_row(i, p, prompt_ids=[3, 4])
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        logits = torch.randn(len(params), vocab, generator=gen) * 4
        work = dict(truncate=step % 2 == 0)
        outs = [
            s.sample(logits, s.load_slots(list(range(len(params)))), **work) for s in (fused, plain)
        ]
        assert torch.equal(outs[0].token_ids, outs[1].token_ids), step
        assert torch.equal(outs[0].logprobs, outs[1].logprobs)
        for s, out in zip((fused, plain), outs):
            s.update(s.load_slots(list(range(len(params)))), out.token_ids)


def test_scores_that_are_not_float32_with_unit_stride_are_refused():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="float32 scores with unit stride"):
        sampling_kernels.gumbel_argmax(x.t(), torch.zeros(8), torch.zeros(8), torch.zeros(8))
    with pytest.raises(ValueError, match="float32"):
        sampling_kernels.gumbel_argmax(x.half(), torch.zeros(2), torch.zeros(2), torch.zeros(2))
