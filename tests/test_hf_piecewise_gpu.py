"""Piecewise graphs for Hugging Face models on a GPU (real CUDA graphs, bf16): the CPU tests of
test_hf_piecewise.py over mixed batches (chunked prefill beside decodes), FULL_AND_PIECEWISE.

Tolerance (bf16, as test_hf_gpu.py): graphplan's logits may differ from the float32 truth
(transformers' own forward in float32 on the same bf16-rounded weights) by at most twice what
transformers' own bf16 forward differs from it, or 2% of the largest logit, whichever is larger.
Findings are printed and, when $OUT is set, written to $OUT/hf_piecewise_gpu.md.

    python -m pytest -q -s -m gpu tests/test_hf_piecewise_gpu.py
"""

import os
from pathlib import Path

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.runtime import GraphRunner

from hf_models import (
    FAMILIES,
    bf16_errors,
    mixed_plan,
    mixed_schedule,
    run_schedule,
    small_config,
    tokens,
)

pytestmark = pytest.mark.gpu
VOCAB = 1024
LENS, PROMPTS = (40, 26, 9, 33, 20), (30, 16, 1, 24, 4)


def record(line: str) -> None:
    print(line)
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "hf_piecewise_gpu.md", "a") as f:
            f.write(line + "\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_mixed_batches_replay_piece_graphs_within_the_models_own_bf16_error(family):
    from graphplan.models.hf import PagedCausalLM

    table = compile_plan(
        mixed_plan(max_num_seqs=8, max_tokens=64, sizes=(1, 2, 4, 8, 16, 24, 32, 48, 64))
    )
    cfg = small_config(family, vocab=VOCAB, hidden=256, layers=4, heads=8, kv_heads=2)
    model = PagedCausalLM.load(
        cfg,
        max_num_seqs=8,
        max_model_len=64,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=0,
        random_weights=True,
    )
    runner = GraphRunner(model, table, model.static_inputs(), progress=False)
    runner.capture()
    steps, uniform = mixed_schedule(LENS, prompts=PROMPTS, budget=24, seed=7)
    seqs = [tokens(n, seed=10 + i, vocab=VOCAB) for i, n in enumerate(LENS)]
    got = run_schedule(model, runner, seqs, steps)
    stats = runner.stats()
    assert stats["backend"] == "cuda"
    assert stats["replays_by_mode"]["PIECEWISE"] == len(steps) - sum(uniform)
    assert stats["replays_by_mode"]["FULL"] == sum(uniform)
    assert sum(stats["eager_steps"].values()) == 0
    for i, (err_gp, err_hf, bound, _) in enumerate(bf16_errors(model, got, seqs)):
        record(
            f"- {family} request {i} ({len(steps)} steps, {len(steps) - sum(uniform)} "
            f"PIECEWISE): bf16 max |logit error| graphplan {err_gp:.4f}, transformers "
            f"{err_hf:.4f} (bound {bound:.4f})"
        )
        assert err_gp <= bound, f"request {i}"
