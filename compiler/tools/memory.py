"""Graph-memory model: how many bytes the shared CUDA-graph pool will hold, before any GPU work.

The model. Every graph is captured into one memory pool, largest first (docs/semantics.md §5.5).
A graph's intermediate tensors are freed back to the pool when its capture ends, and the next
(smaller) graph reuses those blocks, so activations cost what the *largest* graph needs, once.
What is not reused is a per-graph fixed cost: the instantiated graph itself (kernel parameters,
node bookkeeping) and the blocks a graph keeps alive (its outputs, library workspaces). Hence

    pool bytes ~= base_bytes + per_graph_bytes * num_graphs + per_token_bytes * largest_graph_tokens

``base_bytes`` is what a pool costs once whatever its graphs (library workspaces allocated on the
capture stream, the allocator's first segments); optional, 0 in profiles that predate it.

A *profile* holds the two coefficients for one model on one device. The runtime calibrates it once:
capture one graph at each of a few token counts, each into a fresh pool, record the pool growth,
and fit ``bytes = per_graph_bytes + per_token_bytes * num_tokens`` by least squares
(``fit_profile``). Format (``save_profile`` / ``load_profile``)::

    {"format": "graphplan.memory_profile", "version": 1, "model_fingerprint": str,
     "device": str, "per_graph_bytes": float, "per_token_bytes": float,
     "base_bytes": float (optional, default 0), "samples": [[num_tokens, bytes], ...]}

Capture time follows the same shape: every graph is one warm-up run and one capture, about the
same cost whatever its size (the model's kernels are launched once either way), so

    capture seconds ~= base_capture_seconds + per_graph_capture_seconds * num_graphs

with the two coefficients from the profile when its calibration measured them
(``runtime/calibrate.py`` times the shared-pool captures), else ``DEFAULT_CAPTURE_SECONDS`` per
graph. ``plan optimize --budget-capture-seconds`` turns a time budget into a graph budget with it.

Without a profile, ``DEFAULT_PROFILE`` is used (an order-of-magnitude figure for an 8B-class bf16
model; outputs say so). The profile's file format (what the runtime's calibration writes) is
``compiler/profile_format.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..profile_format import (
    FORMAT,
    VERSION,
    ProfileError,
    _samples,
    check_profile,
    load_profile,
    save_profile,
)
from ..table import DispatchTable

__all__ = [
    "FORMAT",
    "VERSION",
    "ProfileError",
    "check_profile",
    "load_profile",
    "save_profile",
    "fit_profile",
    "capture_model",
    "capture_seconds",
    "estimate",
    "estimate_lines",
    "DEFAULT_PROFILE",
    "default_profile",
]

MIB = 1024 * 1024

DEFAULT_PROFILE: dict[str, Any] = {  # a profile as check_profile returns it (JSON values)
    "format": FORMAT,
    "version": VERSION,
    "model_fingerprint": "default:8b-class-bf16",
    "device": "unspecified",
    # An instantiated graph of a 32-layer decoder (piecewise graphs: one piece per layer) plus
    # the buffers it keeps alive: a few MiB.
    "per_graph_bytes": 4.0 * MIB,
    # Largest live intermediates per token of a Llama-3-8B layer in bf16: gate/up projection
    # (2 x 14336 x 2 B), the activation output (14336 x 2 B), and a few hidden-size tensors.
    "per_token_bytes": 112.0 * 1024,
    "base_bytes": 0.0,
    "samples": [],
}
"""Used when no calibrated profile is given; calibrate with the runtime for real numbers."""

DEFAULT_SHARDED_PER_TOKEN_BYTES = 84.0 * 1024
"""The part of the default ``per_token_bytes`` that tensor parallelism splits (the gate/up
projection and the activation: columns of the MLP); the hidden-size tensors are whole on every
rank."""


def default_profile(tensor_parallel_size: int = 1) -> dict[str, Any]:
    """DEFAULT_PROFILE for one rank of a TP group: the MLP's intermediates are split ``tp`` ways.
    (A calibrated profile is measured on one rank of its TP size already.)"""
    if tensor_parallel_size == 1:
        return DEFAULT_PROFILE
    whole = DEFAULT_PROFILE["per_token_bytes"] - DEFAULT_SHARDED_PER_TOKEN_BYTES
    return {
        **DEFAULT_PROFILE,
        "model_fingerprint": f"default:8b-class-bf16-tp{tensor_parallel_size}",
        "per_token_bytes": whole + DEFAULT_SHARDED_PER_TOKEN_BYTES / tensor_parallel_size,
    }


DEFAULT_CAPTURE_SECONDS = 0.1
"""Seconds per graph when no calibration measured it: an order of magnitude for an 8B-class model
(a warm-up run plus a capture of tens of kernels per layer); the tiny Llama of the benchmarks
takes 0.009-0.014 s per graph on an H100 (bench/results/capture_bench.md: 51 graphs in
0.44-0.71 s). Calibrate for real numbers."""


def capture_model(profile: dict | None) -> tuple[float, float, str]:
    """(base seconds, seconds per graph, where they come from)."""
    if profile is not None and "per_graph_capture_seconds" in profile:
        return (
            profile.get("base_capture_seconds", 0.0),
            profile["per_graph_capture_seconds"],
            profile.get("source", "the given profile"),
        )
    return 0.0, DEFAULT_CAPTURE_SECONDS, f"the default {DEFAULT_CAPTURE_SECONDS:g} s per graph"


def capture_seconds(profile: dict | None, num_graphs: int) -> float:
    """Estimated seconds to capture ``num_graphs`` graphs (0 for none)."""
    base, per_graph, _ = capture_model(profile)
    return base + per_graph * num_graphs if num_graphs > 0 else 0.0


def fit_profile(samples, model_fingerprint: str, device: str) -> dict:
    """Least-squares fit of ``bytes = per_graph + per_token * num_tokens`` to single-graph samples.

    Needs at least 2 samples at 2 distinct token counts. A negative coefficient (noise) is clamped
    to 0 and the other refitted alone, so the profile never predicts negative bytes.
    """
    pts = _samples(samples, "fit_profile")
    if len({n for n, _ in pts}) < 2:
        raise ProfileError(
            "fit_profile: need samples at >= 2 distinct num_tokens to separate the "
            f"per-graph from the per-token cost (got {len(pts)} sample(s))"
        )
    n, b = np.array(pts, dtype=np.float64).T
    (per_graph, per_token), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), b, rcond=None)
    if per_token < 0:
        per_graph, per_token = float(b.mean()), 0.0
    elif per_graph < 0:
        per_graph, per_token = 0.0, float((n * b).sum() / (n * n).sum())
    return {
        "format": FORMAT,
        "version": VERSION,
        "model_fingerprint": str(model_fingerprint),
        "device": str(device),
        "per_graph_bytes": float(per_graph),
        "per_token_bytes": float(per_token),
        "base_bytes": 0.0,
        "samples": pts,
    }


def activation_bytes(profile: dict, largest: dict) -> float:
    """The pool's activation blocks: the largest need of any mode (``largest``: mode name ->
    its largest graph's tokens). A PIECEWISE graph holds one piece's activations at a time, so
    its per-token cost is its own (``piecewise_per_token_bytes``; the FULL cost when absent)."""
    per_token = {
        "FULL": profile["per_token_bytes"],
        "PIECEWISE": profile.get("piecewise_per_token_bytes", profile["per_token_bytes"]),
    }
    return max((per_token[m] * t for m, t in largest.items()), default=0.0)


def pool_bytes(profile: dict, num_graphs: int, largest: dict) -> float:
    """The model itself: one-time cost + per-graph overhead for every graph + the activations
    of the largest graph (per mode, see activation_bytes)."""
    if num_graphs <= 0:
        return 0.0
    return (
        profile.get("base_bytes", 0.0)
        + profile["per_graph_bytes"] * num_graphs
        + activation_bytes(profile, largest)
    )


def estimate(table: DispatchTable, profile: dict | None = None) -> dict:
    """Estimated pool bytes for a compiled table: total, per mode, and the arithmetic in words.

    ``per_mode[m]["bytes"]`` is what that mode's graphs would need alone in their own pool; the
    modes share one pool, so ``total_bytes`` is not their sum.
    """
    default = profile is None
    tp = table.settings.tensor_parallel_size
    world = tp * table.settings.data_parallel_size
    if profile is None:
        prof = default_profile(tp)
    else:
        prof = check_profile(profile, profile.get("source", "<profile>"))
    per_mode: dict[str, dict] = {}
    for g in table.graphs:
        m = per_mode.setdefault(g.mode.name, {"graphs": 0, "largest_tokens": 0})
        m["graphs"] += 1
        m["largest_tokens"] = max(m["largest_tokens"], g.key.num_tokens)
    for name, m in per_mode.items():
        m["bytes"] = int(round(pool_bytes(prof, m["graphs"], {name: m["largest_tokens"]})))
    n = len(table.graphs)
    largest_of = {name: m["largest_tokens"] for name, m in per_mode.items()}
    top_mode = max(
        largest_of, key=lambda k: activation_bytes(prof, {k: largest_of[k]}), default="FULL"
    )
    largest = largest_of.get(top_mode, 0)
    per_token = (
        prof["per_token_bytes"]
        if top_mode == "FULL"
        else prof.get("piecewise_per_token_bytes", prof["per_token_bytes"])
    )
    overhead = prof["per_graph_bytes"] * n
    activations = activation_bytes(prof, largest_of) if n else 0.0
    total = int(round(pool_bytes(prof, n, largest_of)))
    source = (profile or {}).get("source", "the given profile")
    where = (
        "the built-in default profile (an 8B-class bf16 guess; calibrate with the runtime "
        "and pass --profile for real numbers)"
        if default
        else f"{source} (model {prof['model_fingerprint']}, device {prof['device']})"
    )
    base = prof.get("base_bytes", 0.0) if n else 0.0
    explanation = (
        (f"{base / MIB:.1f} MiB once per pool, + " if base else "")
        + f"{n} graphs x {prof['per_graph_bytes'] / MIB:.2f} MiB per graph = "
        f"{overhead / MIB:.1f} MiB, "
        f"+ activations of the largest graph only ({largest} tokens {top_mode} x "
        f"{per_token / 1024:.1f} KiB per token = {activations / MIB:.1f} MiB), "
        f"because every graph shares one pool captured largest first and smaller graphs reuse "
        f"its blocks; total {total / MIB:.1f} MiB, from {where}."
    )
    cap_base, cap_per_graph, cap_source = capture_model(profile)
    return {
        "total_bytes": total,
        "total_mib": total / MIB,
        "capture_seconds": capture_seconds(profile, n),
        "capture_explanation": f"{n} graphs x {cap_per_graph:.3g} s"
        + (f" + {cap_base:.3g} s once" if cap_base else "")
        + f", from {cap_source}",
        "num_graphs": n,
        "largest_graph_tokens": largest,
        "overhead_bytes": int(round(overhead)),
        "activation_bytes": int(round(activations)),
        "per_mode": per_mode,
        "tensor_parallel_size": tp,
        "world_size": world,
        "per_rank": (
            f"Each of the {world} ranks (DP {world // tp} x TP {tp}) captures these graphs into "
            f"its own pool, in parallel: the figures above are per rank; the model's weights "
            f"and KV cache (not in this estimate) are split {tp} ways on each rank."
            if world > 1
            else ""
        ),
        "profile": {
            "default": default,
            "source": "built-in default" if default else source,
            "model_fingerprint": prof["model_fingerprint"],
            "device": prof["device"],
            "per_graph_bytes": prof["per_graph_bytes"],
            "per_token_bytes": prof["per_token_bytes"],
            "base_bytes": prof.get("base_bytes", 0.0),
        },
        "explanation": explanation,
    }


def estimate_lines(est: dict) -> list[str]:
    per = " per rank" if est.get("world_size", 1) > 1 else ""
    out = [
        f"graph memory (estimate): {est['total_mib']:.1f} MiB{per} for {est['num_graphs']} graphs"
    ]
    for mode, m in sorted(est["per_mode"].items()):
        out.append(
            f"  {mode:<10} {m['graphs']:>5} graphs, largest {m['largest_tokens']} tokens, "
            f"{m['bytes'] / MIB:.1f} MiB alone"
        )
    out.append(f"  {est['explanation']}")
    out.append(
        f"capture time (estimate): {est['capture_seconds']:.2f} s{per} "
        f"({est['capture_explanation']})"
    )
    if est.get("per_rank"):
        out.append(f"  {est['per_rank']}")
    return out
