"""LoRA adapters on a GPU (real CUDA graphs, the fused decoder's Triton kernels, bf16): the CPU
tests' mixed batch of three adapters and the base model, FULL and FULL_AND_PIECEWISE, every
request's logits against transformers' float32 forward with its adapter merged into the same
bf16-rounded weights, within twice transformers' own bf16 error of it or 2% of the largest logit;
every step replays the graph ``plan explain`` names.

    python -m pytest -q -s -m gpu tests/test_lora_gpu.py
"""

import pytest
import torch
from lora_adapters import LENS, merged_model, plan, run_mixed, write_adapter

from graphplan.compiler import compile_plan
from graphplan.models.hf import PagedCausalLM
from graphplan.models.hf.lora import read_adapter
from graphplan.runtime import GraphRunner

from hf_models import reference_logits, reference_model, small_config, tokens

pytestmark = pytest.mark.gpu
VOCAB = 1024


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_bf16_mixed_adapters_match_the_merged_models_within_their_own_bf16_error(tmp_path, mode):
    cfg = small_config("llama", vocab=VOCAB, hidden=256, layers=4, heads=8, kv_heads=2)
    dirs = [
        write_adapter(tmp_path / "a", cfg, rank=16, seed=1, std=0.1),
        write_adapter(tmp_path / "b", cfg, rank=8, alpha=4.0, seed=2, rslora=True, std=0.1),
        write_adapter(
            tmp_path / "c", cfg, rank=4, seed=3, modules=("q_proj", "down_proj"), std=0.2
        ),
    ]
    model = PagedCausalLM.load(
        cfg,
        max_num_seqs=4,
        max_model_len=32,
        block_size=4,
        dtype=torch.bfloat16,
        device="cuda",
        random_weights=True,
        max_loras=3,
        max_lora_rank=16,
    )
    assert model.fused_ops
    for name, d in zip("abc", dirs):
        model.lora.add(read_adapter(name, d, cfg, max_rank=16, dtype=torch.bfloat16))
    table = compile_plan(plan(mode))
    runner = GraphRunner(model, table, model.static_inputs(), progress=False)
    runner.capture()
    seqs = [tokens(n, seed=20 + i, vocab=VOCAB) for i, n in enumerate(LENS)]
    got, seen = run_mixed(model, runner, table, seqs)
    assert runner.stats()["backend"] == "cuda"
    for want, replayed, _ in seen:
        assert want >= 0 and replayed == [want]
    base16 = reference_model(model)
    base32 = reference_model(model).float()
    for i, (seq, d) in enumerate(zip(seqs, [*dirs, None])):
        truth = reference_logits(merged_model(base32, d), seq)
        err_hf = (reference_logits(merged_model(base16, d), seq) - truth).abs().max().item()
        top = truth.abs().max().item()
        err = (got[i].float() - truth).abs().max().item()
        bound = max(2 * err_hf, 0.02 * top)
        moved = (reference_logits(base32, seq) - truth).abs().max().item()
        print(
            f"{mode} request {i}: graphplan {err:.4f}, transformers bf16 {err_hf:.4f}, "
            f"bound {bound:.4f}; the adapter moves the logits by {moved:.4f}"
        )
        assert err <= bound, f"request {i}"
        assert d is None or moved > 3 * bound, f"request {i}: the adapter is within the bound"
