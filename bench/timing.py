"""Steady-state step timing for the GPU benchmarks (a CPU device works too, for smoke runs)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def fresh_compile_caches(keep_set: bool = True) -> None:
    """Point inductor's and Triton's caches at new empty folders, so that a warm-up is measured
    cold (both read the variables when they first compile, not at import). ``keep_set``: a cache
    folder already named in the environment is kept."""
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        if not (keep_set and var in os.environ):
            os.environ[var] = tempfile.mkdtemp(prefix=f"gp-{var.lower()}-")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(fn, device: torch.device, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per call over ``iters`` back-to-back calls,
    after 3 warm-up calls; the device is synchronized only around each loop (steady state)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def graph_time_per_call(fn, device: torch.device, iters: int, repeats: int = 3) -> float:
    """GPU seconds per call of ``fn`` recorded once as a CUDA graph and replayed (no launch
    overhead in it; ``fn`` is run once outside the graph first). On a CPU: ``time_per_call``."""
    if device.type != "cuda":
        return time_per_call(fn, device, iters, repeats)
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    t = time_per_call(g.replay, device, iters, repeats)
    del g
    return t


def publish(text: str, out: str | None, append: bool = False) -> None:
    """Print a benchmark's markdown result, and write it to ``out`` (its folder made) if given;
    ``append``: after what the file holds (a blank line between records)."""
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        before = path.read_text() if append and path.exists() else ""
        path.write_text(before + ("\n" if before.strip() else "") + text + "\n")
