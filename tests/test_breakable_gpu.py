"""The run-time split on CUDA graphs (bf16), beyond tests/test_piecewise_gpu.py (the tiny Llama's
custom-op attention, continuous batching): a model with control flow and a Python attention marked
``split_point`` gets piecewise graphs that match eager on mixed batches (teacher-forced logits
within the bf16 tolerance), and a host sync inside a segment is a SplitError that leaves CUDA and
the runner usable. Skipped cleanly without CUDA."""

import pytest
import torch
from test_breakable import Branchy, PyLlama, marked_attention, py_llama
from test_piecewise_gpu import CFG, STEPS, check_mixed, plan

from graphplan.compiler import compile_plan
from graphplan.models.tiny_llama import make_batch, static_inputs
from graphplan.runtime import GraphRunner, SplitError

pytestmark = pytest.mark.gpu


def test_a_python_attention_marked_split_point_gets_piecewise_cuda_graphs():
    kw = dict(cfg=CFG, device="cuda", dtype=torch.bfloat16)
    graphs, eager = py_llama(marked_attention, **kw), py_llama(**kw)
    runner = GraphRunner(
        graphs,
        compile_plan(plan("PIECEWISE", [8, 16, 32, 64, 128, 256])),
        static_inputs(graphs),
        progress=False,
    )
    assert runner.capture()["piecewise"]["split_ops"] == CFG.layers
    check_mixed(graphs, eager, runner)


def test_a_host_sync_in_a_cuda_segment_is_a_split_error_and_cuda_stays_usable():
    bad = Branchy(CFG, seed=0, device="cuda", dtype=torch.bfloat16)
    runner = GraphRunner(
        bad, compile_plan(plan("PIECEWISE", [16, 64])), static_inputs(bad), progress=False
    )
    with pytest.raises(
        SplitError,
        match=r"cannot capture Branchy piecewise at 64 tokens: the "
        r"graph segment before the first splitting op at .*"
        r"test_breakable.py:\d+.*Fix:",
    ):
        runner.capture()
    assert runner.captured_graph_ids() == [] and not runner.captured
    assert not torch.cuda.is_current_stream_capturing()
    out = runner.step(make_batch(bad, STEPS[0][:1]), num_reqs=1, max_query_len=40)  # eager
    assert out.shape[0] == 40  # 40 tokens pad to the 64-token graph, which was released
    assert runner.stats()["eager_steps"] == {"piecewise_not_captured": 1}
    good = PyLlama(CFG, seed=0, device="cuda", dtype=torch.bfloat16)  # a later capture works
    runner = GraphRunner(
        good, compile_plan(plan("PIECEWISE", [16, 32])), static_inputs(good), progress=False
    )
    runner.capture()
    assert len(runner.captured_graph_ids()) == 2
