"""Capture a runner's graphs: warm up, capture largest first into one pool, gc frozen, with a
progress bar on rank 0 and a closing summary that compares memory with an estimate made from the
two largest graphs (as vLLM does), before the rest are captured."""

from __future__ import annotations

import gc
import logging
import time

import torch

from graphplan.compiler.errors import GraphplanError
from graphplan.compiler.table import RuntimeMode
from graphplan.runtime.buffers import as_tuple

log = logging.getLogger("graphplan.runtime")
GiB = 1 << 30


def _progress(items, runner, desc: str):
    if runner.rank != 0 or not runner.progress:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: fall back to a plain log line per graph
        return items
    return tqdm(items, desc=desc, unit="graph", leave=False)


def _allocate_outputs(runner, out, max_tokens: int) -> None:
    outs = as_tuple(out)
    runner._single_output = not isinstance(out, (tuple, list))
    runner._outputs = tuple(torch.empty((max_tokens, *o.shape[1:]), dtype=o.dtype, device=o.device)
                            for o in outs)


def _graph_fn(runner, views: dict, tokens: int):
    """The body a graph records: the model on static views, outputs copied to static buffers (so
    the pool can reuse each graph's activations for the next one)."""
    model, statics = runner.model, runner._outputs

    def fn():
        for dst, src in zip(statics, as_tuple(model(**views))):
            dst[:tokens].copy_(src)
    return fn


def capture_graphs(runner, modes: tuple[RuntimeMode, ...], only: set[int] | None = None) -> dict:
    table, backend, buffers = runner.table, runner.backend, runner.buffers
    ids = [g.id for g in table.graphs if g.mode in modes  # table order: largest first per mode
           and (g.key.num_ubatches == 1 or getattr(runner, "ubatch_body", None))
           and (only is None or g.id in only)]
    summary = {"graphs": 0, "seconds": 0.0, "bytes": 0, "estimate_bytes": None,
               "estimate_error": None, "per_graph": [], "backend": backend.name}
    if not ids:
        runner.stats_.captured(summary)
        return summary
    t0 = time.perf_counter()
    if any(table.graphs[g].mode is RuntimeMode.PIECEWISE for g in ids):
        runner._piecewise = _split(runner)  # SplitError here, before anything is captured
    gc.collect()
    gc.freeze()  # capture allocates many Python objects; keep the collector out of the way
    gid = ids[0]
    try:
        with torch.no_grad():
            for n_done, gid in enumerate(_progress(ids, runner, f"Capturing graphs ({backend.name})")):
                key = table.graphs[gid].key
                tokens = key.num_tokens
                reqs = key.num_reqs if key.num_reqs is not None else min(tokens, table.max_num_seqs)
                buffers.reset(tokens, reqs)
                views = buffers.views(tokens, reqs)
                if table.graphs[gid].mode is RuntimeMode.PIECEWISE:  # warms up piece by piece
                    runner._graphs[gid], took = runner._piecewise.capture(views, tokens)
                else:
                    for i in range(max(runner.warmups, 1 if runner._outputs is None else 0)):
                        out = runner.model(**views)
                        if runner._outputs is None:
                            _allocate_outputs(runner, out, buffers.max_tokens)
                        del out
                    if key.num_ubatches > 1:  # DBO: streams and events, warmed once first
                        body = runner.ubatch_body(key, views, tokens)
                        body()
                    else:
                        body = _graph_fn(runner, views, tokens)
                    before = backend.memory_used()
                    runner._graphs[gid] = backend.capture(body)
                    took = backend.memory_used() - before
                summary["per_graph"].append([gid, tokens, took])
                summary["bytes"] += took
                if n_done == 1:  # estimate the rest from the two largest graphs
                    first = summary["per_graph"][0][2]
                    summary["estimate_bytes"] = first + took * (len(ids) - 1)
    except BaseException as e:  # an interrupt too: release everything taken, then re-raise
        runner.release()
        if isinstance(e, GraphplanError) or not isinstance(e, Exception):
            raise
        key = table.graphs[gid].key
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
        fix = ("lower cudagraph.capture_sizes (a smaller preset ceiling, or drop sizes >= "
               f"{key.num_tokens}), or leave more GPU memory free" if oom else
               "check that the model runs eagerly at this size, with no host syncs or "
               "data-dependent shapes (required inside a CUDA graph)")
        from graphplan.runtime.runner import CaptureError
        raise CaptureError(f"capturing graph #{gid} ({key.num_tokens} tokens, "
                           f"{key.num_reqs} requests, lora {key.num_active_loras}, "
                           f"{key.num_ubatches} ubatch(es)) failed: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}. Released every graph "
                           f"captured so far. Fix: {fix}") from e
    finally:
        gc.unfreeze()
    backend.synchronize()
    summary["graphs"] = len(ids)
    summary["seconds"] = time.perf_counter() - t0
    if runner._piecewise is not None:
        pw = runner._piecewise
        summary["piecewise"] = {"pieces": len(pw.split.pieces), "split_ops": len(pw.split.split_ops),
                                "piece_graphs": pw.num_graphs(), "static_bytes": pw.crossing_bytes()}
    if summary["estimate_bytes"] and summary["bytes"]:
        summary["estimate_error"] = summary["estimate_bytes"] / summary["bytes"] - 1
    runner.stats_.captured(summary)
    if runner.rank == 0:
        log.info(capture_line(summary))
    return summary


def _split(runner):
    """The model cut at the plan's splitting ops, ready to capture (runtime/piecewise.py)."""
    from graphplan.runtime.piecewise import split_model
    from graphplan.runtime.piecewise_graphs import PiecewiseGraphs
    table, model = runner.table, runner.model
    split = split_model(model, table.plan["cudagraph"]["splitting_ops"], runner.splitting_ops)
    static = [*runner.buffers.buffers.values()]
    if isinstance(model, torch.nn.Module):
        static += [*model.parameters(), *model.buffers()]
    static += [*split.module.parameters(), *split.module.buffers()]
    for m in split.module.modules():  # constants the tracer baked in (e.g. a view of the cache)
        static += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
    max_tokens = max(g.key.num_tokens for g in table.graphs if g.mode is RuntimeMode.PIECEWISE)
    return PiecewiseGraphs(split, backend=runner.backend, buffers=runner.buffers,
                           max_tokens=max_tokens, max_reqs=table.max_num_seqs, static=static,
                           warmups=runner.warmups)


def capture_line(s: dict) -> str:
    pw = s.get("piecewise")
    pieces = f" ({pw['piece_graphs']} piece graphs around {pw['split_ops']} split ops)" if pw else ""
    line = (f"captured {s['graphs']} graphs{pieces} in {s['seconds']:.2f} s, "
            f"{s['bytes'] / GiB:.3f} GiB ({s['backend']})")
    if s["estimate_bytes"] is not None and s["bytes"]:
        line += (f"; estimate from the two largest graphs {s['estimate_bytes'] / GiB:.3f} GiB "
                 f"({s['estimate_error']:+.1%})")
    return line
