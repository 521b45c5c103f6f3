"""Merged projections for the compiled path: linear layers that read the same input (attention's
q/k/v, an MLP's gate/up) become one GEMM over their weights laid out end to end, then a narrow
per layer. vLLM writes this into its model code (QKVParallelLinear, MergedColumnParallelLinear);
graphplan finds it in any model, so stock `transformers` models get it too. At batch 1 a Llama
decoder layer's 7 GEMMs become 4, each about as fast as one of the 7 (a GEMM of one token reads
its weights once: its time goes to the launch, not to arithmetic).

Two steps, both run by ``CompiledModel``:
- ``relay_linears`` (before the compile, around the warm-up's eager run): ``torch.nn.Linear``
  modules called once each, with the same input tensor, of one dtype, device and input width and
  with a bias each or none, have their weights (and biases) *relaid*: copied once into one tensor,
  end to end, and each parameter's ``.data`` becomes its rows of that tensor. Values, shapes and
  the module tree are unchanged, eager code still works, and no memory is added (each old storage
  is freed). Weights already laid out end to end (a second compile) are left as they are.
- ``merge_linears`` (on each graph dynamo hands the backend): two or more ``linear(x, w_i, b_i)``
  calls on one ``x`` node whose weights are graph inputs used by nothing else and lie end to end in
  one storage become one ``linear`` over a module buffer that views them all, and a ``narrow`` per
  call (downstream code sees the same shapes; rows have the merged width as their stride).

A relaid parameter shares its storage with its group: ``safetensors`` refuses to save shared
tensors, so save a model before compiling it, or compile with ``CompiledModel(..., merge=False)``.
"""

from __future__ import annotations

import contextlib
import math

import torch

__all__ = ["merge_linears", "relay_linears"]

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


def _args(node):
    """(input, weight, bias) of a linear call node, or None when it is called otherwise."""
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    a = list(node.args) + [None] * (3 - len(node.args))
    x, w, b = a[0], node.kwargs.get("weight", a[1]), node.kwargs.get("bias", a[2])
    return x, w, b


def end_to_end(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor that holds ``tensors`` end to end along dim 0, when their storage already does
    (a second compile of the same model, or of a model whose projections the fused decoder,
    models/hf/fused_decoder.py, laid out once), else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.storage_offset() != offset
            or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        ):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _relay(tensors: list[torch.Tensor]) -> bool:
    """Lay ``tensors`` out end to end along dim 0 in one new tensor; each tensor's ``.data``
    becomes its rows of it (values unchanged). False when they already were."""
    if end_to_end(tensors) is not None:
        return False
    with torch.no_grad():
        merged = torch.cat([t.detach() for t in tensors], dim=0)
    start = 0
    for t in tensors:
        t.data = merged[start : start + t.shape[0]]
        start += t.shape[0]
    return True


def _kind(weight, bias) -> tuple | None:
    """What linears must share to merge (besides their input); None: never merged."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return weight.dtype, weight.device, weight.shape[1], bias is None


def _mergeable(weights: list, biases: list) -> bool:
    """For linears of one ``_kind``: two or more distinct contiguous floating weights, and
    contiguous 1-D biases of their dtype and device (or none)."""
    w0 = weights[0]
    return (
        len(weights) >= 2
        and len({id(w) for w in weights}) == len(weights)
        and all(w.is_floating_point() and w.is_contiguous() for w in weights)
        and (
            biases[0] is None
            or all(
                isinstance(b, torch.Tensor)
                and b.dim() == 1
                and b.dtype == w0.dtype
                and b.device == w0.device
                and b.is_contiguous()
                for b in biases
            )
        )
    )


def relay_linears(model: torch.nn.Module, run):
    """Call ``run()`` (an eager forward of ``model``) while watching its ``torch.nn.Linear``
    modules; relay the weights of each group that read one input tensor (module docstring).
    Returns (``run()``'s result, groups relaid)."""
    calls: dict[torch.nn.Module, list] = {}
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]

    def hook(module, args):
        calls.setdefault(module, []).append(args[0] if args else None)

    handles = [m.register_forward_pre_hook(hook) for m in linears]
    try:
        out = run()
    finally:
        for h in handles:
            h.remove()
    by_input: dict[tuple, list] = {}
    for module, inputs in calls.items():  # modules in call order (dicts keep insertion order)
        kind = _kind(module.weight, module.bias)
        if len(inputs) == 1 and isinstance(inputs[0], torch.Tensor) and kind is not None:
            by_input.setdefault((id(inputs[0]), kind), []).append(module)
    relaid = 0
    for modules in by_input.values():
        weights = [m.weight for m in modules]
        biases = [m.bias for m in modules]
        if not _mergeable(weights, biases):
            continue
        changed = _relay(weights)
        if biases[0] is not None:
            changed |= _relay(biases)
        relaid += changed
    return out, relaid


def _groups(gm, example: dict) -> list[tuple]:
    """(linear nodes, their output widths, their weights' merged tensor, their biases' or None)
    per mergeable group."""
    by_input: dict = {}
    for node in gm.graph.nodes:
        a = _args(node)
        if a is None:
            continue
        x, w, b = a
        if len(w.users) != 1 or (b is not None and len(b.users) != 1):
            continue
        wt, bt = example.get(w), None if b is None else example.get(b)
        kind = _kind(wt, bt)
        if kind is not None:
            by_input.setdefault((x, kind), []).append((node, wt, bt))
    groups = []
    for calls in by_input.values():
        weights, biases = [c[1] for c in calls], [c[2] for c in calls]
        if not _mergeable(weights, biases):
            continue
        weight = end_to_end(weights)
        bias = None if biases[0] is None else end_to_end(biases)
        if weight is not None and (biases[0] is None or bias is not None):
            groups.append(([c[0] for c in calls], [w.shape[0] for w in weights], weight, bias))
    return groups


def _fake(node):
    return node.meta.get("example_value", node.meta.get("val"))


def _buffer(gm, suffix: str, tensor):
    """A get_attr node of ``tensor``, registered on ``gm`` as a (non-persistent) buffer."""
    name = f"_graphplan_merged_{suffix}"
    gm.register_buffer(name, tensor, persistent=False)
    return gm.graph.get_attr(name)


@contextlib.contextmanager
def _faking(mode):
    """Compute fake values as dynamo traces: under its fake mode and the python dispatcher, so
    composite ops (linear on 3-D inputs, CUDA's matmul) decompose with symbolic sizes instead of
    asking them for a concrete numel."""
    from torch._dispatch.python import enable_python_dispatcher

    with enable_python_dispatcher(), mode:
        yield


_SOURCE_META = ("nn_module_stack", "source_fn_stack", "stack_trace")


def _inherit(node, *new) -> None:
    """Give ``new`` nodes ``node``'s source meta (where it came from in the model)."""
    for k in _SOURCE_META:
        if k in node.meta:
            for n in new:
                n.meta.setdefault(k, node.meta[k])


def merge_linears(gm: torch.fx.GraphModule, example_inputs) -> int:
    """Rewrite ``gm`` (a graph dynamo traced; ``example_inputs`` its inputs in placeholder order)
    in place: each group of linears on one input whose weights lie end to end becomes one linear
    + narrows. Returns how many groups were merged (the module docstring has the rules)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example = dict(zip(placeholders, example_inputs))
    merged = 0
    for nodes, widths, weight, bias in _groups(gm, example):
        x = _args(nodes[0])[0]
        with gm.graph.inserting_before(nodes[0]):
            w_node, b_node = (
                None if t is None else _buffer(gm, f"{merged}_{i}", t)
                for i, t in enumerate((weight, bias))
            )
            fused = gm.graph.call_function(torch._C._nn.linear, (x, w_node, b_node))
            narrows, start = [], 0
            for width in widths:
                narrows.append(gm.graph.call_function(torch.narrow, (fused, -1, start, width)))
                start += width
        _meta(x, (w_node, weight), (b_node, bias), fused, narrows, nodes)
        for node, narrow in zip(nodes, narrows):
            node.replace_all_uses_with(narrow)
            gm.graph.erase_node(node)
        for narrow in narrows:
            _heads_first(gm.graph, fused, narrow)
        merged += 1
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged


_VIEWS = ("view", "reshape")


def _heads_first(graph, fused, narrow) -> None:
    """``narrow(fused, -1, start, n).view(*lead, a1, ..., ak)`` (how attention splits heads) ->
    ``fused.view(*lead, N / p, a2, ..., ak).narrow(len(lead), start / p, a1)``, p = a2 * ... * ak:
    the same values, shape and strides, but no view of a strided tensor, whose stride rule makes
    torch guard ``tokens != 1`` (a second compile for one token)."""
    out = _fake(narrow)
    if out is None:
        return
    lead = list(out.shape[:-1])
    symbolic = [i for i, d in enumerate(lead) if not isinstance(d, int)]
    if len(symbolic) > 1:
        return
    start, width, total = narrow.args[2], narrow.args[3], _fake(fused).shape[-1]
    for user in list(narrow.users):
        viewed = _fake(user)
        if (
            user.op != "call_method"
            or user.target not in _VIEWS
            or user.args[0] is not narrow
            or viewed is None
            or viewed.dim() <= len(lead)
        ):
            continue
        rest = list(viewed.shape[len(lead) :])
        if not all(isinstance(d, int) for d in rest) or math.prod(rest) != width:
            continue
        p = math.prod(rest[1:])
        if start % p or total % p:
            continue
        shape = [-1 if i in symbolic else d for i, d in enumerate(lead)] + [total // p, *rest[1:]]
        with graph.inserting_before(user):
            whole = graph.call_method("view", (fused, *shape))
            part = graph.call_function(torch.narrow, (whole, len(lead), start // p, rest[0]))
        mode = getattr(viewed, "fake_mode", None)
        if mode is not None:
            with _faking(mode):
                whole.meta["example_value"] = _fake(fused).view(*lead, total // p, *rest[1:])
                part.meta["example_value"] = torch.narrow(
                    whole.meta["example_value"], len(lead), start // p, rest[0]
                )
        _inherit(user, whole, part)
        user.replace_all_uses_with(part)
        graph.erase_node(user)
    if not narrow.users:
        graph.erase_node(narrow)


def _meta(x, weight, bias, fused, narrows, nodes) -> None:
    """Fake values for the new nodes, as dynamo's own nodes carry (inductor's pre-grad passes read
    them), and the replaced nodes' source meta."""
    for node, narrow in zip(nodes, narrows):
        _inherit(node, narrow, fused)
    fx = _fake(x)
    mode = getattr(fx, "fake_mode", None)
    if mode is None:
        return
    with _faking(mode):
        for attr, tensor in (weight, bias):
            if tensor is not None:
                attr.meta["example_value"] = mode.from_tensor(tensor, static_shapes=True)
        fb = None if bias[0] is None else _fake(bias[0])
        ff = torch._C._nn.linear(fx, _fake(weight[0]), fb)
        fused.meta["example_value"] = ff
        for narrow in narrows:
            narrow.meta["example_value"] = torch.narrow(ff, -1, narrow.args[2], narrow.args[3])
