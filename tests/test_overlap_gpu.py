"""Overlapped nano-batch decode (models/hf/overlap.py) on a GPU: two CUDA streams inside the
captured FULL graphs. Bound as tests/test_fused_ops_gpu.py's: each request's logits against
transformers' float32 forward of the same bf16-rounded weights, within twice transformers' own
bf16 sdpa error or 2% of the largest logit.

    python -m pytest -q -s -m gpu tests/test_overlap_gpu.py
"""

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models.hf import overlap

from graphplan.runtime import GraphRunner

from hf_models import LENS, STEPS, plan, reference_logits, run_schedule, small_config, tokens
from test_fused_ops_gpu import DEV, VOCAB, record, sdpa_reference

pytestmark = pytest.mark.gpu


def build(family: str, table):
    """A bf16 model on the GPU with the overlap on from 2 tokens, its graphs captured."""
    from graphplan.models.hf import PagedCausalLM

    model = PagedCausalLM.load(
        small_config(family, vocab=VOCAB, hidden=256, layers=4, heads=8),
        max_num_seqs=table.max_num_seqs,
        max_model_len=64,
        block_size=4,
        dtype=torch.bfloat16,
        device=DEV,
        random_weights=True,
        fused_ops=True,
    )
    model.fused.overlap_min_tokens = 2
    runner = GraphRunner(model, table, model.static_inputs(), progress=False)
    runner.capture()
    return model, runner


def within_bound(model, got: list, seqs: list, what: str) -> None:
    ref16, ref32 = sdpa_reference(model, torch.bfloat16), sdpa_reference(model, torch.float32)
    for i, seq in enumerate(seqs):
        truth = reference_logits(ref32, seq)[-got[i].shape[0] :]
        top = truth.abs().max().item()
        err_hf = (reference_logits(ref16, seq)[-got[i].shape[0] :] - truth).abs().max().item()
        bound = max(2 * err_hf, 0.02 * top)
        err = (got[i] - truth).abs().max().item()
        record(f"- {what} request {i}: max |logit error| {err:.4f} (bound {bound:.4f})")
        assert err <= bound, f"{what} request {i}"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_overlapped_full_graphs_give_transformers_logits_in_bf16(family, monkeypatch):
    seen = []
    real = overlap.overlapped_layers
    monkeypatch.setattr(
        overlap, "overlapped_layers", lambda d, h, s: seen.append(h.shape[0]) or real(d, h, s)
    )
    model, runner = build(family, compile_plan(plan()))
    assert sorted(set(seen)) == [2, 4]
    seqs = [tokens(n, seed=10 + i, vocab=VOCAB) for i, n in enumerate(LENS)]
    got = run_schedule(model, runner, seqs, STEPS)
    within_bound(model, got, seqs, f"{family} overlapped")


def test_a_padded_graph_of_64_with_48_requests_of_different_contexts():
    """The halves are the graph's (32 + 32 rows): the second holds 16 real requests and 16
    padded ones; every context differs, so a token reading another request's keys fails."""
    table = compile_plan(plan(max_num_seqs=64, max_tokens=64, sizes=(64,)))
    model, runner = build("llama", table)
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(2, 60, (48,), generator=gen).tolist()
    seqs = [tokens(n, seed=100 + i, vocab=VOCAB) for i, n in enumerate(lens)]
    with torch.no_grad():
        for i, seq in enumerate(seqs):  # prompts but the last token, eagerly
            model(**model.make_batch([(i, 0, seq[:-1])]))
        step = [(i, len(s) - 1, [s[-1]]) for i, s in enumerate(seqs)]
        logits = runner.step(model.make_batch(step), num_reqs=48, max_query_len=1)
    assert runner.stats()["replays_by_mode"]["FULL"] == 1
    within_bound(model, [logits[i : i + 1].float() for i in range(48)], seqs, "padded 64")
