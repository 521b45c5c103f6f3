"""Graph backends: real CUDA graphs, and a CPU stand-in that CI can run.

Both capture a zero-argument function that reads static input buffers and writes static output
buffers, and replay it later. The stand-in is **not** a graph: it records the function and re-runs it
on the same buffers at replay, so aliasing, padding and slicing bugs in the runner show up on the CPU
exactly as they would with CUDA graphs (a graph, too, only sees the buffers it was captured on).
"""

from __future__ import annotations

from typing import Callable

import torch


class CudaGraphs:
    """torch.cuda.CUDAGraph captured into one shared memory pool on a side stream."""

    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=self.device)

    def capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            fn()
        torch.cuda.synchronize(self.device)
        return graph

    def memory_used(self) -> int:
        """Bytes the caching allocator holds on the device (the pool included). Cached free blocks
        are released first: ``torch.cuda.graph`` empties the cache on entry, which would otherwise
        show up as negative graph memory."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Drop the pool handle; graphs must already be dropped. Returns memory to the driver."""
        self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


class StandInGraph:
    """CPU stand-in for a captured CUDA graph: replay re-runs the recorded function."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class CpuGraphStandIn:
    """CPU stand-in backend (clearly not a CUDA graph): for CI and for debugging the runner."""

    name = "cpu-stand-in"

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def capture(self, fn: Callable[[], None]) -> StandInGraph:
        fn()  # a CUDA capture runs the Python once too: errors surface at capture, as on a GPU
        return StandInGraph(fn)

    def memory_used(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        pass


def graph_backend(device: torch.device):
    device = torch.device(device)
    return CudaGraphs(device) if device.type == "cuda" else CpuGraphStandIn(device)
