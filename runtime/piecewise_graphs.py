"""Piecewise capture and replay: one graph per piece per captured size, split ops eager between.

The split model's top level (``SplitModel.module``) is kept as the step's glue code, with each part
swapped for a call object:
- a **piece** at capture warms up eagerly, then captures a graph whose body runs the piece and copies
  its outputs into static buffers; at replay it replays that graph and hands back views of those
  buffers, without running the piece's Python;
- a **split op** always runs eagerly on those views (so on the padded token count: padding rows carry
  the StaticInput pad values, e.g. token 0, position 0 and the dummy slot), and its outputs are copied
  into static buffers too, which the next piece's graph reads.

Every tensor that crosses a split therefore lives at a fixed address: one buffer per crossing value,
allocated once at the largest piecewise size. Graph-internal activations die with each capture, so
all pieces of all sizes share the runner's one pool, as FULL graphs do. Per-request inputs reach the
split ops at the real request count (``seq_lens[:R]``, ``query_start_loc[:R + 1]``), the metadata a
varlen attention kernel needs; the piece graphs were captured on ``min(size, max_num_seqs)`` rows of
them, which the runner keeps padded.
"""

from __future__ import annotations

import copy

import torch

from graphplan.runtime.buffers import real_rows
from graphplan.runtime.piecewise import Part, SplitError, SplitModel, get_attr


def _output_names(module: torch.fx.GraphModule) -> list[str]:
    out = next(n for n in module.graph.nodes if n.op == "output").args[0]
    return [getattr(a, "name", repr(a)) for a in (out if isinstance(out, (tuple, list)) else (out,))]


class PiecewiseGraphs:
    """The runner's piecewise state: the glue module, the call objects and the crossing buffers."""

    mechanism = "fx"

    def __init__(self, split: SplitModel, *, backend, buffers, max_tokens: int, max_reqs: int,
                 static: list[torch.Tensor], warmups: int = 1):
        self.split, self.backend, self.buffers = split, backend, buffers
        self.max_tokens, self.max_reqs, self.warmups = max_tokens, max_reqs, max(warmups, 1)
        self.tokens = 0  # size being captured or replayed
        self.replaying = False
        self.crossing: dict[tuple[str, int], torch.Tensor] = {}  # (part, output index) -> buffer
        self._static = {t.untyped_storage().data_ptr() for t in static}
        root = {}
        for node in split.module.graph.nodes:
            if node.op == "get_attr":
                root[node.target] = get_attr(split.module, node.target)
        calls = [(_PieceCall if p.op is None else _OpCall)(self, i, p)
                 for i, p in enumerate(split.parts)]
        root.update((c.part.name, c) for c in calls)
        self.calls = calls
        # the glue: the split model's top level, calling the call objects instead of the parts
        self.module = torch.fx.GraphModule(root, copy.deepcopy(split.module.graph))

    def capture(self, views: dict[str, torch.Tensor], tokens: int) -> tuple["PiecewiseGraph", int]:
        """Capture every piece at ``tokens`` (views: the runner's static inputs at that size).
        Returns the size's handle and the device bytes its graphs took."""
        self.tokens, self.replaying = tokens, False
        static, before = self.crossing_bytes(), self.backend.memory_used()
        self.module(**views)
        took = self.backend.memory_used() - before  # the stand-in measures 0
        if took:  # the crossing buffers that this size allocated are not graph memory
            took -= self.crossing_bytes() - static
        return PiecewiseGraph(self, tokens), took

    def replay(self, tokens: int, inputs: dict[str, torch.Tensor], n: int, reqs: int):
        b = self.buffers
        b.load(inputs, n, reqs, tokens, min(tokens, self.max_reqs))  # rows the graphs read stay padded
        self.tokens, self.replaying = tokens, True
        with torch.no_grad():
            out = self.module.forward(**b.views(tokens, reqs))  # .forward: no module hooks to run
        return real_rows(out, n)

    def num_graphs(self) -> int:
        return sum(len(c.graphs) for c in self.calls if isinstance(c, _PieceCall))

    def crossing_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.crossing.values())

    def summary(self) -> dict:
        return {"mechanism": self.mechanism, "pieces": len(self.split.pieces),
                "split_ops": len(self.split.split_ops), "piece_graphs": self.num_graphs(),
                "static_bytes": self.crossing_bytes()}

    def bind(self, call, out) -> tuple[object, tuple[tuple[int, torch.Tensor], ...]]:
        """What a part hands on at this size: its outputs with every token tensor replaced by a view
        of its static buffer (filled now); and the (output index, buffer view) copies to repeat."""
        tokens, part = self.tokens, call.part
        single = not isinstance(out, tuple)  # split_module returns a tuple for several outputs
        result, copies = [], []
        for i, v in enumerate((out,) if single else out):
            if not isinstance(v, torch.Tensor):
                if part.op is not None and v is not None:
                    raise SplitError(f"splitting op {part.op!r} (node {part.node}) returned a "
                                     f"{type(v).__name__}: splitting ops must return tensors")
                result.append(v)  # a piece's shape-derived Python value: fixed per size
                continue
            if v.untyped_storage().data_ptr() in self._static:
                result.append(v)  # a view of a weight, cache or static input: a fixed address
                continue
            if v.dim() == 0 or v.shape[0] != tokens:
                raise SplitError(self._no_token_dim(call, i, v))
            buf = self.crossing.get((part.name, i))
            if buf is None:
                buf = torch.empty((self.max_tokens, *v.shape[1:]), dtype=v.dtype, device=v.device)
                self.crossing[(part.name, i)] = buf
            elif buf.shape[1:] != v.shape[1:] or buf.dtype != v.dtype:
                raise SplitError(f"{self._where(call, i)} and is {v.dtype} {tuple(v.shape)} at "
                                 f"{tokens} tokens but {buf.dtype} {tuple(buf.shape)} at "
                                 f"{self.max_tokens}: only the leading (token) dimension may vary")
            dst = buf[:tokens]
            dst.copy_(v)
            copies.append((i, dst))
            result.append(dst)
        return (result[0] if single else tuple(result)), tuple(copies)

    def _where(self, call, i: int) -> str:
        part = call.part
        name = _output_names(self.split.submodule(part))[i]
        if part.op is not None:
            return f"output {name!r} of splitting op {part.op!r} (node {part.node}) crosses a split"
        nxt = next((p for p in self.split.parts[call.index + 1:] if p.op is not None), None)
        at = f"crosses the split at {nxt.op!r} (node {nxt.node})" if nxt else "is a model output"
        return f"value {name!r} of piece {part.name} (starting at node {part.node}) {at}"

    def _no_token_dim(self, call, i: int, v: torch.Tensor) -> str:
        return (f"{self._where(call, i)} with shape {tuple(v.shape)}: no leading token dimension "
                f"({self.tokens} tokens) and not a view of a model parameter or buffer, so it "
                "cannot live at a static address. Tensors that cross a split must be [num_tokens, "
                "...] or static (weights, caches): compute it inside the piece that uses it, or "
                "register it as a buffer of the model")


class _PieceCall:
    """A graphable piece: captured per size, replayed in place of running it."""

    def __init__(self, owner: PiecewiseGraphs, index: int, part: Part):
        self.owner, self.index, self.part = owner, index, part
        self.module = owner.split.submodule(part)
        self.graphs: dict[int, object] = {}   # tokens -> captured graph
        self.results: dict[int, object] = {}  # tokens -> what the piece hands on (static views)

    def __call__(self, *args):
        o = self.owner
        if o.replaying:
            self.graphs[o.tokens].replay()
            return self.results[o.tokens]
        module = self.module
        for _ in range(o.warmups):
            out = module(*args)
        result, copies = o.bind(self, out)
        del out

        def body():  # reads args (static views / weights), writes the static buffers
            outs = module(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            for i, dst in copies:
                dst.copy_(outs[i])
        self.graphs[o.tokens] = o.backend.capture(body)
        self.results[o.tokens] = result
        return result


class _OpCall:
    """A splitting op: eager every step, its outputs copied into static buffers."""

    def __init__(self, owner: PiecewiseGraphs, index: int, part: Part):
        self.owner, self.index, self.part = owner, index, part
        self.module = owner.split.submodule(part)
        self.copies: dict[int, tuple] = {}   # tokens -> (output index, static view) to fill
        self.results: dict[int, object] = {}  # tokens -> what the op hands on (static views)

    def __call__(self, *args):
        o = self.owner
        out = self.module.forward(*args)
        if o.replaying:
            outs = out if isinstance(out, tuple) else (out,)
            for i, dst in self.copies[o.tokens]:
                dst.copy_(outs[i])
            return self.results[o.tokens]
        self.results[o.tokens], self.copies[o.tokens] = o.bind(self, out)
        return self.results[o.tokens]


class PiecewiseGraph:
    """The graphs of one PIECEWISE key (what a runner holds per PIECEWISE graph id)."""

    __slots__ = ("owner", "tokens")

    def __init__(self, owner: PiecewiseGraphs, tokens: int):
        self.owner, self.tokens = owner, tokens

    def run(self, inputs: dict[str, torch.Tensor], n: int, reqs: int):
        """Copy in, replay the pieces with the split ops between them, slice to the real rows."""
        return self.owner.replay(self.tokens, inputs, n, reqs)
