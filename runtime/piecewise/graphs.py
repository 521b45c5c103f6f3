"""Piecewise graphs by splitting the capture at run time: any model, no tracing.

Capturing one size (``capture(views, tokens)``, sizes largest first):
1. **warm-up**: the model runs eagerly under the intercept (``runtime/piecewise/breakable.py``); each
   splitting op call goes through the substitution below, which allocates the static buffers (at
   the largest piecewise size, outside any graph) and finds the arguments an op writes into;
2. **capture**: a graph segment opens (``backend.open_segment()``) and the model runs. At each call
   of a splitting op the op's token tensors are copied into their static buffers (the segment's last
   work), the segment closes, the op runs eagerly and its outputs are copied into static buffers,
   which the model gets back in their place, and the next segment opens. The model's outputs are
   copied into static output buffers at the end of the last segment.

Replay: segment, op, segment, ..., segment; the ops run eagerly on the static tensors, with the
runner's per-request inputs (``seq_lens``, ``query_start_loc``) re-viewed at the step's real
request count and ``breakable.current_step()`` giving the real counts; token tensors have the
padded count.

Where tensors that cross a split live:
- an op's tensor argument that is static (weights, caches, runner inputs, crossing buffers) is
  passed as is; one with a token dimension is copied into a crossing buffer shared by every size
  (one buffer per argument, at the largest size); any other, and one the op writes into, is
  kept alive as captured (its address is fixed);
- an op's tensor outputs go to crossing buffers too (or to a per-size copy without a token dim);
- values that a later segment reads without passing through an op (the residual stream, RoPE rows
  gathered once) stay where the segment that made them put them: alive in the pool until the
  size's capture ends, so no later segment of that size reuses their memory. Other sizes and FULL
  graphs may reuse it: a step replays one size from start to end.

A segment must not sync the host or make a shape depend on data (``.item()``, ``bool(tensor)``,
``nonzero``): CUDA refuses it while capturing and the CPU stand-in (``runtime/graphs.py``) does too;
either is a ``SplitError`` naming the op, where it sits and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from graphplan.compiler.records import padded_num_reqs

from ..buffers import StaticBuffers, as_tuple, real_rows
from ..graphs import Graph, GraphBackend, Segment
from ..lora_case import lora_case
from .breakable import SEGMENT_FIX, Intercept, SplitError, Step, segment_error, set_step


@dataclass
class _Run:
    """One forward under the intercept (a warm-up, or the capture of one size)."""

    tokens: int
    capture: bool
    views: dict
    graphs: list[Graph] = field(default_factory=list)
    calls: list[_OpCall] = field(default_factory=list)
    signature: list = field(default_factory=list)  # (op, argument shapes) per call
    segment: Segment | None = None
    in_op: bool = False
    result: Any = None


class _OpCall:
    """One recorded splitting-op call: replay runs it on the static tensors and refills the
    buffers its outputs were copied into."""

    __slots__ = ("fn", "name", "leaves", "spec", "inputs", "copies", "args", "kwargs")

    def __init__(self, fn, name: str, leaves: list, spec, inputs: tuple, copies: tuple):
        self.fn, self.name, self.leaves, self.spec = fn, name, leaves, spec
        self.inputs, self.copies = inputs, copies  # (leaf, input name); (output index, buffer)
        self.args, self.kwargs = pytree.tree_unflatten(leaves, spec)

    def run(self, views: dict | None) -> None:
        args, kwargs = self.args, self.kwargs
        if self.inputs:
            assert views is not None  # an op with static inputs is run with the views
            leaves = list(self.leaves)
            assert views is not None  # replay passes views when a call reads per-request inputs
            for j, name in self.inputs:
                leaves[j] = views[name]
            args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.fn(*args, **kwargs)
        if self.copies:
            outs = (out,) if isinstance(out, torch.Tensor) else out
            for j, dst in self.copies:
                dst.copy_(outs[j])


@dataclass(frozen=True)
class _Size:
    graphs: list[Graph]  # segment graphs, one more than calls
    calls: list[_OpCall]
    result: object  # static output views (the model's output structure)
    needs_views: bool  # some call reads per-request inputs at the real request count


class BreakableGraphs:
    """The runner's piecewise state under the run-time split (see the module docstring)."""

    mechanism = "runtime"

    def __init__(
        self,
        model,
        names,
        bindings,
        *,
        backend: GraphBackend,
        buffers: StaticBuffers,
        max_tokens: int,
        max_reqs: int,
        static: list[torch.Tensor],
        warmups: int = 1,
    ):
        self.model, self.backend, self.buffers = model, backend, buffers
        self.names = list(names)
        self.intercept = Intercept(model, self.names, bindings, self._split)
        self.max_tokens, self.max_reqs, self.warmups = max_tokens, max_reqs, max(warmups, 1)
        self.static = {t.untyped_storage().data_ptr() for t in static}
        self.req_inputs = {
            buffers.buffers[s.name].untyped_storage().data_ptr(): s.name
            for s in buffers.specs
            if s.per != "token"
        }
        self.crossing: dict[tuple, torch.Tensor] = {}  # (call, "in"|"out", leaf) -> buffer
        self.token_dim: dict[tuple, int] = {}
        self.written: set[tuple[int, int]] = set()  # (call, leaf): arguments the op writes into
        self.checked: set[tuple[int, int]] = set()
        self.outputs: list[torch.Tensor] = []
        self.sizes: dict[tuple[int, int], _Size] = {}  # (tokens, LoRA case or -1) -> its graphs
        self.run: _Run | None = None
        self.what = (
            type(model).__name__
            if isinstance(model, torch.nn.Module)
            else getattr(model, "__qualname__", type(model).__name__)
        )

    # -- capture ----------------------------------------------------------------------------
    def capture(
        self, views: dict[str, torch.Tensor], tokens: int, lora: int | None = None
    ) -> tuple["BreakableGraph", int]:
        """Warm up and capture the segments at ``tokens`` (under LoRA case ``lora``:
        ``runtime/lora_case.py``; each case of a size gets its own segments). Returns the size's
        handle and the device bytes its graphs took."""
        with lora_case(lora):
            return self._capture(views, tokens, lora)

    def _capture(self, views: dict, tokens: int, lora: int | None) -> tuple["BreakableGraph", int]:
        for _ in range(self.warmups):
            warm = self._forward(views, tokens, capture=False)
        reached = {name for name, _ in warm.signature}
        missing = [n for n in self.names if n not in reached]
        if missing:
            nm = missing[0]
            raise SplitError(
                f"cannot split {self.what} at run time: splitting op {nm!r} (plan cudagraph."
                f"splitting_ops) was never called in a forward at {tokens} tokens. Fix: make it a "
                f"torch custom op named '<namespace>::{nm}' (torch.library.custom_op), mark the "
                f"function with graphplan.runtime.piecewise.breakable.split_point({nm!r}), or bind it: "
                f"GraphRunner(..., splitting_ops={{{nm!r}: <op, function or module>}}); or use a "
                "plan without piecewise graphs (cudagraph.mode FULL or FULL_DECODE_ONLY)"
            )
        before = self.backend.memory_used()
        run = self._forward(views, tokens, capture=True)
        if run.signature != warm.signature:
            raise SplitError(
                f"{self.what} called its splitting ops differently in two forwards "
                f"of the same batch at {tokens} tokens ({len(warm.signature)} calls "
                f"vs {len(run.signature)}, or other shapes): a piecewise model's "
                "control flow must depend only on the token count. Fix: "
                f"{SEGMENT_FIX}"
            )
        took = self.backend.memory_used() - before
        key = (tokens, -1 if lora is None else lora)
        self.sizes[key] = _Size(run.graphs, run.calls, run.result, any(c.inputs for c in run.calls))
        return BreakableGraph(self, key), took

    def _forward(self, views: dict, tokens: int, capture: bool) -> _Run:
        run = self.run = _Run(tokens=tokens, capture=capture, views=views)
        set_step(Step(tokens, tokens, padded_num_reqs(tokens, self.max_reqs)))
        try:
            with self.intercept, torch.no_grad():
                if capture:
                    run.segment = self.backend.open_segment()
                out = self.model(**views)
                run.result = self._bind_outputs(out, tokens)
                if capture:
                    assert run.segment is not None  # the last split op opened it
                    run.graphs.append(run.segment.close())
                    run.segment = None
        except BaseException as e:
            if run.segment is not None:
                run.segment.abort()
            problem = segment_error(e, self.what, tokens, [c.name for c in run.calls], capture)
            if problem is None:
                raise
            raise problem from e
        finally:
            self.run = None
            set_step(None)
        return run

    def _split(self, name: str, fn, args: tuple, kwargs: dict):
        """A splitting op was called under the intercept: end the segment, run it, open the next."""
        run = self.run
        if run is None or run.in_op:  # not ours, or an op called by a splitting op
            return fn(*args, **kwargs)
        i, tokens = len(run.calls), run.tokens
        leaves, spec = pytree.tree_flatten((args, kwargs))
        inputs, copied = [], {}
        for j, v in enumerate(leaves):
            if not isinstance(v, torch.Tensor):
                continue
            ptr = v.untyped_storage().data_ptr()
            nm = self.req_inputs.get(ptr)
            if nm is not None and v.storage_offset() == 0 and v.shape == run.views[nm].shape:
                inputs.append((j, nm))  # re-viewed at the real request count at replay
            elif ptr not in self.static and (i, j) not in self.written:
                dst = self._static_view((i, "in", j), v, tokens)
                if dst is not None:
                    dst.copy_(v)  # inside the segment: the graph refills it at replay
                    copied[j], leaves[j] = v, dst
        if run.capture:
            assert run.segment is not None  # open while capturing, outside splitting ops
            run.graphs.append(run.segment.close())
            run.segment = None
        call_args, call_kwargs = pytree.tree_unflatten(leaves, spec)
        run.in_op = True
        try:
            out = fn(*call_args, **call_kwargs)
        finally:
            run.in_op = False
        for j, v in copied.items():  # an argument the op writes into stays the model's tensor
            if not run.capture and (i, j) not in self.checked:
                self.checked.add((i, j))
                if not torch.equal(leaves[j], v):
                    self.written.add((i, j))
        result, copies = self._bind_op_outputs(i, name, out, tokens)
        run.calls.append(_OpCall(fn, name, leaves, spec, tuple(inputs), copies))
        run.signature.append(
            (name, tuple(tuple(v.shape) for v in leaves if isinstance(v, torch.Tensor)))
        )
        if run.capture:
            run.segment = self.backend.open_segment()
        return result

    def _static_view(self, key: tuple, v: torch.Tensor, tokens: int) -> torch.Tensor | None:
        """``v``'s rows in its crossing buffer (allocated at the largest size on first use), or None
        when ``v`` has no token dimension (then it is kept alive as captured)."""
        buf = self.crossing.get(key)
        if buf is None:
            d = next((d for d in range(v.dim()) if v.shape[d] == tokens), None)
            if d is None:
                return None
            shape = (*v.shape[:d], self.max_tokens, *v.shape[d + 1 :])
            buf = self.crossing[key] = torch.empty(shape, dtype=v.dtype, device=v.device)
            self.token_dim[key] = d
            self.static.add(buf.untyped_storage().data_ptr())
        d = self.token_dim[key]
        if (
            v.dim() != buf.dim()
            or v.dtype != buf.dtype
            or v.shape[d] != tokens
            or any(v.shape[k] != buf.shape[k] for k in range(v.dim()) if k != d)
        ):
            return None
        return buf.narrow(d, 0, tokens)

    def _bind_op_outputs(self, i: int, name: str, out, tokens: int):
        if out is None:  # it wrote its result into an argument
            return None, ()
        single = isinstance(out, torch.Tensor)
        if not single and not isinstance(out, (tuple, list)):
            raise SplitError(
                f"splitting op {name!r} returned a {type(out).__name__}: splitting "
                "ops must return a tensor or a tuple of tensors (or None)"
            )
        result, copies = [], []
        for j, v in enumerate((out,) if single else out):
            if (
                v is None
                or isinstance(v, torch.Tensor)
                and v.untyped_storage().data_ptr() in self.static
            ):
                result.append(v)  # nothing, or a static tensor (e.g. the cache it wrote)
                continue
            if not isinstance(v, torch.Tensor):
                raise SplitError(
                    f"splitting op {name!r} returned a {type(v).__name__} in its "
                    "outputs: splitting ops must return tensors (or None)"
                )
            dst = self._static_view((i, "out", j), v, tokens)
            dst = v.clone() if dst is None else dst.copy_(v)  # no token dim: a copy per size
            copies.append((j, dst))
            result.append(dst)
        return (result[0] if single else type(out)(result)), tuple(copies)

    def _bind_outputs(self, out, tokens: int):
        """The model's outputs copied into static buffers (as the last segment's last work)."""
        outs = as_tuple(out)
        for k, o in enumerate(outs):
            if not isinstance(o, torch.Tensor) or o.dim() == 0 or o.shape[0] != tokens:
                raise SplitError(
                    f"output {k} of {self.what} is not a [num_tokens, ...] tensor at "
                    f"{tokens} tokens: every model output needs a leading token dim"
                )
            if k == len(self.outputs):
                self.outputs.append(
                    torch.empty((self.max_tokens, *o.shape[1:]), dtype=o.dtype, device=o.device)
                )
        views = [buf[:tokens].copy_(o) for buf, o in zip(self.outputs, outs)]
        return tuple(views) if isinstance(out, (tuple, list)) else views[0]

    # -- replay -----------------------------------------------------------------------------
    def replay(self, key: tuple[int, int], inputs: dict[str, torch.Tensor], n: int, reqs: int):
        b, tokens = self.buffers, key[0]
        b.load(inputs, n, reqs, tokens, padded_num_reqs(tokens, self.max_reqs))  # rows stay padded
        size = self.sizes[key]
        views = b.views(tokens, reqs) if size.needs_views else None
        set_step(Step(n, tokens, reqs))
        try:
            with torch.no_grad():
                for graph, call in zip(size.graphs, size.calls):
                    graph.replay()
                    call.run(views)
                size.graphs[-1].replay()
        finally:
            set_step(None)
        return real_rows(size.result, n)

    # -- introspection ----------------------------------------------------------------------
    def num_graphs(self) -> int:
        return sum(len(s.graphs) for s in self.sizes.values())

    def crossing_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.crossing.values(), *self.outputs))

    def summary(self) -> dict:
        largest = self.sizes[max(self.sizes)] if self.sizes else None
        return {
            "mechanism": self.mechanism,
            "pieces": len(largest.graphs) if largest else 0,
            "split_ops": len(largest.calls) if largest else 0,
            "piece_graphs": self.num_graphs(),
            "static_bytes": self.crossing_bytes(),
        }


class BreakableGraph:
    """The segments of one PIECEWISE key (what a runner holds per PIECEWISE graph id)."""

    __slots__ = ("owner", "key")

    def __init__(self, owner: BreakableGraphs, key: tuple[int, int]):
        self.owner, self.key = owner, key  # (tokens, LoRA case or -1)

    @property
    def tokens(self) -> int:
        return self.key[0]

    def run(self, inputs: dict[str, torch.Tensor], n: int, reqs: int):
        """Copy in, replay the segments with the split ops between them, slice to the real rows."""
        return self.owner.replay(self.key, inputs, n, reqs)
