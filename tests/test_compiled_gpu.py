"""The compiled path on a real GPU: inductor (Triton kernels) compiled once with a dynamic token
dimension, CUDA graphs captured of it per size, replayed against the eager model in bf16."""

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, make_batch, static_inputs
from graphplan.runtime import GraphRunner

pytestmark = pytest.mark.gpu

CFG = TinyLlamaConfig(
    vocab_size=2048,
    hidden=256,
    layers=4,
    heads=4,
    kv_heads=1,
    intermediate=768,
    max_model_len=64,
    num_cache_rows=64,
)
PLAN = {
    "version": 1,
    "name": "gpu-compiled",
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 256},
    "cudagraph": {
        "mode": "FULL",
        "attention_support": "ALWAYS",
        "capture_sizes": {"preset": "vllm"},
    },
}
BF16_TOLERANCE = 3e-2
"""Largest |compiled - eager| allowed, relative to the largest |eager| logit: inductor fuses bf16
ops with float32 intermediates, so it rounds differently from eager (both are bf16 models)."""


def decode(m, n, seed):
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(1, CFG.vocab_size, (n,), generator=gen).tolist()
    return make_batch(m, [(row, 5 + row % 7, [t]) for row, t in enumerate(toks)])


def test_inductor_graphs_match_eager_in_bf16_at_every_size_with_zero_recompiles():
    torch._dynamo.reset()
    m = TinyLlama(CFG, seed=0, device="cuda", dtype=torch.bfloat16)
    runner = GraphRunner(m, compile_plan(PLAN), static_inputs(m), progress=False, compile=True)
    summary = runner.capture()
    sizes = runner.table.capture_sizes
    assert summary["graphs"] == len(runner.table.graphs) > 0 and 1 in sizes
    worst = 0.0
    for n in sorted(set(sizes) | {s - 1 for s in sizes if s > 1} | {s + 1 for s in sizes}):
        if n > runner.table.max_num_seqs:
            continue
        batch = decode(m, n, seed=n)
        out = runner.step(batch, num_reqs=n, max_query_len=1).clone()
        ref = m(**batch)  # same K/V at the same slots (bf16 rounding aside)
        worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
    mixed = make_batch(m, [(0, 0, list(range(1, 20))), (1, 3, [7]), (2, 0, list(range(5, 40)))])
    out = runner.step(mixed, num_reqs=3, max_query_len=35).clone()
    worst = max(worst, ((out - m(**mixed)).abs().max() / m(**mixed).abs().max()).item())
    print(f"max |compiled - eager| / max |eager| = {worst:.2e} (bound {BF16_TOLERANCE})")
    assert worst <= BF16_TOLERANCE
    s = runner.stats()
    assert s["eager_steps"] == {} and s["compile"]["backend"] == "inductor"
    assert (s["compile"]["compiles"], s["compile"]["recompiles"]) == (1, 0)
    assert s["compile"]["merged_linears"] == 2 * CFG.layers  # q/k/v, gate/up: one GEMM each
    # head, tail, an attention and an MLP half per layer; 4 distinct ones compiled
    assert (s["compile"]["regions"], s["compile"]["region_compiles"]) == (2 * CFG.layers + 1, 4)
    runner.release()
    torch._dynamo.reset()


def test_hf_adapter_decode_graphs_of_the_inductor_model_stay_within_bf16_error():
    """The HF adapter (tests/test_hf_gpu.py's bound: twice transformers' own bf16 error against
    its float32 forward, or 2% of the largest logit), decodes replaying compiled FULL graphs."""
    pytest.importorskip("transformers")
    from graphplan.models.hf import PagedCausalLM

    from hf_models import LENS, STEPS, bf16_errors, plan, run_schedule, small_config, tokens

    torch._dynamo.reset()
    vocab, table = 1024, compile_plan(plan())
    model = PagedCausalLM.load(
        small_config("llama", vocab=vocab, hidden=256, layers=4, heads=8, kv_heads=2),
        max_num_seqs=table.max_num_seqs,
        max_model_len=32,
        block_size=4,
        dtype=torch.bfloat16,
        device="cuda",
        seed=0,
        random_weights=True,
    )
    runner = GraphRunner(model, table, model.static_inputs(), progress=False, compile=True)
    runner.capture()
    seqs = [tokens(n, seed=10 + i, vocab=vocab) for i, n in enumerate(LENS)]
    got = run_schedule(model, runner, seqs, STEPS)
    for i, (err, err_hf, bound, _) in enumerate(bf16_errors(model, got, seqs)):
        print(f"request {i}: compiled {err:.4f}, transformers bf16 {err_hf:.4f}, bound {bound:.4f}")
        assert err <= bound, f"request {i}"
    s = runner.stats()
    assert s["replays_by_mode"]["FULL"] == 6
    # the warm-up compiles at the largest size and, where torch's lowering specialises one token,
    # at the smallest too (GraphRunner's compile warm-up); never after it
    assert s["compile"]["compiles"] in (1, 2) and s["compile"]["recompiles"] == 0
    # q/k/v and gate/up of the 4 layers, one GEMM each, in every compile; 9 regions, 4 distinct
    n = s["compile"]["compiles"]
    assert s["compile"]["merged_linears"] == 2 * 4 * n
    assert (s["compile"]["regions"], s["compile"]["region_compiles"]) == (9 * n, 4 * n)
    runner.release()
    torch._dynamo.reset()
