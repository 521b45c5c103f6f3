"""Split a model into graphable pieces at the plan's splitting ops, with torch.fx.

A PIECEWISE graph is the forward cut at each splitting op (attention, by default): the pieces
between the cuts are captured per padded token count, the splitting ops run eagerly between them
(``runtime/piecewise_graphs.py``). This module only splits; it never captures.

What a model must satisfy (``SplitError`` names what is wrong, and where):
- **fx-traceable**: ``torch.fx.symbolic_trace(model)`` succeeds, so no Python control flow on tensor
  values (``if x.sum() > 0``), no data-dependent shapes, no ``.item()``/``.tolist()`` in forward.
- **splitting ops are leaf calls** in the traced graph: a torch custom op (``torch.library.custom_op``,
  e.g. ``tiny_llama::attention``) or a function registered with ``torch.fx.wrap``. An op called
  inside a leaf module (``nn.Linear``, ``nn.MultiheadAttention``) is invisible to the tracer.
- **tensors that cross a split** have a leading token dimension (``[num_tokens, ...]``) or are
  static (views of the model's parameters and buffers, such as weights and KV caches); Python values
  that cross (``x.shape[0]``) depend only on the token count. Checked at capture.
- every output of the model has a leading token dimension (as for FULL graphs).

Which fx nodes a plan name (``cudagraph.splitting_ops``, e.g. ``attention``) selects:
1. an explicit binding ``GraphRunner(..., splitting_ops={"attention": ATTENTION_OP})`` wins: a
   ``call_function`` node whose target is that object, or the same torch op under any overload;
2. otherwise the name rule: a ``call_function`` node whose target is a torch op whose qualified name
   ``ns::op`` equals the name or whose ``op`` part does (``tiny_llama::attention`` for
   ``attention``), or a plain function whose ``__name__`` equals it.
Every declared name must match at least one node: a plan that splits at an op the model does not
call is a mismatch, not something to skip silently.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from graphplan.runtime.breakable import SplitError, qualified_op_name

_NOT_SPLIT = ("placeholder", "get_attr", "output")
_FALLBACK = ("or capture FULL graphs only (runner.capture(modes=('FULL',))), or use a plan without "
             "piecewise graphs (cudagraph.mode FULL or FULL_DECODE_ONLY, or splitting_ops: [])")


@dataclass(frozen=True, kw_only=True, slots=True)
class Part:
    """One submodule of a split model, in forward order."""

    name: str
    """Attribute of ``SplitModel.module`` (``submod_<k>``)."""
    op: str | None
    """Plan name of the splitting op this part runs (``attention``); None for a graphable piece."""
    node: str
    """fx node of the splitting op (``attention_default_3``), or the piece's first node."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitModel:
    """A model cut at its splitting ops. ``module(**inputs)`` runs it eagerly, part by part."""

    module: torch.fx.GraphModule
    """Top level: calls the parts in order; the same signature and outputs as the model."""
    parts: tuple[Part, ...]

    @property
    def pieces(self) -> tuple[Part, ...]:
        return tuple(p for p in self.parts if p.op is None)

    @property
    def split_ops(self) -> tuple[Part, ...]:
        return tuple(p for p in self.parts if p.op is not None)

    def submodule(self, part: Part) -> torch.fx.GraphModule:
        return getattr(self.module, part.name)


def _matcher(name: str, bound) -> Callable[[object], bool]:
    if bound is not None:
        q = qualified_op_name(bound)
        return lambda t: t is bound or (q is not None and qualified_op_name(t) == q)

    def by_name(t) -> bool:
        q = qualified_op_name(t)
        if q is not None:
            return name == q or name == q.split("::")[-1]
        return getattr(t, "__name__", None) == name
    return by_name


_BUILTIN = ("torch", "_operator", "operator", "builtins", "math")


def _leaf_calls(gm: torch.fx.GraphModule) -> list[str]:
    """Custom ops and user functions the graph calls (for error messages): not aten, torch or
    operator builtins."""
    seen = set()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            q = qualified_op_name(n.target)
            if q is None and not (getattr(n.target, "__module__", None) or "builtins").startswith(
                    _BUILTIN):
                seen.add(getattr(n.target, "__name__", repr(n.target)))
            elif q is not None and not q.startswith(("aten::", "prim::")):
                seen.add(q)
    return sorted(seen)


def _what(model) -> str:
    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    return getattr(model, "__qualname__", type(model).__name__)


def trace(model) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace`` with an error that says what a piecewise model must satisfy."""
    what = _what(model)
    try:
        return torch.fx.symbolic_trace(model)
    except Exception as e:  # the tracer raises many kinds (TraceError, TypeError, RuntimeError)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise SplitError(f"cannot split {what} into piecewise graphs: torch.fx.symbolic_trace "
                         f"failed: {type(e).__name__}: {first}. A piecewise model must be "
                         "fx-traceable: no Python control flow on tensor values, no data-dependent "
                         "shapes, splitting ops as custom ops or torch.fx.wrap'ed functions. Fix "
                         f"the forward, {_FALLBACK}") from e


def split_model(model, names: Sequence[str],
                bindings: Mapping[str, object] | None = None) -> SplitModel:
    """Trace ``model`` and cut it at every call of the ops ``names`` (the plan's splitting_ops);
    ``bindings`` maps a name to its op explicitly (see the module docstring)."""
    names, bindings = list(names), dict(bindings or {})
    if not names:
        raise SplitError("the plan declares no splitting ops (cudagraph.splitting_ops is empty), "
                         "so there is nothing to split at: declare e.g. [attention]")
    unknown = sorted(set(bindings) - set(names))
    if unknown:
        raise SplitError(f"splitting_ops binds {unknown}, which the plan's cudagraph.splitting_ops "
                         f"{names} does not declare: add them to the plan or drop the binding")
    gm = trace(model)
    matchers = [(name, _matcher(name, bindings.get(name))) for name in names]
    part_of: dict[torch.fx.Node, int] = {}
    op_of: dict[int, tuple[str, str]] = {}  # odd partition id -> (plan name, node name)
    found = dict.fromkeys(names, 0)
    pid = 0
    for node in gm.graph.nodes:
        if node.op in _NOT_SPLIT:
            continue
        name = next((nm for nm, hit in matchers if hit(node.target)),
                    None) if node.op == "call_function" else None
        if name is None:
            part_of[node] = pid
            continue
        found[name] += 1
        part_of[node] = pid + 1  # the op alone in its partition, pieces before and after it
        op_of[pid + 1] = (name, node.name)
        pid += 2
    missing = [nm for nm, k in found.items() if k == 0]
    if missing:
        nm = missing[0]
        raise SplitError(f"cannot split {_what(model)}: splitting op {nm!r} (plan "
                         f"cudagraph.splitting_ops) matches no call in its traced forward; leaf "
                         f"calls seen: {_leaf_calls(gm) or 'none'}. Fix: make it a torch custom op "
                         f"named '<namespace>::{nm}' (torch.library.custom_op) or a torch.fx.wrap'ed "
                         f"function named {nm!r}, or bind it: GraphRunner(..., splitting_ops="
                         f"{{{nm!r}: <the op>}}), {_FALLBACK}")
    try:
        top = split_module(gm, gm, lambda n: part_of[n], keep_original_order=True)
    except Exception as e:
        raise SplitError(f"torch.fx split_module failed on {_what(model)}: {type(e).__name__}: "
                         f"{e}") from e
    first_node: dict[int, str] = {}
    for node, i in part_of.items():
        first_node.setdefault(i, node.name)
    parts = []
    for node in top.graph.nodes:
        if node.op == "call_module":
            i = int(node.target.rsplit("_", 1)[1])  # split_module names partitions submod_<id>
            op, at = op_of.get(i, (None, first_node[i]))
            parts.append(Part(name=node.target, op=op, node=at))
    return SplitModel(module=top, parts=tuple(parts))


def get_attr(module: torch.nn.Module, target: str):
    """The object a ``get_attr`` / ``call_module`` node's dotted target names."""
    return functools.reduce(getattr, target.split("."), module)
