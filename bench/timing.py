"""Steady-state step timing for the GPU benchmarks (a CPU device works too, for smoke runs)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


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


def publish(text: str, out: str | None) -> None:
    """Print a benchmark's markdown result, and write it to ``out`` (its folder made) if given."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
