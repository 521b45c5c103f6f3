"""The runtime on a real GPU: CUDA graphs captured into one pool, replayed against eager in bf16."""

import pytest
import torch
from test_runtime import context_checks

from graphplan.compiler import compile_plan
from graphplan.models.tiny_llama import (
    LOGIT_TOL,
    TinyLlama,
    TinyLlamaConfig,
    greedy,
    greedy_mismatch,
    make_batch,
    static_inputs,
)
from graphplan.runtime import CaptureError, GraphRunner

pytestmark = pytest.mark.gpu

CFG = TinyLlamaConfig(
    vocab_size=2048,
    hidden=256,
    layers=2,
    heads=4,
    kv_heads=1,
    intermediate=768,
    max_model_len=64,
    num_cache_rows=32,
)
PLAN = {
    "version": 1,
    "name": "gpu",
    "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 256},
    "cudagraph": {
        "mode": "FULL",
        "attention_support": "ALWAYS",
        "capture_sizes": {"preset": "vllm"},
    },
}


def model():
    return TinyLlama(CFG, seed=0, device="cuda", dtype=torch.bfloat16)


def decode(m, n, seed):
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(1, CFG.vocab_size, (n,), generator=gen).tolist()
    return make_batch(m, [(row, 5 + row % 7, [t]) for row, t in enumerate(toks)])


def test_every_captured_size_and_sizes_in_between_match_eager_in_bf16():
    m = model()
    runner = GraphRunner(m, compile_plan(PLAN), static_inputs(m), progress=False)
    summary = runner.capture()
    sizes = runner.table.capture_sizes
    assert summary["graphs"] == len(runner.table.graphs) > 0 and summary["bytes"] > 0
    for n in sorted(set(sizes) | {s - 1 for s in sizes if s > 1} | {s + 1 for s in sizes}):
        if n > runner.table.max_num_seqs:
            continue
        batch = decode(m, n, seed=n)
        out = runner.step(batch, num_reqs=n, max_query_len=1).clone()
        ref = m(**batch)  # same K/V written at the same slots, so the cache state is unchanged
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
    assert runner.stats()["eager_steps"] == {}


def test_mixed_prefill_batches_replay_full_graphs_and_match_eager():
    m = model()
    runner = GraphRunner(m, compile_plan(PLAN), static_inputs(m), progress=False)
    runner.capture()
    batch = make_batch(m, [(0, 0, list(range(1, 20))), (1, 3, [7]), (2, 0, list(range(5, 40)))])
    out = runner.step(batch, num_reqs=3, max_query_len=35).clone()
    torch.testing.assert_close(out, m(**batch), atol=3e-2, rtol=3e-2)
    assert runner.stats()["replays_by_mode"]["FULL"] == 1


def test_greedy_generation_with_graphs_is_identical_to_eager():
    m = model()
    runner = GraphRunner(m, compile_plan(PLAN), static_inputs(m), progress=False)
    runner.capture()
    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(1, CFG.vocab_size, (int(k),), generator=gen).tolist()
        for k in torch.randint(1, 20, (12,), generator=gen)
    ]
    graphs, got = greedy(m, prompts, 24, step=lambda b, r, q: runner.step(b, r, q))
    _, want = greedy(model(), prompts, 24, forced=graphs)  # eager over the graphs' tokens
    assert greedy_mismatch(graphs, got, want, torch.bfloat16) is None


def test_a_requests_outputs_follow_its_own_context_and_ignore_its_neighbours_on_the_gpu():
    m = model()
    runner = GraphRunner(m, compile_plan(PLAN), static_inputs(m), progress=False)
    runner.capture()
    context_checks(m, runner, LOGIT_TOL[torch.bfloat16])
    assert runner.stats()["replays_by_mode"]["FULL"] == 6 and runner.stats()["eager_steps"] == {}


def test_capture_that_syncs_the_host_fails_cleanly_and_frees_its_memory():
    m = model()

    def syncs(**kw):  # .item() is a host sync: illegal while a CUDA graph is being captured
        out = m(**kw)
        return out * (out.sum().item() != 0)

    runner = GraphRunner(syncs, compile_plan(PLAN), static_inputs(m), progress=False, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(CaptureError, match="failed.*Released every graph.*host syncs"):
        runner.capture()
    assert runner.captured_graph_ids() == []
    out = runner.step(decode(m, 4, 0), num_reqs=4, max_query_len=1)  # eager still works
    assert out.shape == (4, CFG.vocab_size)
