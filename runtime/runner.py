"""GraphRunner: load a compiled table, capture its graphs, and every step route -> copy in -> replay
(or run eager for a stated reason) -> hand back outputs sliced to the real tokens.

The step is the hot path: a table lookup (list indexing), the copies into static buffers, one
replay, and views of the static outputs. Nothing is searched or allocated per step beyond the Route
and the output views.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from graphplan.compiler.errors import GraphplanError, TableError
from graphplan.compiler.records import RuntimeMode, padded_num_reqs
from graphplan.compiler.table import DispatchTable

from .buffers import StaticBuffers, StaticInput
from .capture import (
    Captured,
    CaptureError,
    CaptureJob,
    UbatchBody,
    capture_graphs,
    capture_one,
    graph_rows,
)
from .compiled.model import CompiledModel, compiled_model
from .graphs import graph_backend
from .lora_case import lora_case
from .metrics import RunnerStats
from .on_demand import OnDemandQueue, start_graph_ids

if TYPE_CHECKING:
    from .piecewise.graphs import BreakableGraphs

__all__ = ["GraphRunner", "CaptureError", "RunnerStateError"]

log = logging.getLogger("graphplan.runtime")


PIECEWISE_MECHANISMS = ("runtime",)
REMOVED_MECHANISMS = ("fx", "auto")  # the torch.fx split, removed in issue 14


class RunnerStateError(GraphplanError):
    """The runner was used out of order (e.g. capture() twice)."""


class GraphRunner:
    """Captures and replays the graphs of a compiled table around ``model``.

    ``model`` is any callable taking the static inputs as keyword tensors and returning a tensor
    (or tuple of tensors) whose first dimension is the token count. ``inputs`` names those inputs;
    the runner owns one buffer per input, allocated once at the largest graph's size.

    PIECEWISE graphs cut the model at the plan's ``splitting_ops`` at run time: while capturing,
    each call of a splitting op ends a graph segment, runs eagerly and begins the next (any model,
    no tracing; ``runtime/piecewise/breakable.py``). ``piecewise`` accepts only ``"runtime"``: the torch.fx
    split (``"fx"``, ``"auto"``) was removed once the run-time split matched its step time
    (docs/semantics.md §5.6). ``splitting_ops`` binds a plan op name to the op explicitly
    (``{"attention": torch.ops.my_ns.attention.default}``, a function or an ``nn.Module``) instead
    of the name rule.

    Capture runs ``warmups`` eager passes before the first FULL graph (``warmup_each``: before
    every graph, for models that initialise lazily per shape), then captures back to back; memory
    is read around the first two graphs (the estimate) and the whole capture only.

    ``compile`` (off by default): True or a backend ("inductor", "aot_eager", a callable, or a
    shared ``CompiledModel``) compiles the model once with a dynamic token dimension before FULL
    graphs are captured of it; eager steps and PIECEWISE graphs run the model as written
    (``runtime/compiled/model.py``). ``stats()['compile']`` counts compilations and recompiles.

    ``on_demand`` (default: the table's ``on_demand`` setting) captures at start only the start
    set (``runtime/on_demand.py``): the largest graph of each routine first, and the graphs of the
    plan's ``start_sizes``. Any other graph is captured on its first use: that step runs eager,
    and the graph is captured before the next step (``capture_next``), one per step.
    """

    def __init__(
        self,
        model,
        table: DispatchTable | str | os.PathLike,
        inputs: list[StaticInput],
        *,
        device: torch.device | str | None = None,
        expected_fingerprint: str | None = None,
        warmups: int = 1,
        warmup_each: bool = False,
        rank: int | None = None,
        progress: bool = True,
        splitting_ops: Mapping[str, object] | None = None,
        piecewise: str = "runtime",
        compile=False,
        on_demand: bool | None = None,
    ):
        if piecewise in REMOVED_MECHANISMS:
            raise ValueError(
                f"piecewise={piecewise!r}: the torch.fx split was removed; piecewise "
                "graphs split at run time, which matched its step time (+2.2% at "
                "worst, capture 16% faster: bench/results/piecewise_bench.md) and "
                "takes any model. Drop the argument (or pass piecewise='runtime'); "
                "a model it cannot capture gets a SplitError naming the fix"
            )
        if piecewise not in PIECEWISE_MECHANISMS:
            raise ValueError(f"piecewise={piecewise!r}: expected one of {PIECEWISE_MECHANISMS}")
        if not isinstance(table, DispatchTable):
            table = DispatchTable.load(Path(table))
        if expected_fingerprint is not None and table.content_fingerprint != expected_fingerprint:
            raise TableError(
                f"table content fingerprint {table.content_fingerprint[:19]} does not "
                f"match the runner's {expected_fingerprint[:19]}: compile the plan "
                "this server was built for, or build the runner for the new table"
            )
        if device is None:
            device = _model_device(model)
        self.compiled = compiled_model(model, compile)  # None unless compile is on
        self.model, self.table = model if self.compiled is None else self.compiled, table
        self.eager_model = model  # what run_eager runs: the model as written, compile or not
        self.device = torch.device(device)
        self.backend = graph_backend(self.device)
        self.warmups, self.warmup_each, self.progress = warmups, warmup_each, progress
        self.splitting_ops = dict(splitting_ops or {})
        self.rank = rank if rank is not None else _default_rank()
        graph_tokens = max((g.key.num_tokens for g in table.graphs), default=1)
        self.buffers = StaticBuffers(list(inputs), graph_tokens, table.max_num_seqs, self.device)
        self.device = self.buffers.device
        self._graphs: list = [None] * len(table.graphs)
        self._outputs: tuple[torch.Tensor, ...] = ()  # the FULL graphs' static outputs
        self._single_output = True
        # (key, views, tokens, outputs) -> the body a ubatched (num_ubatches > 1) graph records;
        # set by runtime.dp.runner.DPRunner. Without it ubatched graphs are not captured.
        self.ubatch_body: UbatchBody | None = None
        self._piecewise: BreakableGraphs | None = None  # once PIECEWISE is captured
        self.captured = False
        self._stats = RunnerStats(table, self.backend.name)
        self.on_demand = table.settings.on_demand if on_demand is None else bool(on_demand)
        self._demand: OnDemandQueue | None = None  # graphs still to capture, with on_demand
        self._job: CaptureJob | None = None
        self._done: Captured | None = None  # the record that on-demand captures add to

    # -- capture ----------------------------------------------------------------------------
    def capture(
        self,
        modes: tuple[RuntimeMode | str, ...] = (RuntimeMode.FULL, RuntimeMode.PIECEWISE),
        only: set[int] | None = None,
        *,
        measure_each: bool = False,
    ) -> dict:
        """Warm up and capture the table's graphs of the given modes (by default every graph the
        table has), in table order (PIECEWISE, then FULL, each largest first), into one pool.
        ``only`` restricts capture to those graph ids (with on_demand: the start set, the rest
        on first use); ``measure_each`` measures every graph's memory (calibration), at the price
        of a device synchronisation per graph.

        Returns the capture summary (also in ``stats()['capture']``). Raises CaptureError, with
        everything it took released, if a graph cannot be captured.
        """
        if self.captured:
            raise RunnerStateError(
                "capture() already ran for this runner; graphs are captured "
                "once — build a new GraphRunner to capture another table"
            )
        if self.compiled is not None:  # compile at the largest size before any graph
            self._compile_warm_up(self.compiled)
        job = CaptureJob(
            model=self.model,
            table=self.table,
            buffers=self.buffers,
            backend=self.backend,
            warmups=self.warmups,
            rank=self.rank,
            progress=self.progress,
            splitting_ops=self.splitting_ops,
            ubatch_body=self.ubatch_body,
            warmup_each=self.warmup_each,
            measure_each=measure_each,
            piecewise_model=self.eager_model,
        )
        kinds = tuple(m if isinstance(m, RuntimeMode) else RuntimeMode[m] for m in modes)
        if self.on_demand and only is None:
            only = start_graph_ids(self.table)
        done = capture_graphs(job, kinds, only)
        if self.on_demand:
            wanted = [
                g.id
                for g in self.table.graphs
                if g.mode in kinds and (g.key.num_ubatches == 1 or self.ubatch_body is not None)
            ]
            self._demand = OnDemandQueue({g for g in wanted if done.graphs[g] is not None}, wanted)
        self._job, self._done = job, done
        self._graphs, self._outputs = done.graphs, done.outputs or ()
        self._single_output, self._piecewise = done.single_output, done.piecewise
        self._stats.captured(done.summary)
        self.captured = True
        return done.summary

    def _compile_warm_up(self, compiled: CompiledModel) -> None:
        """One compile at the largest graph's size, then a run at the smallest FULL graph's (a
        compile there, if torch specialises that size, is the warm-up's: see CompiledModel)."""
        tokens = self.buffers.max_tokens
        reqs = padded_num_reqs(tokens, self.buffers.max_reqs)
        self.buffers.reset(tokens, reqs)
        full = [g.key for g in self.table.graphs if g.mode is RuntimeMode.FULL]
        small = min(full, key=lambda k: k.num_tokens, default=None)
        also = None
        if small is not None and small.num_tokens < tokens:
            also = self.buffers.views(*graph_rows(small, self.table.max_num_seqs))
        compiled.warm_up(
            self.buffers.views(tokens, reqs), token_input=self.buffers.token_input, also=also
        )

    # -- steps ------------------------------------------------------------------------------
    def step(
        self,
        inputs: dict[str, torch.Tensor],
        num_reqs: int | None = None,
        max_query_len: int | None = None,
        num_active_loras: int = 0,
    ):
        """Run one batch. Outputs are views of the real rows, valid until the next step."""
        n = self.buffers.num_tokens(inputs)
        route = self.table.route(n, num_reqs, max_query_len, num_active_loras)
        self.buffers.check(inputs, n, num_reqs)
        return self.execute(route, inputs, n, num_reqs)

    __call__ = step

    def execute(self, route, inputs: dict[str, torch.Tensor], n: int, num_reqs: int | None):
        """Run an already-routed batch (DP re-dispatch routes it first, then calls this)."""
        if self._demand is not None and self._demand.waiting:
            self.capture_next()  # between steps: the previous step's outputs are done with
        gid = route.graph_id
        graph = self._graphs[gid] if gid >= 0 else None
        if graph is None:
            reason = self._demand.missing(gid) if self._demand is not None else None
            if reason is None:
                self._stats.eager(route, gid)
            else:
                self._stats.eager_because(reason)
            if not self.table.settings.lora_enabled:
                return self.run_eager(inputs)
            with lora_case(route.context[4]):  # the step's own count of active adapters
                return self.run_eager(inputs)
        reqs = num_reqs or 0
        if route.mode is RuntimeMode.PIECEWISE:  # piece graphs around eager split ops
            out = graph.run(inputs, n, reqs)
            self._stats.replayed(gid, route.padded_tokens - n)
            return out
        self.buffers.load(
            inputs,
            n,
            reqs,
            route.padded_tokens,
            route.padded_reqs if route.padded_reqs is not None else reqs,
        )
        graph.replay()
        self._stats.replayed(gid, route.padded_tokens - n)
        if self._single_output:
            return self._outputs[0][:n]
        return tuple(o[:n] for o in self._outputs)

    def run_eager(self, inputs: dict[str, torch.Tensor]):
        """The eager path every eager step takes, single-rank or DP (runtime/dp/runner.py): the
        model as written (``eager_model``, even with ``compile`` on: compile serves FULL graphs),
        without autograd, on exactly these inputs. The caller counts the step (``execute`` does,
        DP calls ``record_eager``)."""
        with torch.no_grad():
            return self.eager_model(**inputs)

    def capture_next(self) -> int | None:
        """Capture the first graph waiting for on-demand capture (at most one); returns its id, or
        None when none waits. A graph that fails to capture stays eager for good (logged), and
        every other graph is kept: the server keeps serving."""
        if self._demand is None or not self._demand.waiting:
            return None
        assert self._job is not None and self._done is not None  # capture() set all three
        gid = self._demand.next()
        t0 = time.perf_counter()
        try:
            capture_one(self._job, self._done, gid)
        except Exception as e:
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._done.graphs[gid] = None
            self._demand.gave_up(gid, reason)
            log.warning(
                "on-demand capture of graph #%d (%d tokens) failed, it runs eager from now on: %s",
                gid,
                self.table.graphs[gid].key.num_tokens,
                reason,
            )
            return gid
        self._outputs, self._single_output = self._done.outputs or (), self._done.single_output
        self._demand.captured(time.perf_counter() - t0)
        return gid

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        s = self._stats.as_dict()
        if self.compiled is not None:
            s["compile"] = self.compiled.stats()
        if self._demand is not None:
            s["on_demand"] = self._demand.as_dict()
        return s

    def record_eager(self, route) -> None:
        """Count an eager step that a caller ran itself (DP runs padded or ubatched eager steps)."""
        self._stats.eager(route, route.graph_id)

    def has_graph(self, graph_id: int) -> bool:
        """Whether the table's graph ``graph_id`` was captured (False for -1)."""
        return graph_id >= 0 and self._graphs[graph_id] is not None

    def captured_graph_ids(self) -> list[int]:
        return [i for i, g in enumerate(self._graphs) if g is not None]

    def release(self) -> None:
        """Drop every graph and the static outputs (the runner can capture again)."""
        self._graphs = [None] * len(self.table.graphs)
        self._outputs = ()
        self._piecewise = None
        self._demand = self._job = self._done = None
        self.backend.release()
        self.captured = False


def _model_device(model) -> torch.device:
    """Where the model's weights (parameters, else buffers) live; CPU for a plain callable."""
    if isinstance(model, torch.nn.Module):
        for t in (*model.parameters(), *model.buffers()):
            return t.device
    return torch.device("cpu")


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
