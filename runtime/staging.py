"""Host staging for a step's inputs: buffers allocated once and reused every step, each group of
inputs moved to the device in one copy.

A model's ``make_batch`` writes its host-side inputs (token ids, positions, slots, block tables...)
straight into a staging buffer through a numpy view, then sends the filled prefix to the device.
On CUDA the buffers are pinned, so the copy is a DMA ordered on the current stream that the host
does not wait for (``non_blocking``): no ``pin_memory()`` of fresh tensors every step
(``buffers.to_device``'s way, an allocation, a copy and an event per input).

A pinned buffer may be overwritten only once the copy out of it is done. With async scheduling
(server/pipeline.py) step N+1's batch is built while step N's copy may still wait on the device,
so each ``PinnedStaging`` keeps two buffers used in turn, and an event recorded after each copy;
a turn waits on its own last event before it writes (step N's copy is long done by the time
step N+2 is built: N's tokens were read in between, so the wait costs nothing), as
server/step_sampler.py does for its staging.

On the CPU nothing is pinned and there is nothing to wait for; ``send`` returns a copy, so a batch
stays valid after the next one is built, as on CUDA.
"""

from __future__ import annotations

import numpy as np
import torch

TURNS = 2
"""Buffers used in turn: the one being filled, and the one whose copy may be in flight."""

ALIGN_BYTES = 16
"""Parts of a group start at multiples of this (views the kernels read stay aligned)."""


def aligned(n: int, dtype: torch.dtype) -> int:
    """``n`` elements rounded up to whole ``ALIGN_BYTES``."""
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-n // per) * per


class PinnedStaging:
    """One group of inputs of one dtype: ``TURNS`` host buffers of ``capacity`` elements (pinned
    on CUDA), grown (never shrunk) when a step needs more. Per step: ``host(n)`` the buffer to
    fill, then ``send(n)`` its first ``n`` elements on the device."""

    def __init__(self, dtype: torch.dtype, capacity: int, device: torch.device | str):
        self.dtype, self.device = dtype, torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._bufs: list[torch.Tensor] = []
        self._views: list[np.ndarray] = []
        for _ in range(TURNS):
            self._bufs.append(self._new(max(1, capacity)))
            self._views.append(self._bufs[-1].numpy())
        self._events = [torch.cuda.Event() if self.pinned else None for _ in range(TURNS)]
        self._turn = TURNS - 1
        self.allocations = TURNS
        """Host buffers allocated so far (``TURNS`` until a step outgrows the capacity)."""

    def _new(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=self.dtype, pin_memory=self.pinned)

    @property
    def capacity(self) -> int:
        return min(b.numel() for b in self._bufs)

    def host(self, n: int) -> np.ndarray:
        """The next turn's buffer (a numpy view of ``>= n`` elements) to write a step's inputs
        into, once the copy out of it that an earlier step started is done."""
        self._turn = (self._turn + 1) % TURNS
        i = self._turn
        event = self._events[i]
        if event is not None:
            event.synchronize()  # that step's copy was done long ago with async scheduling
        if self._bufs[i].numel() < n:  # its old copy is done: drop it for a larger one
            self._bufs[i] = self._new(max(n, 2 * self._bufs[i].numel()))
            self._views[i] = self._bufs[i].numpy()
            self.allocations += 1
        return self._views[i]

    def send(self, n: int, *, non_blocking: bool = False) -> torch.Tensor:
        """The first ``n`` elements of the buffer ``host`` gave, as a new tensor on the device:
        one copy (on CUDA ordered on the current stream, the host waiting for nothing when
        ``non_blocking``)."""
        if not self.pinned:  # numpy's copy: one memcpy, not torch's copy parallel over threads
            return torch.from_numpy(self._views[self._turn][:n].copy()).to(self.device)
        src = self._bufs[self._turn][:n]
        out = torch.empty(n, dtype=self.dtype, device=self.device)
        out.copy_(src, non_blocking=non_blocking)
        event = self._events[self._turn]
        assert event is not None
        event.record(torch.cuda.current_stream(self.device))
        return out

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs)
