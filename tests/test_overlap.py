"""Decode steps as two overlapped nano-batches (models/hf/overlap.py), on the CPU: the same
operations in the same order on one stream, so the logits are transformers' own and those of the
plain fused forward; only uniform decode steps of at least ``overlap_min_tokens`` are split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphplan.compiler import compile_plan
from graphplan.models.hf import PagedCausalLM, load_model
from graphplan.models.hf import overlap
from graphplan.runtime import GraphRunner

from hf_models import LENS, STEPS, plan, reference_logits, run_schedule, small_config, tokens

TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    load_model(
        small_config(request.param), seed=0, attn_implementation="eager", random_weights=True
    ).save_pretrained(path)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return path, ref.eval().requires_grad_(False)


def load(path, min_tokens: int, **kw):
    kw = {**dict(max_num_seqs=4, max_model_len=32, block_size=4), **kw}
    model = PagedCausalLM.load(path, fused_ops=True, **kw)
    model.fused.overlap_min_tokens = min_tokens
    return model


def counting(monkeypatch) -> list[int]:
    """The token count of every step that ran overlapped."""
    seen: list[int] = []
    real = overlap.overlapped_layers

    def spy(decoder, h, step):
        seen.append(h.shape[0])
        return real(decoder, h, step)

    monkeypatch.setattr(overlap, "overlapped_layers", spy)
    return seen


def test_overlapped_decode_steps_give_transformers_logits(saved, monkeypatch):
    path, ref = saved
    model = load(path, min_tokens=2)
    seen = counting(monkeypatch)
    runner = GraphRunner(model, compile_plan(plan()), model.static_inputs(), progress=False)
    runner.capture()
    seen.clear()  # the captures ran it too
    seqs = [tokens(n, seed=10 + i) for i, n in enumerate(LENS)]
    got = run_schedule(model, runner, seqs, STEPS)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], reference_logits(ref, seq), **TOL)
    # the FULL graphs of 4 (three steps of 3 requests) and 2 (two steps) ran overlapped; the
    # graph of 1 and the two eager mixed steps did not (on the CPU a "replay" runs the forward)
    assert seen == [4, 4, 4, 2, 2]


@settings(max_examples=20, deadline=None)
@given(
    contexts=st.lists(st.integers(0, 20), min_size=1, max_size=7),
    min_tokens=st.integers(0, 8),
    seed=st.integers(0, 50),
)
def test_overlap_on_and_off_give_the_same_logits_for_any_decode_batch(
    saved, contexts, min_tokens, seed
):
    path, _ = saved
    on, off = (load(path, m, max_num_seqs=8) for m in (min_tokens, 0))
    outs = []
    for model in (on, off):
        gen = torch.Generator().manual_seed(seed)
        for seat, ctx in enumerate(contexts):  # each request's context, then one decode step
            if ctx:
                prompt = torch.randint(0, 128, (ctx,), generator=gen).tolist()
                model(**model.make_batch([(seat, 0, prompt)]))
        step = [(seat, ctx, [seat + 1]) for seat, ctx in enumerate(contexts)]
        outs.append(model(**model.make_batch(step)))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_only_uniform_decode_steps_of_the_threshold_are_split(saved, monkeypatch):
    path, _ = saved
    model = load(path, min_tokens=3)
    seen = counting(monkeypatch)
    model(**model.make_batch([(0, 0, [1, 2, 3, 4])]))  # a prompt of 4: T != R
    model(**model.make_batch([(1, 0, [5]), (2, 0, [6])]))  # 2 decodes: below 3
    model(**model.make_batch([(0, 4, [7]), (1, 1, [8]), (2, 1, [9]), (3, 0, [1, 2])]))  # mixed
    assert seen == []
    model(**model.make_batch([(0, 5, [7]), (1, 2, [8]), (2, 2, [9])]))
    assert seen == [3]


def test_lora_and_piecewise_steps_take_the_plain_forward(saved):
    path, _ = saved
    model = load(path, min_tokens=1)
    meta = object()  # a piecewise step's StepInputs is not a PagedBatch
    assert not overlap.applies(model.fused, meta, 4)
    model.fused.lora_step = object()
    batch = model.make_batch([(0, 0, [1]), (1, 0, [2])])
    from graphplan.models.hf.attention import make_paged_batch

    paged = make_paged_batch(
        model.kv_cache, *(batch[k] for k in ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc"))
    )
    assert not overlap.applies(model.fused, paged, 2)
    model.fused.lora_step = None
    assert overlap.applies(model.fused, paged, 2)
