"""Calibrate the compiler's graph-memory model (compiler/tools/memory.py) on a real GPU, once per model
and device, the way the model is defined: capture a few FULL graphs, largest first, into ONE pool
(as the runner does) and record how much the pool grows at each. Every later graph reuses the
first one's blocks, so its growth is the per-graph cost alone: ``per_graph_bytes`` = mean growth of
the later graphs. The first graph's growth is the pool's one-time cost (library workspaces, the
allocator's first segments) + one graph + its activations; to tell the one-time cost from the
activations, the smallest of those graphs is also captured alone into a fresh pool:
``per_token_bytes`` = (first growth - smallest alone) / (their token difference) and
``base_bytes`` = first growth - per_graph_bytes - per_token_bytes * first tokens. (Dividing the
first growth by its tokens instead charged the one-time cost per token: 1.30x the real pool of the
tiny Llama's table on an H200. Fitting graphs captured into fresh pools counts a whole pool's
fixed cost per graph: 10x.) The profile it saves is what ``plan compile --memory --profile P`` and
``plan report`` read; its ``samples`` are the shared pool's [num_tokens, growth] pairs, largest
first, then the largest PIECEWISE graph alone (if the table has one: its per-token cost,
``piecewise_per_token_bytes``, is its own, since a piece graph holds one piece's activations at a
time), then the smallest FULL graph alone. ``per_graph_capture_seconds`` is the shared-pool
capture's time over its graph count (warm-ups included): what ``plan optimize
--budget-capture-seconds`` prices a graph at."""

from __future__ import annotations

import hashlib

import torch

from graphplan.compiler import profile_format
from graphplan.compiler.errors import GraphplanError
from graphplan.compiler.records import RuntimeMode
from graphplan.compiler.table import DispatchTable

from .runner import GraphRunner


def model_fingerprint(model) -> str:
    """The model's architecture (class, parameter and buffer names, shapes, dtypes), not its
    weights: the memory a graph takes depends on shapes only."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    if isinstance(model, torch.nn.Module):
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return "sha256:" + h.hexdigest()


def device_name(device: torch.device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def calibration_sizes(table: DispatchTable, count: int = 4) -> list[int]:
    """Token counts of FULL graphs spread over the table's range, the largest included."""
    tokens = sorted(
        {
            g.key.num_tokens
            for g in table.graphs
            if g.mode is RuntimeMode.FULL and g.key.num_ubatches == 1
        }
    )
    if len(tokens) < 2:
        raise ValueError("memory calibration needs at least two FULL graph sizes in the table")
    picks = {tokens[round(i * (len(tokens) - 1) / (count - 1))] for i in range(count)}
    return sorted(picks)


def _piecewise_alone(model, table: DispatchTable, inputs, device) -> tuple[int, float] | None:
    """(tokens, pool growth) of the table's largest PIECEWISE graph captured alone in a fresh
    pool; None when the table has none or the model cannot be split."""
    pw = [g for g in table.graphs if g.mode is RuntimeMode.PIECEWISE]
    if not pw:
        return None
    top = max(pw, key=lambda g: g.key.num_tokens)
    runner = GraphRunner(model, table, inputs, device=device, progress=False)
    try:
        return top.key.num_tokens, float(
            runner.capture((RuntimeMode.PIECEWISE,), only={top.id})["bytes"]
        )
    except GraphplanError:
        return None
    finally:
        runner.release()


def calibrate_memory(
    model, table: DispatchTable, inputs, *, device=None, count: int = 4, path=None
) -> dict:
    """Measure, return (and with ``path``, save atomically) a memory profile for this model."""
    sizes = calibration_sizes(table, count)
    ids = {
        next(
            g.id
            for g in table.graphs
            if g.mode is RuntimeMode.FULL and g.key.num_ubatches == 1 and g.key.num_tokens == t
        )
        for t in sizes
    }
    runner = GraphRunner(model, table, inputs, device=device, progress=False)
    summary = runner.capture((RuntimeMode.FULL,), only=ids, measure_each=True)
    runner.release()
    samples = [[tokens, growth] for _, tokens, growth in summary["per_graph"]]  # largest first
    per_graph_seconds = summary["seconds"] / max(summary["graphs"], 1)
    smallest = min(ids, key=lambda i: table.graphs[i].key.num_tokens)
    runner = GraphRunner(model, table, inputs, device=device, progress=False)
    ((_, small_tokens, alone),) = runner.capture(("FULL",), only={smallest})["per_graph"]
    runner.release()
    (top_tokens, first), later = samples[0], samples[1:]
    per_graph = max(0.0, sum(b for _, b in later) / len(later))
    per_token = max(0.0, (first - alone) / (top_tokens - small_tokens))
    base = max(0.0, first - per_graph - per_token * top_tokens)
    extra = {}
    pw = _piecewise_alone(model, table, inputs, device)
    if pw is not None:  # a PIECEWISE graph holds one piece's activations at a time: its own cost
        pw_tokens, pw_growth = pw
        extra["piecewise_per_token_bytes"] = max(0.0, (pw_growth - base - per_graph) / pw_tokens)
        samples.append([pw_tokens, pw_growth])
    profile = profile_format.check_profile(
        {
            "format": profile_format.FORMAT,
            "version": profile_format.VERSION,
            "model_fingerprint": model_fingerprint(model),
            "device": device_name(runner.device),
            "per_graph_bytes": float(per_graph),
            "per_token_bytes": float(per_token),
            "base_bytes": float(base),
            "per_graph_capture_seconds": float(per_graph_seconds),
            **extra,
            "samples": samples + [[small_tokens, alone]],
        }
    )
    if path is not None:
        profile_format.save_profile(path, profile)
    return profile
