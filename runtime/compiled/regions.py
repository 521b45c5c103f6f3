"""Regional compilation for the compiled path: a model's repeated layers compiled once, that code
run for every layer. Compile time then stops growing with depth: dynamo still traces the whole
forward (one graph, one set of guards), but AOT autograd and inductor, most of a compile's time,
see a head, one attention half, one MLP half and a tail instead of every layer (on the H100, an
8-layer model's cold warm-up went from 12.4 s to 7.6 s; bench/results/compiled_bench.md).

Where the cuts go, in the graph dynamo traced (``split``):
- each node belongs to the layer its ``nn_module_stack`` names (the outermost module whose path
  ends in an index, ``model.layers.3``) and to that layer's child module (``self_attn``, ``mlp``;
  none for the layer's own code, such as its residual adds); the layers are one ``ModuleList``'s
  items, called in order;
- a cut goes right after the last matmul (``linear``, ``matmul``...) of each child module of each
  layer: after ``o_proj`` and after ``down_proj`` in a Llama layer. A GEMM writes its output to
  memory whatever follows it, so nothing that fuses is cut apart: the residual add after the cut
  opens the next region and fuses with the RMSNorm there, as in a whole-graph compile. Cut at the
  layer's own boundaries instead (per-layer ``torch.compile``, ``nested_compile_region``) and each
  layer pays an extra add kernel. Cut once per layer (after ``down_proj``) and the residual
  leaving each region is a GEMM's output plus a residual: inductor then makes it an ``addmm``
  (the graph's output is not a pointwise use, so it keeps the add in the GEMM), which costs a copy
  kernel per layer (H100: 213 kernels a step instead of 204). Cut twice, every residual add reads
  two region inputs and the kernels are the whole graph's (205: the rotary-table gather, fused
  into each rotary kernel in a whole graph, runs once in the head);
- the head (up to layer 0's first cut: embeddings, rotary tables, layer 0's attention) and the
  tail (after the last cut: the last residual add, final norm, LM head, the copy into the caller's
  outputs) are regions of their own;
- views of graph inputs (``kv_cache[i]``: a layer's slice of a cache) and size arithmetic are
  taken outside the regions, by the graph that calls them, so layer i's region receives its slice
  as an input instead of holding the constant i (which would make every layer's code different).
  Only views taken straight from an input: a view of such a view stays inside, so that a region
  rarely receives two inputs that overlap (see below).

Then ``compile_regions`` compiles each region with the backend, over fake inputs (dynamo's own
fake values of the nodes that feed it), except a region identical to one compiled already: the
same nodes in the same order (targets, constants, which input feeds which argument), the same
outputs, over inputs of the same dtypes, devices, shapes (symbols included), strides, alignment
and sharing of memory. Where two inputs share memory their offsets count too: AOT autograd
compiles overlapping inputs as views of one base at the offsets it saw, so code compiled for one
layer's cache slices would write another layer's. What runs is an FX graph that takes the views,
calls the regions in order and passes each one's outputs on: 2 L + 1 calls of 4 compiled codes.
"""

from __future__ import annotations

import operator
import re
from typing import NamedTuple

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Regions", "compile_regions", "split"]

_MATMULS = {
    torch._C._nn.linear,
    torch.nn.functional.linear,
    torch.matmul,
    operator.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
}
_MATMUL_METHODS = {"matmul", "mm", "bmm", "__matmul__"}
_INDEXED = re.compile(r"^(.*)\.(\d+)$")
_OUTSIDE = ("placeholder", "get_attr", "output")
_VIEWS = {
    operator.getitem,
    torch.select,
    torch.narrow,
    torch.squeeze,
    torch.unsqueeze,
    torch.transpose,
    torch.permute,
    torch.t,
}
_VIEW_METHODS = {
    "__getitem__",
    "select",
    "narrow",
    "view",
    "unsqueeze",
    "squeeze",
    "transpose",
    "permute",
    "t",
    "expand",
}
_SIZES = {"size", "stride", "dim", "numel", "storage_offset"}


def _value(node):
    return node.meta.get("example_value", node.meta.get("val"))


def _memory(t: torch.Tensor) -> StorageWeakRef:
    """Equal for tensors that share memory (fake tensors included)."""
    return StorageWeakRef(t.untyped_storage())


def _layer(node) -> tuple[str, int, str | None] | None:
    """(the module list's path, the index, the layer's child module) of the outermost indexed
    module ``node`` came from; the child is None for the layer's own code (a residual add)."""
    paths = [
        str(e[0] if isinstance(e, tuple) else e)
        for e in (node.meta.get("nn_module_stack") or {}).values()
    ]
    for i, path in enumerate(paths):
        m = _INDEXED.match(path)
        if m:
            inner = paths[i + 1] if i + 1 < len(paths) else None
            return m.group(1), int(m.group(2)), inner[len(path) :] if inner else None
    return None


def _is_matmul(node) -> bool:
    return (node.op == "call_function" and node.target in _MATMULS) or (
        node.op == "call_method" and node.target in _MATMUL_METHODS
    )


def _outside(node, outside: set) -> bool:
    """Whether ``node`` runs in the calling graph: a view of a graph input (one level: a view of
    such a view stays in its region, so a region rarely gets two inputs that share memory), or
    a number computed from graph inputs' sizes."""
    if node.op in _OUTSIDE:
        return True
    if not all(n in outside for n in node.all_input_nodes):
        return False
    v = _value(node)
    if isinstance(v, torch.Tensor):
        view = node.target in (_VIEWS if node.op == "call_function" else _VIEW_METHODS)
        source = _value(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
        return (
            node.op in ("call_function", "call_method")
            and view
            and all(n.op in ("placeholder", "get_attr") for n in node.all_input_nodes)
            and isinstance(source, torch.Tensor)
            and _memory(v) == _memory(source)
        )
    if not isinstance(v, (torch.SymInt, int, torch.SymFloat, float, torch.SymBool, bool)):
        return False
    if node.op == "call_method":
        return node.target in _SIZES
    return node.op == "call_function" and getattr(node.target, "__module__", None) == "_operator"


def split(gm: fx.GraphModule, min_layers: int = 3) -> tuple[set, list[list]] | None:
    """(the nodes the calling graph runs, the regions' nodes in order), or None when the graph
    has fewer than ``min_layers`` repeated layers (nothing to reuse) or they are not called in
    order. See the module docstring for where the cuts go."""
    outside: set = set()
    body = []
    for node in gm.graph.nodes:
        if _outside(node, outside):
            outside.add(node)
        else:
            body.append(node)
    owners = [_layer(n) for n in body]
    lists: dict[str, int] = {}
    for o in owners:
        if o is not None:
            lists[o[0]] = lists.get(o[0], 0) + 1
    if not lists:
        return None
    name = max(lists, key=lists.__getitem__)
    index = [o[1] if o is not None and o[0] == name else None for o in owners]
    order = [i for i in index if i is not None]
    if order != sorted(order):
        return None  # layers interleaved (or called out of order): no contiguous regions
    layers = list(dict.fromkeys(order))
    if len(layers) < min_layers:
        return None
    last_matmul: dict = {}  # (layer, child module) -> position of its last matmul
    for pos, (node, o) in enumerate(zip(body, owners)):
        if o is not None and o[0] == name and _is_matmul(node):  # a node of the layer list
            last_matmul[(o[1], o[2])] = pos
    cuts = sorted({pos + 1 for pos in last_matmul.values()})
    bounds = [0, *cuts, len(body)]
    regions = [body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    return outside, regions


def _meta(values: list) -> tuple:
    """What compiled code is specialised to, of its inputs: each tensor's dtype, device, shape
    (symbols included), strides and alignment, and which inputs share memory; where two do, their
    offsets too (AOT autograd rebuilds such inputs as views of one base at the offsets it saw)."""
    storages: dict = {}  # storage -> the inputs (indices) in it
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            storages.setdefault(_memory(v), []).append(i)
    out: list[tuple] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            shared = storages[_memory(v)]
            offset = v.storage_offset() * v.element_size()
            out.append(
                (
                    "tensor",
                    v.dtype,
                    str(v.device),
                    tuple(str(d) for d in v.shape),
                    tuple(str(s) for s in v.stride()),
                    offset % 16 == 0,
                    v.requires_grad,
                    (shared[0], str(v.storage_offset())) if len(shared) > 1 else None,
                )
            )
        elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            out.append(("sym", type(v).__name__, str(v)))
        else:
            out.append(("const", type(v).__name__, repr(v)))
    return tuple(out)


def _key(nodes: list, inputs: list, outputs: list) -> tuple:
    """Equal for regions that one compiled code can run: same ops in the same order over inputs
    the code is equally specialised to."""
    pos = {n: ("node", i) for i, n in enumerate(nodes)}
    pos.update({n: ("input", i) for i, n in enumerate(inputs)})

    def norm(a):
        return fx.node.map_aggregate(
            a, lambda x: pos[x] if isinstance(x, fx.Node) else (type(x).__name__, repr(x))
        )

    ops = tuple(
        (
            n.op,
            n.target if callable(n.target) else str(n.target),
            repr(norm(n.args)),
            repr(norm(n.kwargs)),
        )
        for n in nodes
    )
    return ops, _meta([_value(n) for n in inputs]), tuple(pos[o] for o in outputs)


class _Region(torch.nn.Module):
    """A compiled region, called by the outer graph with its inputs; returns its outputs."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):  # dynamo's convention for a backend's result: positional inputs
        return self.fn(*args)


class Regions(NamedTuple):
    """The result of ``compile_regions``: ``module`` runs the graph; ``regions`` counts the
    regions, ``compiled`` how many were compiled (the others reuse one of those)."""

    module: fx.GraphModule
    regions: int
    compiled: int


def _extract(gm, nodes: list) -> tuple[fx.GraphModule, list, list]:
    """One region as its own graph: (graph module, the outer nodes it reads, the nodes it gives
    back, both in order of first use)."""
    members = set(nodes)
    inputs: list = []
    seen: set = set()
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a not in seen:
                seen.add(a)
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    graph = fx.Graph()
    env: dict = {}
    for i, a in enumerate(inputs):
        env[a] = graph.placeholder(f"input_{i}")
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph), inputs, outputs


def compile_regions(gm: fx.GraphModule, compile, min_layers: int = 3) -> Regions | None:
    """``gm`` (a graph dynamo traced; left as it is) compiled region by region with
    ``compile(graph module, example inputs)``, identical regions once; None when ``split`` finds
    no repeated layers."""
    found = split(gm, min_layers)
    if found is None:
        return None
    outside, regions = found
    done: dict = {}
    attrs = {n.target: operator.attrgetter(n.target)(gm) for n in outside if n.op == "get_attr"}
    calls = {}  # a region's last node -> (its module name, inputs, outputs)
    for r, nodes in enumerate(regions):
        sub, inputs, outputs = _extract(gm, nodes)
        key = _key(nodes, inputs, outputs)
        if key not in done:
            done[key] = _Region(compile(sub, [_value(a) for a in inputs]))
        attrs[f"_graphplan_region_{r}"] = done[key]
        calls[nodes[-1]] = (f"_graphplan_region_{r}", inputs, outputs)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node in outside:
            env[node] = graph.node_copy(node, env.__getitem__)
        elif node in calls:
            name, inputs, outputs = calls[node]
            call = graph.call_module(name, tuple(env[a] for a in inputs))
            for j, o in enumerate(outputs):
                env[o] = graph.call_function(operator.getitem, (call, j))
    return Regions(fx.GraphModule(attrs, graph), len(regions), len(done))
