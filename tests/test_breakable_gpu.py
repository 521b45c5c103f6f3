"""The run-time split on CUDA graphs (bf16): segments captured between eager attention calls match
eager on mixed batches (teacher-forced logits within the bf16 tolerance), a model torch.fx cannot
trace gets piecewise graphs through ``auto``, and a host sync inside a segment is a SplitError that leaves CUDA and the
runner usable. Continuous batching through it (the default split) is tests/test_piecewise_gpu.py's.
Skipped cleanly without CUDA."""

import pytest
import torch
from test_breakable import PyLlama, marked_attention, py_llama
from test_piecewise import Branchy
from test_piecewise_gpu import CFG, model, plan, toks
from tiny_llama import make_batch, static_inputs

from graphplan.compiler import compile_plan
from graphplan.runtime import GraphRunner, SplitError

pytestmark = pytest.mark.gpu

STEPS = [[(0, 0, toks(40, 1)), (1, 0, toks(9, 2))],                                    # 49 -> 64
         [(0, 40, toks(1, 3)), (1, 9, toks(1, 4)), (2, 0, toks(100, 5))],               # 102 -> 128
         [(0, 41, toks(1, 8)), (1, 10, toks(1, 9)), (2, 100, toks(30, 6)),
          (3, 0, toks(200, 7))]]                                                        # 232 -> 256


def check_mixed(graphs, eager, runner):
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


def test_mixed_batches_through_runtime_split_cuda_graphs_match_eager_in_bf16():
    graphs, eager = model(), model()
    runner = GraphRunner(graphs, compile_plan(plan("PIECEWISE", [8, 16, 32, 64, 128, 256])),
                         static_inputs(graphs), progress=False, piecewise="runtime")
    summary = runner.capture()
    assert summary["backend"] == "cuda" and summary["piecewise"]["mechanism"] == "runtime"
    assert summary["piecewise"]["pieces"] == CFG.layers + 1
    check_mixed(graphs, eager, runner)


def test_a_model_fx_cannot_trace_gets_piecewise_cuda_graphs_through_auto():
    kw = dict(cfg=CFG, device="cuda", dtype=torch.bfloat16)
    graphs, eager = py_llama(marked_attention, **kw), py_llama(**kw)
    runner = GraphRunner(graphs, compile_plan(plan("PIECEWISE", [8, 16, 32, 64, 128, 256])),
                         static_inputs(graphs), progress=False)
    assert runner.capture()["piecewise"]["mechanism"] == "runtime"
    check_mixed(graphs, eager, runner)


def test_a_host_sync_in_a_cuda_segment_is_a_split_error_and_cuda_stays_usable():
    bad = Branchy(CFG, seed=0, device="cuda", dtype=torch.bfloat16)
    runner = GraphRunner(bad, compile_plan(plan("PIECEWISE", [16, 64])), static_inputs(bad),
                         progress=False, piecewise="runtime")
    with pytest.raises(SplitError, match=r"cannot capture Branchy piecewise at 64 tokens: the "
                                         r"graph segment before the first splitting op at .*"
                                         r"test_piecewise.py:\d+.*Fix:"):
        runner.capture()
    assert runner.captured_graph_ids() == [] and not runner.captured
    assert not torch.cuda.is_current_stream_capturing()
    out = runner.step(make_batch(bad, STEPS[0][:1]), num_reqs=1, max_query_len=40)  # eager
    assert out.shape[0] == 40  # 40 tokens pad to the 64-token graph, which was released
    assert runner.stats()["eager_steps"] == {"piecewise_not_captured": 1}
    good = PyLlama(CFG, seed=0, device="cuda", dtype=torch.bfloat16)  # a later capture works
    runner = GraphRunner(good, compile_plan(plan("PIECEWISE", [16, 32])), static_inputs(good),
                         progress=False, piecewise="runtime")
    runner.capture()
    assert len(runner.captured_graph_ids()) == 2
