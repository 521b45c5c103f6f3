"""Piecewise CUDA graphs on the GPU (bf16): mixed batches replayed piece by piece around eager
attention match eager, and continuous batching with graphs generates exactly what eager does.
Skipped cleanly without CUDA (tests/conftest.py)."""

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models.tiny_llama import (
    TinyLlama,
    TinyLlamaConfig,
    greedy,
    greedy_mismatch,
    make_batch,
    static_inputs,
)
from graphplan.runtime import GraphRunner
from graphplan.server.core.generation import continuous_greedy, make_prompts

pytestmark = pytest.mark.gpu

CFG = TinyLlamaConfig(
    vocab_size=2048,
    hidden=512,
    layers=4,
    heads=8,
    kv_heads=2,
    intermediate=1408,
    max_model_len=256,
    num_cache_rows=16,
)


def plan(mode, sizes):
    return {
        "version": 1,
        "name": "pw-gpu",
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512},
        "cudagraph": {
            "mode": mode,
            "attention_support": "ALWAYS",
            "splitting_ops": ["attention"],
            "capture_sizes": list(sizes),
        },
    }


def model(cfg=CFG):
    return TinyLlama(cfg, seed=0, device="cuda", dtype=torch.bfloat16)


def toks(n, seed):
    return torch.randint(
        1, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


STEPS = [
    [(0, 0, toks(40, 1)), (1, 0, toks(9, 2))],  # 49 -> 64
    [(0, 40, toks(1, 3)), (1, 9, toks(1, 4)), (2, 0, toks(100, 5))],  # 102 -> 128
    [(0, 41, toks(1, 8)), (1, 10, toks(1, 9)), (2, 100, toks(30, 6)), (3, 0, toks(200, 7))],
]  # 232 -> 256


def check_mixed(graphs, eager, runner):
    """STEPS through the runner's piecewise graphs match eager (teacher-forced, bf16 tolerance)."""
    for reqs in STEPS:
        batch = make_batch(graphs, reqs)
        mql = max(len(t) for _, _, t in reqs)
        out = runner.step(batch, num_reqs=len(reqs), max_query_len=mql).clone()
        ref = eager(**batch)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < 3e-2, f"relative L2 error {rel:.3g} at {batch['input_ids'].shape[0]} tokens"
        agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree >= 0.9, f"greedy tokens agree on only {agree:.0%} of rows"
    s = runner.stats()
    assert s["replays_by_mode"] == {"PIECEWISE": len(STEPS)} and s["eager_steps"] == {}


def test_mixed_batches_through_piecewise_cuda_graphs_match_eager_in_bf16():
    graphs, eager = model(), model()
    runner = GraphRunner(
        graphs,
        compile_plan(plan("PIECEWISE", [8, 16, 32, 64, 128, 256])),
        static_inputs(graphs),
        progress=False,
    )
    summary = runner.capture()
    assert summary["backend"] == "cuda" and summary["piecewise"]["pieces"] == CFG.layers + 1
    assert summary["piecewise"]["split_ops"] == CFG.layers
    check_mixed(graphs, eager, runner)


def test_continuous_batching_greedy_generation_with_graphs_is_identical_to_eager(root):
    cfg = TinyLlamaConfig(
        vocab_size=2048,
        hidden=256,
        layers=2,
        heads=4,
        kv_heads=1,
        intermediate=768,
        max_model_len=128,
        num_cache_rows=64,
    )
    m = model(cfg)
    runner = GraphRunner(
        m, compile_plan(str(root / "plans" / "tiny-llama.yaml")), static_inputs(m), progress=False
    )
    runner.capture()
    prompts = make_prompts(8, seed=0, vocab=cfg.vocab_size, max_len=64)
    kw = dict(chunk=32, max_num_seqs=runner.table.max_num_seqs, arrive_every=2)
    with_graphs, got = continuous_greedy(
        m, prompts, 12, **kw, step=lambda b, r, q: runner.step(b, r, q)
    )
    s = runner.stats()
    assert s["replays_by_mode"]["PIECEWISE"] > 0 and s["replays_by_mode"]["FULL"] > 0
    assert s["eager_steps"] == {}
    m.kv_cache.zero_()
    _, want = continuous_greedy(m, prompts, 12, **kw, forced=with_graphs)  # over the same tokens
    assert greedy_mismatch(with_graphs, got, want, m.kv_cache.dtype) is None
    m.kv_cache.zero_()  # the plain mode too: one mixed prefill step, then FULL decodes
    plain, got = greedy(m, prompts, 8, step=lambda b, r, q: runner.step(b, r, q))
    m.kv_cache.zero_()
    _, want = greedy(m, prompts, 8, forced=plain)
    assert greedy_mismatch(plain, got, want, m.kv_cache.dtype) is None
