"""Graph backends: real CUDA graphs, and a CPU stand-in that CI can run.

Both capture a zero-argument function that reads static input buffers and writes static output
buffers, and replay it later. Both can also capture a *segment*: whatever runs between
``open_segment()`` and the segment's ``close()`` (the run-time split,
``runtime/piecewise/graphs.py``, ends a segment at each splitting op, so a segment's code is not
one function). The stand-in is
**not** a graph: it records the function (a segment: its aten calls) and re-runs it on the same
buffers at replay, so aliasing, padding and slicing bugs in the runner show up on the CPU
exactly as they would with CUDA graphs (a graph, too, only sees the buffers it was captured on).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Graph(Protocol):
    """A captured graph (or segment): replay reruns it on the buffers it was captured with."""

    def replay(self) -> None: ...


class Segment(Protocol):
    """An open segment capture: ``close`` ends it and returns its graph."""

    def close(self) -> Graph: ...

    def abort(self) -> None: ...


class GraphBackend(Protocol):
    """What capture and the run-time split need from a backend (CUDA graphs or the stand-in)."""

    name: str
    device: torch.device

    def capture(self, fn: Callable[[], None]) -> Graph: ...

    def open_segment(self) -> Segment: ...

    def memory_used(self) -> int: ...

    def synchronize(self) -> None: ...

    def release(self) -> None: ...


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

    def open_segment(self) -> "CudaSegment":
        """Begin capturing whatever runs next on this thread (into the shared pool)."""
        return CudaSegment(self)

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


class CudaSegment:
    """An open CUDA graph capture (what ``torch.cuda.graph`` does on entry and exit, split in two
    calls, so that a capture can end in code other than the one that began it)."""

    def __init__(self, backend: CudaGraphs):
        torch.cuda.synchronize(backend.device)
        torch.cuda.empty_cache()
        self.graph = torch.cuda.CUDAGraph()
        self.stream = torch.cuda.stream(backend.stream)
        self.stream.__enter__()
        try:
            self.graph.capture_begin(pool=backend.pool)
        except BaseException:
            self.stream.__exit__(None, None, None)
            raise

    def close(self) -> torch.cuda.CUDAGraph:
        try:
            self.graph.capture_end()
        finally:
            self.stream.__exit__(None, None, None)
        return self.graph

    def abort(self) -> None:
        """End a capture that failed; the graph is dropped (CUDA may have invalidated it)."""
        try:
            self.close()
        except Exception:
            pass


class HostSyncInCapture(RuntimeError):
    """The CPU stand-in met an op that a CUDA graph cannot contain (a host sync or a data-dependent
    output shape); CUDA reports the same as 'operation not permitted when stream is capturing'."""

    def __init__(self, op: str):
        super().__init__(f"{op} syncs the host or has a data-dependent output shape")
        self.op = op


def _uncapturable(func, args) -> bool:
    """An op that syncs the host (``.item()``, ``bool(t)``) or whose output shape depends on data
    (``nonzero``); indexing counts only with a boolean mask (integer indices are fine)."""
    if torch.Tag.data_dependent_output in func.tags:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.index.Tensor:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return True


class _Tape(TorchDispatchMode):
    """Records every aten call of a segment with its tensors (kept alive: fixed addresses)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _uncapturable(func, args):
            raise HostSyncInCapture(str(func))
        out = func(*args, **kwargs)
        if not func.is_view:  # a view aliases its base: nothing to redo at replay
            self.calls.append((func, args, kwargs, out))
        return out


class TapeGraph:
    """CPU stand-in for a captured segment: replay redoes each recorded aten call on the recorded
    tensors, writing results into the tensors the capture produced (as a graph writes to the
    addresses it was captured with)."""

    __slots__ = ("calls",)

    def __init__(self, calls: list[tuple]):
        self.calls = calls

    def replay(self) -> None:
        for func, args, kwargs, out in self.calls:
            res = func(*args, **kwargs)
            if func.namespace == "c10d":  # a collective (tensor parallelism): done before the
                _wait(res)  # next op reads it, as the stream orders it on a GPU
            if res is out or not isinstance(out, (torch.Tensor, tuple, list)):
                continue  # in place (the op wrote into its argument), or no tensor result
            for dst, src in zip(out, res) if isinstance(out, (tuple, list)) else ((out, res),):
                if isinstance(dst, torch.Tensor) and dst is not src:
                    dst.copy_(src)


def _wait(res) -> None:
    """Wait on the c10d Work objects a collective op returned (Gloo runs them asynchronously)."""
    for r in res if isinstance(res, (tuple, list)) else (res,):
        if isinstance(r, torch.ScriptObject) and hasattr(r, "wait"):
            r.wait()


class TapeSegment:
    """An open stand-in segment: records aten calls until closed."""

    def __init__(self):
        self.tape = _Tape()
        self.tape.__enter__()

    def close(self) -> TapeGraph:
        self.tape.__exit__(None, None, None)
        return TapeGraph(self.tape.calls)

    def abort(self) -> None:
        self.tape.__exit__(None, None, None)


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

    def open_segment(self) -> TapeSegment:
        return TapeSegment()

    def memory_used(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        pass


def graph_backend(device: torch.device | str) -> GraphBackend:
    device = torch.device(device)
    return CudaGraphs(device) if device.type == "cuda" else CpuGraphStandIn(device)
