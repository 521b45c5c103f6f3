"""The run-time split (runtime/piecewise/breakable.py, runtime/piecewise/graphs.py) on the CPU stand-in: each
splitting op call ends a graph segment, runs eagerly and begins the next, for any model; outputs
equal eager over mixed batches; failures name the op, where and the fix.

The stand-in records each segment as a tape of aten calls on the tensors the capture made and redoes
it at replay, so a tensor crossing a split at a non-static address gives wrong logits here, as it
would with CUDA graphs; a host sync or a data-dependent shape inside a segment is refused, as CUDA
refuses it while capturing.
"""

import sys

import pytest
import torch
from test_piecewise import CFG, mixed_steps, plan, runner_for
from torch import nn

from graphplan.compiler import compile_plan
from graphplan.models.tiny_llama import (
    ATTENTION_OP,
    Attention,
    TinyLlama,
    apply_rope,
    logits_mismatch,
    make_batch,
    static_inputs,
)
from graphplan.models.tiny_llama_layers import _attention  # the op's body, as a plain function
from graphplan.runtime import CaptureError, GraphRunner, SplitError
from graphplan.runtime.piecewise.breakable import current_step, split_point

SMALL = (4, 16, 32)


def py_attention(q, k, v, kv_cache, slot_mapping, positions):
    """The tiny Llama's attention as a plain function, batch first as transformers has it:
    q [1, T, H, D]."""
    return _attention(q[0], k[0], v[0], kv_cache, slot_mapping, positions)[None]


marked_attention = split_point("attention", py_attention)


class Core(nn.Module):
    def forward(self, *args):
        return py_attention(*args)


class PyAttention(Attention):
    """Calls ``self.core`` when a layer has one, else ``py_attention`` by its global name."""

    def forward(self, x, cos, sin, kv_cache, slot_mapping, positions):
        half = self.head_dim // 2
        q = apply_rope(self.q_proj(x).view(-1, self.heads, self.head_dim), cos, sin, half)
        k = apply_rope(self.k_proj(x).view(-1, self.kv_heads, self.head_dim), cos, sin, half)
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        core = getattr(self, "core", None)
        args = (q[None], k[None], v[None], kv_cache, slot_mapping, positions)
        out = py_attention(*args) if core is None else core(*args)
        return self.o_proj(out[0].reshape(-1, self.heads * self.head_dim))


class PyLlama(TinyLlama):
    """Control flow on a shape, attention not a custom op."""

    def forward(self, input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        if input_ids.shape[0] == 0:
            raise ValueError("empty batch")
        return super().forward(input_ids, positions, slot_mapping, seq_lens, query_start_loc)


def py_llama(core=None, cls=PyLlama, cfg=CFG, **kw):
    model = cls(cfg, seed=0, **kw)
    for layer in model.layers:
        layer.attn.__class__ = PyAttention
        if core is not None:
            layer.attn.core = core() if isinstance(core, type) else core
    return model


def check_steps(model, runner, steps, eager=None):
    eager = eager or TinyLlama(CFG, seed=0)
    for reqs in steps:
        batch = make_batch(model, reqs)
        mql = max(len(t) for _, _, t in reqs)
        out = runner.step(batch, num_reqs=len(reqs), max_query_len=mql)
        ref = eager(**{k: v.clone() for k, v in batch.items()})
        assert logits_mismatch(out, ref, torch.float32) is None


@pytest.mark.parametrize(
    "core, binding",
    [
        (marked_attention, None),  # a split_point function (the adapter's one line)
        (Core, Core),  # every instance of an nn.Module class
        (None, py_attention),  # a module-level function, called by its global name
    ],
    ids=["split_point", "module_class", "global_function"],
)
def test_the_split_reaches_a_python_attention_of_a_model_with_control_flow(core, binding):
    model = py_llama(core)
    bindings = None if binding is None else {"attention": binding}
    _, runner = runner_for(plan(sizes=SMALL), model, splitting_ops=bindings)
    assert runner.capture()["piecewise"]["mechanism"] == "runtime"
    check_steps(model, runner, mixed_steps()[:3])
    assert runner.stats()["replays_by_mode"] == {"PIECEWISE": 3}
    assert sys.modules[__name__].py_attention is py_attention  # the binding was put back
    assert all("forward" not in vars(m) for m in model.modules())


def test_the_name_rule_finds_a_module_level_function_of_that_name():
    model = py_llama()  # PyAttention calls py_attention by its global name
    _, runner = runner_for(plan(sizes=SMALL, splitting_ops=("py_attention",)), model)
    summary = runner.capture()["piecewise"]
    assert (summary["mechanism"], summary["split_ops"]) == ("runtime", CFG.layers)
    check_steps(model, runner, mixed_steps()[:2])
    assert sys.modules[__name__].py_attention is py_attention


class WeightAcrossSplits(TinyLlama):
    """Computes a weight-shaped tensor before the first attention and uses it after the last."""

    def forward(self, input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        scale = self.norm.weight * 2.0  # [hidden]: not a view of a buffer, no token dimension
        logits = super().forward(input_ids, positions, slot_mapping, seq_lens, query_start_loc)
        return logits * scale.mean()


def test_a_value_without_a_token_dimension_may_cross_the_splits():
    model = WeightAcrossSplits(CFG, seed=0)  # a [hidden] value made before attention, used after
    _, runner = runner_for(plan(sizes=SMALL), model)
    runner.capture()
    eager = WeightAcrossSplits(CFG, seed=0)
    for reqs in mixed_steps()[:2]:
        batch = make_batch(model, reqs)
        out = runner.step(batch, num_reqs=len(reqs), max_query_len=max(len(t) for *_, t in reqs))
        assert (
            logits_mismatch(out, eager(**{k: v.clone() for k, v in batch.items()}), torch.float32)
            is None
        )


@pytest.mark.parametrize(
    "name, bindings",
    [
        ("attn_core", {"attn_core": ATTENTION_OP}),  # bound explicitly, under any plan name
        ("tiny_llama::attention", None),  # the op's qualified name
    ],
    ids=["binding", "qualified_name"],
)
def test_an_explicit_binding_or_the_qualified_name_selects_the_op(name, bindings):
    model, runner = runner_for(plan(sizes=SMALL, splitting_ops=(name,)), splitting_ops=bindings)
    assert runner.capture()["piecewise"]["split_ops"] == CFG.layers
    check_steps(model, runner, mixed_steps()[:2])


def test_a_binding_of_a_name_the_plan_does_not_declare_is_a_split_error():
    _, runner = runner_for(plan(sizes=SMALL), splitting_ops={"other": ATTENTION_OP})
    with pytest.raises(
        SplitError,
        match=r"binds \['other'\], which the plan's "
        r"cudagraph.splitting_ops \['attention'\] does not declare",
    ):
        runner.capture()
    assert runner.captured_graph_ids() == []


def test_a_module_instance_binding_splits_only_at_that_module():
    model = py_llama(Core)
    first = model.layers[0].attn.core
    _, runner = runner_for(plan(sizes=SMALL), model, splitting_ops={"attention": first})
    assert runner.capture()["piecewise"]["split_ops"] == 1  # one split: pieces around layer 0
    check_steps(model, runner, mixed_steps()[:2])


class WritesInto(TinyLlama):
    """Attention writes its result into a tensor the model allocated in the segment (out= style)."""

    def forward(self, input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        for layer in self.layers:
            layer.attn.__class__ = OutAttention
        return super().forward(input_ids, positions, slot_mapping, seq_lens, query_start_loc)


@split_point("attention")
def attention_into(q, k, v, kv_cache, slot_mapping, positions, out):
    out.copy_(_attention(q, k, v, kv_cache, slot_mapping, positions))


class OutAttention(Attention):
    def forward(self, x, cos, sin, kv_cache, slot_mapping, positions):
        half = self.head_dim // 2
        q = apply_rope(self.q_proj(x).view(-1, self.heads, self.head_dim), cos, sin, half)
        k = apply_rope(self.k_proj(x).view(-1, self.kv_heads, self.head_dim), cos, sin, half)
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        out = torch.empty_like(q)
        attention_into(q, k, v, kv_cache, slot_mapping, positions, out)
        return self.o_proj(out.view(-1, self.heads * self.head_dim))


def test_an_argument_the_op_writes_into_stays_the_tensor_the_model_reads():
    model = WritesInto(CFG, seed=0)
    _, runner = runner_for(plan(sizes=SMALL), model)
    runner.capture()
    check_steps(model, runner, mixed_steps()[:3])


def test_current_step_gives_the_op_the_real_token_and_request_counts():
    seen = []

    @split_point("attention")
    def spy(*args):
        seen.append(current_step())
        return py_attention(*args)

    model = py_llama(spy)
    _, runner = runner_for(plan(sizes=SMALL), model)
    runner.capture()
    seen.clear()
    reqs = mixed_steps()[0]  # 7 tokens of 2 requests -> the 16-token graph
    runner.step(make_batch(model, reqs), num_reqs=2, max_query_len=5)
    assert {(s.num_tokens, s.padded_tokens, s.num_reqs) for s in seen} == {(7, 16, 2)}
    assert len(seen) == CFG.layers and current_step() is None


def test_a_split_point_outside_a_capture_just_runs_the_function():
    q = torch.randn(1, 3, CFG.heads, CFG.head_dim)
    k, v = (torch.randn(1, 3, CFG.kv_heads, CFG.head_dim) for _ in range(2))
    cache = torch.zeros(2, 2, CFG.max_model_len, CFG.kv_heads, CFG.head_dim)
    slots = torch.tensor([0, 1, 2])
    torch.testing.assert_close(
        marked_attention(q, k, v, cache.clone(), slots, slots),
        py_attention(q, k, v, cache.clone(), slots, slots),
    )


# ---- failures: explicit, everything released, the runner still usable ----


class Branchy(TinyLlama):
    """Python control flow on a tensor value: a host sync inside a graph segment."""

    def forward(self, input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        if input_ids.sum() > 0:
            input_ids = input_ids + 0
        return super().forward(input_ids, positions, slot_mapping, seq_lens, query_start_loc)


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(CFG.vocab_size, 8)

    def forward(self, input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        return self.embed(input_ids)


class SyncsAfterAttention(TinyLlama):
    """A data-dependent shape between the first and second attention."""

    def forward(self, input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        layers = self.layers
        x = self.embed(input_ids)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, self.kv_cache[i], slot_mapping, positions)
            if i == 0:
                x = x + torch.nonzero(positions >= 0).shape[0] * 0
        return self.lm_head(self.norm(x)).float()


class FlipFlop(TinyLlama):
    """Runs one layer fewer every other forward: control flow the token count does not fix."""

    calls = 0

    def forward(self, input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        FlipFlop.calls += 1
        x = self.embed(input_ids)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers[: len(self.layers) - FlipFlop.calls % 2]):
            x = layer(x, cos, sin, self.kv_cache[i], slot_mapping, positions)
        return self.lm_head(self.norm(x)).float()


@split_point("attention")
def returns_a_number(*args):
    return 1.0 if current_step() is not None else py_attention(*args)  # a number while capturing


@pytest.mark.parametrize(
    "model, match",
    [
        (
            NoAttention(),
            r"cannot split NoAttention at run time: splitting op 'attention' \(plan "
            r"cudagraph.splitting_ops\) was never called in a forward at 32 tokens. Fix: "
            r"make it a torch custom op.*split_point\('attention'\).*splitting_ops=",
        ),
        (
            Branchy(CFG),
            r"cannot capture Branchy piecewise at 32 tokens: the graph segment before the "
            r"first splitting op at .*test_breakable.py:\d+ \(if input_ids.sum\(\) > 0:\) "
            r"calls aten._local_scalar_dense.default, which syncs the host.*Fix: compute it "
            r"before the step",
        ),
        (
            SyncsAfterAttention(CFG),
            r"segment after splitting op 'attention' \(call 1\) at .*"
            r"torch.nonzero.*calls aten.nonzero.default",
        ),
        (
            FlipFlop(CFG),
            r"FlipFlop called its splitting ops differently in two forwards of the same "
            r"batch at 32 tokens \((3 calls vs 2|2 calls vs 3).*depend only on the token "
            r"count",
        ),
        (
            py_llama(returns_a_number),
            r"splitting op 'attention' returned a float: splitting ops must "
            r"return a tensor",
        ),
    ],
    ids=["never_reached", "host_sync", "data_dependent_shape", "control_flow", "not_a_tensor"],
)
def test_a_model_the_runtime_split_cannot_capture_gets_a_split_error_and_stays_usable(model, match):
    runner = GraphRunner(
        model,
        compile_plan(plan("FULL_AND_PIECEWISE")),
        static_inputs(TinyLlama(CFG)),
        device="cpu",
        progress=False,
    )
    with pytest.raises(SplitError, match=match):
        runner.capture()
    assert runner.captured_graph_ids() == [] and not runner.captured
    assert current_step() is None and torch.overrides._get_current_function_mode() is None
    reqs = mixed_steps()[0]
    out = runner.step(make_batch(TinyLlama(CFG), reqs), num_reqs=2, max_query_len=5)  # eager
    assert out.shape[0] == 7
    assert runner.stats()["eager_steps"] == {"piecewise_not_captured": 1}


FAIL = {"tokens": None}


@split_point("attention")
def fails_at(*args):
    if args[0].shape[1] == FAIL["tokens"]:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return py_attention(*args)


def test_a_failed_runtime_split_capture_names_the_graph_releases_and_can_be_retried():
    model = py_llama(fails_at)
    _, runner = runner_for(plan("FULL_AND_PIECEWISE", sizes=SMALL), model)
    FAIL["tokens"] = 16
    try:
        with pytest.raises(
            CaptureError,
            match=r"graph #1 \(16 tokens.*Released every graph.*"
            r"lower cudagraph.capture_sizes",
        ):
            runner.capture()
    finally:
        FAIL["tokens"] = None
    assert runner.captured_graph_ids() == [] and not runner.captured
    runner.capture()
    assert len(runner.captured_graph_ids()) == len(runner.table.graphs)
    check_steps(model, runner, mixed_steps()[:2])


@pytest.mark.parametrize("removed", ["fx", "auto"])
def test_the_removed_fx_split_is_a_value_error_that_says_what_to_do(removed):
    with pytest.raises(
        ValueError,
        match=rf"piecewise='{removed}': the torch.fx split was removed; "
        r"piecewise graphs split at run time.*bench/results/"
        r"piecewise_bench.md.*Drop the argument \(or pass "
        r"piecewise='runtime'\)",
    ):
        runner_for(plan(), piecewise=removed)


def test_the_piecewise_mechanism_is_checked_and_bindings_must_be_ops_functions_or_modules():
    with pytest.raises(
        ValueError, match=r"piecewise='torch.compile': expected one of \('runtime',\)"
    ):
        runner_for(plan(), piecewise="torch.compile")
    _, runner = runner_for(plan(sizes=SMALL), splitting_ops={"attention": 3}, piecewise="runtime")
    with pytest.raises(SplitError, match=r"binds 'attention' to 3: bind a torch op, an nn.Module"):
        runner.capture()
    _, runner = runner_for(plan(sizes=SMALL), splitting_ops={"attention": lambda *a: a})
    with pytest.raises(
        SplitError,
        match=r"not a module-level function of test_breakable.*mark it "
        r"where it is defined or registered with split_point",
    ):
        runner.capture()


def test_a_stand_in_segment_redoes_its_aten_calls_on_the_tensors_it_was_captured_with():
    from graphplan.runtime.graphs import CpuGraphStandIn, HostSyncInCapture

    backend = CpuGraphStandIn("cpu")
    x, acc = torch.randn(4, 3), torch.zeros(4)
    seg = backend.open_segment()
    y = x.t().contiguous() * 2  # a view, then a new tensor
    values, index = y.max(dim=0)  # two outputs
    acc.add_(values + index)  # in place on a static tensor
    graph = seg.close()
    x.copy_(torch.randn(4, 3))
    acc.zero_()
    graph.replay()
    want = (x * 2).max(dim=1)
    torch.testing.assert_close(values, want.values)
    torch.testing.assert_close(acc, want.values + want.indices)
    seg = backend.open_segment()
    with pytest.raises(HostSyncInCapture, match=r"aten._local_scalar_dense"):
        x.sum().item()
    seg.abort()
    assert x.sum().item() == pytest.approx(float(x.sum()))  # the tape is gone
