"""Capture a runner's graphs: warm up, capture largest first into one pool, gc frozen, with a
progress bar on rank 0 (log lines without a terminal) and a closing summary that compares memory with an estimate made from the
two largest graphs (as vLLM does), before the rest are captured."""

from __future__ import annotations

import gc
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from graphplan.compiler.errors import GraphplanError
from graphplan.compiler.records import BatchDescriptor, RuntimeMode, padded_num_reqs
from graphplan.compiler.table import DispatchTable

from .buffers import StaticBuffers, as_tuple
from .compiled.model import CompiledModel
from .graphs import GraphBackend
from .lora_case import in_lora_case, lora_case

if TYPE_CHECKING:  # imported where PIECEWISE graphs are captured (most runs have none)
    from .piecewise.graphs import BreakableGraphs

if TYPE_CHECKING:
    from graphplan.compiler.table import DispatchTable

    from .buffers import StaticBuffers
    from .piecewise.graphs import BreakableGraphs

log = logging.getLogger("graphplan.runtime")
GiB = 1 << 30


PROGRESS_LINES = 10
"""Without a terminal, capture logs about this many progress lines instead of a progress bar."""

UbatchBody = Callable[[BatchDescriptor, dict, int, tuple], Callable[[], None]]
"""(key, views, tokens, outputs) -> the body a ubatched graph records (runtime/dp/runner.py)."""


@dataclass
class Captured:
    """What one capture produced; the runner keeps it."""

    graphs: list
    """[len(table.graphs)]: the captured graph per table id, None where not captured: a
    ``Graph`` (FULL, replayed) or a ``BreakableGraph`` (PIECEWISE, run); the route's mode says
    which."""
    outputs: tuple[torch.Tensor, ...] | None
    """Static output buffers at the largest captured size (FULL graphs copy into them)."""
    single_output: bool
    """The model returns one tensor (not a tuple)."""
    piecewise: BreakableGraphs | None
    """The run-time split's state when PIECEWISE graphs were captured."""
    summary: dict[str, Any]
    """Graphs, seconds, bytes, estimate, per-graph memory (capture_line renders it)."""


@dataclass(frozen=True)
class CaptureJob:
    """What to capture and with what: the runner's model, table and static buffers."""

    model: Callable[..., Any]
    table: DispatchTable
    buffers: StaticBuffers
    backend: GraphBackend
    warmups: int = 1
    rank: int = 0
    progress: bool = True
    splitting_ops: dict[str, object] = field(default_factory=dict)
    """Plan op name -> the op, function or module it binds (runtime/piecewise/breakable.py)."""
    ubatch_body: UbatchBody | None = None
    """(key, views, tokens, outputs) -> the body of a ubatched graph; None: skip ubatched keys."""
    warmup_each: bool = False
    """Warm up before every FULL graph, not only before the first (slower; for models with
    per-shape lazy initialisation)."""
    measure_each: bool = False
    """Measure every graph's memory (memory calibration); otherwise the first two (the
    estimate's inputs) and the whole capture, which costs no per-graph synchronisation."""
    piecewise_model: Callable[..., Any] | None = None
    """What PIECEWISE graphs run; None: ``model``. The compiled path passes the uncompiled model
    here: the run-time split's capture-time hooks would change what the compiled code was guarded
    on (runtime/compiled/model.py)."""


def _progress(items: list[int], job: CaptureJob, desc: str) -> Iterable[int]:
    """A progress bar on a terminal; a log line every ~tenth of the graphs otherwise (logs and CI
    output are not flooded by redrawn bars)."""
    if job.rank != 0 or not job.progress:
        return items
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            return tqdm(items, desc=desc, unit="graph", leave=False)
        except ImportError:  # tqdm is optional
            pass
    return _logged(items, desc)


def _logged(items: list[int], desc: str) -> Iterator[int]:
    every = max(1, -(-len(items) // PROGRESS_LINES))
    for i, item in enumerate(items, 1):
        yield item
        if i % every == 0 or i == len(items):
            log.info("%s: %d/%d", desc, i, len(items))


def _static_outputs(out, max_tokens: int) -> tuple:
    return tuple(
        torch.empty((max_tokens, *o.shape[1:]), dtype=o.dtype, device=o.device)
        for o in as_tuple(out)
    )


def _graph_fn(
    model: Callable[..., Any], statics: tuple[torch.Tensor, ...], views: dict, tokens: int
) -> Callable[[], None]:
    """The body a graph records: the model on static views, outputs copied to static buffers (so
    the pool can reuse each graph's activations for the next one). A compiled model writes its
    outputs there itself, from its last kernels (no copy in the graph)."""
    if isinstance(model, CompiledModel):
        return lambda: model.run_into(statics, views)

    def fn():
        for dst, src in zip(statics, as_tuple(model(**views))):
            dst[:tokens].copy_(src)

    return fn


def graph_rows(key: BatchDescriptor, max_num_seqs: int) -> tuple[int, int]:
    """(tokens, requests) a graph of ``key`` is captured at: a key without a request count
    (a token-only graph) takes as many requests as tokens, up to ``max_num_seqs``."""
    tokens = key.num_tokens
    reqs = key.num_reqs if key.num_reqs is not None else padded_num_reqs(tokens, max_num_seqs)
    return tokens, reqs


def _graph_views(job: CaptureJob, key: BatchDescriptor) -> tuple[dict, int]:
    """The static input views a graph of ``key`` records on (pad values everywhere), and its
    token count."""
    tokens, reqs = graph_rows(key, job.table.max_num_seqs)
    job.buffers.reset(tokens, reqs)
    return job.buffers.views(tokens, reqs), tokens


def _full_body(
    job: CaptureJob, done: Captured, key: BatchDescriptor, views: dict, tokens: int
) -> Callable[[], None]:
    """Warm a FULL graph of ``key`` up (the first creates the static outputs) and return the
    body to capture: the model into the static outputs, or the micro-batched body (warmed once,
    as its streams and events need)."""
    first = done.outputs is None
    case = lora_of(job.table, key)
    with lora_case(case):
        for _ in range(max(job.warmups, 1) if first else job.warmups * job.warmup_each):
            out = job.model(**views)
            if done.outputs is None:
                done.outputs = _static_outputs(out, job.buffers.max_tokens)
                done.single_output = not isinstance(out, (tuple, list))
            del out
        assert done.outputs is not None  # the first warm-up above made them
        if key.num_ubatches > 1:
            assert job.ubatch_body is not None  # capture skips ubatched keys without a body
            body = job.ubatch_body(key, views, tokens, done.outputs)
            body()
            return in_lora_case(case, body)
    return in_lora_case(case, _graph_fn(job.model, done.outputs, views, tokens))


def lora_of(table, key: BatchDescriptor) -> int | None:
    """The LoRA case a graph of ``key`` records (``runtime/lora_case.py``): its
    ``num_active_loras`` when the table has LoRA on, else None."""
    return key.num_active_loras if table.settings.lora_enabled else None


def capture_graphs(
    job: CaptureJob, modes: tuple[RuntimeMode, ...], only: set[int] | None = None
) -> Captured:
    """Warm up and capture the table's graphs of ``modes`` in table order. On any failure, an
    interrupt included, everything captured so far is released before the error propagates."""
    table, backend = job.table, job.backend
    ids = [
        g.id
        for g in table.graphs
        if g.mode in modes  # table order: largest first per mode
        and (g.key.num_ubatches == 1 or job.ubatch_body is not None)
        and (only is None or g.id in only)
    ]
    summary: dict[str, Any] = {
        "graphs": 0,
        "seconds": 0.0,
        "bytes": 0,
        "estimate_bytes": None,
        "estimate_error": None,
        "per_graph": [],
        "backend": backend.name,
    }
    done = Captured(
        graphs=[None] * len(table.graphs),
        outputs=None,
        single_output=True,
        piecewise=None,
        summary=summary,
    )
    if not ids:
        return done
    t0 = time.perf_counter()
    if any(table.graphs[g].mode is RuntimeMode.PIECEWISE for g in ids):
        done.piecewise = _split(job)  # SplitError here, before anything is captured
    # capture allocates many Python objects: keep the collector off the objects that exist now.
    # No gc.collect() first: with torch and transformers loaded it takes ~0.2 s, most of an
    # on-demand start (garbage frozen here is collected after the unfreeze below)
    gc.freeze()
    gid, start, head = ids[0], backend.memory_used(), 0
    try:
        with torch.no_grad():
            for n_done, gid in enumerate(_progress(ids, job, f"Capturing graphs ({backend.name})")):
                key = table.graphs[gid].key
                views, tokens = _graph_views(job, key)
                took: int | None
                if table.graphs[gid].mode is RuntimeMode.PIECEWISE:  # warms up piece by piece
                    assert done.piecewise is not None  # split above: ids hold a PIECEWISE graph
                    done.graphs[gid], took = done.piecewise.capture(
                        views, tokens, lora_of(table, key)
                    )
                else:
                    body = _full_body(job, done, key, views, tokens)
                    measure = job.measure_each or n_done < 2
                    before = backend.memory_used() if measure else 0
                    done.graphs[gid] = backend.capture(body)
                    took = backend.memory_used() - before if measure else None
                summary["per_graph"].append([gid, tokens, took])
                if n_done == 0:  # the static outputs and the largest graph
                    head = backend.memory_used() - start
                elif n_done == 1 and took is not None:  # estimate the rest from the two largest
                    summary["estimate_bytes"] = head + took * (len(ids) - 1)
    except BaseException as e:
        done.graphs = [None] * len(table.graphs)
        done.piecewise = done.outputs = None
        backend.release()
        if not isinstance(e, Exception) or isinstance(e, GraphplanError):
            raise  # an interrupt, or an error that already says what is wrong and how to fix it
        raise _capture_error(e, gid, table.graphs[gid].key) from e
    finally:
        gc.unfreeze()
    backend.synchronize()
    summary["seconds"] = time.perf_counter() - t0  # the memory reading below is not capture time
    summary["graphs"] = len(ids)
    summary["bytes"] = backend.memory_used() - start  # the pool, static outputs included
    if done.piecewise is not None:
        summary["piecewise"] = done.piecewise.summary()
    if summary["estimate_bytes"] and summary["bytes"]:
        summary["estimate_error"] = summary["estimate_bytes"] / summary["bytes"] - 1
    if job.rank == 0:
        log.info(capture_line(summary))
    return done


def capture_one(job: CaptureJob, done: Captured, gid: int) -> None:
    """Capture graph ``gid`` into ``done`` (its pool, its static outputs), after the rest: what
    on-demand capture runs between steps. Memory is not measured (no synchronisation beyond the
    capture's own). On failure the error propagates and nothing captured before is touched."""
    g = job.table.graphs[gid]
    if g.key.num_ubatches > 1 and job.ubatch_body is None:
        raise CaptureError(f"graph #{gid} is micro-batched and this runner has no ubatch body")
    if g.mode is RuntimeMode.PIECEWISE and done.piecewise is None:
        raise CaptureError(
            f"graph #{gid} is PIECEWISE and no PIECEWISE graph was captured at "
            "start (the start set holds the largest)"
        )
    views, tokens = _graph_views(job, g.key)
    with torch.no_grad():
        if done.piecewise is not None and g.mode is RuntimeMode.PIECEWISE:
            done.graphs[gid], _ = done.piecewise.capture(views, tokens, lora_of(job.table, g.key))
        else:
            done.graphs[gid] = job.backend.capture(_full_body(job, done, g.key, views, tokens))


class CaptureError(GraphplanError):
    """Capturing a graph failed; everything captured so far was released."""


def _capture_error(e: Exception, gid: int, key: BatchDescriptor) -> CaptureError:
    oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
    fix = (
        "lower cudagraph.capture_sizes (a smaller preset ceiling, or drop sizes >= "
        f"{key.num_tokens}), or leave more GPU memory free"
        if oom
        else "check that the model runs eagerly at this size, with no host syncs or "
        "data-dependent shapes (required inside a CUDA graph)"
    )
    return CaptureError(
        f"capturing graph #{gid} ({key.num_tokens} tokens, "
        f"{key.num_reqs} requests, lora {key.num_active_loras}, "
        f"{key.num_ubatches} ubatch(es)) failed: {type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}. Released every graph "
        f"captured so far. Fix: {fix}"
    )


def _split(job: CaptureJob) -> BreakableGraphs:
    """The model's piecewise state, ready to capture: split at run time at each call of a
    splitting op (runtime/piecewise/graphs.py)."""
    from .piecewise.graphs import BreakableGraphs

    table = job.table
    model = job.model if job.piecewise_model is None else job.piecewise_model
    static = [*job.buffers.buffers.values()]  # fixed addresses: the runner's inputs, the weights
    if isinstance(model, torch.nn.Module):
        static += [*model.parameters(), *model.buffers()]
    max_tokens = max(g.key.num_tokens for g in table.graphs if g.mode is RuntimeMode.PIECEWISE)
    return BreakableGraphs(
        model,
        table.settings.splitting_ops,
        job.splitting_ops,
        backend=job.backend,
        buffers=job.buffers,
        max_tokens=max_tokens,
        max_reqs=table.max_num_seqs,
        static=static,
        warmups=job.warmups,
    )


def capture_line(s: dict[str, Any]) -> str:
    pw = s.get("piecewise")
    pieces = (
        f" ({pw['piece_graphs']} piece graphs around {pw['split_ops']} split ops, "
        f"{pw['mechanism']} split)"
        if pw
        else ""
    )
    line = (
        f"captured {s['graphs']} graphs{pieces} in {s['seconds']:.2f} s, "
        f"{s['bytes'] / GiB:.3f} GiB ({s['backend']})"
    )
    if s["estimate_bytes"] is not None and s["bytes"]:
        line += (
            f"; estimate from the two largest graphs {s['estimate_bytes'] / GiB:.3f} GiB "
            f"({s['estimate_error']:+.1%})"
        )
    return line
