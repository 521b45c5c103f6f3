"""torch's symmetric-memory one-shot all-reduce for a tensor-parallel group's small messages
(``TPGroup.symm``): off unless asked for (``symm_reducer``); NCCL keeps every other message.

One buffer of ``max_bytes`` is allocated from symmetric memory and exchanged with the peers once,
at start-up (a rendezvous cannot happen inside a CUDA graph); each all-reduce copies its message
into the buffer's head, runs ``torch.ops.symm_mem.one_shot_all_reduce`` on it and copies the sum
back: three kernels, all capturable. NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST,
bench/ranks.py). Which sizes go this way is the device's measurement (bench/allreduce_bench.py):
``max_bytes`` from ``GRAPHPLAN_TP_SYMM_MAX_BYTES`` or ``DEFAULT_MAX_BYTES``."""

from __future__ import annotations

import os

import torch

MAX_BYTES_ENV = "GRAPHPLAN_TP_SYMM_MAX_BYTES"
DEFAULT_MAX_BYTES = 1 << 20
"""Messages up to this size (bf16 [64, 8192] is 1 MiB) use symmetric memory when it is on."""


def max_bytes_from_env(environ=os.environ) -> int:
    """``GRAPHPLAN_TP_SYMM_MAX_BYTES`` (a non-negative integer of bytes), else the default;
    ValueError naming the variable for anything else."""
    raw = environ.get(MAX_BYTES_ENV)
    if raw is None or raw == "":
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{MAX_BYTES_ENV}={raw!r}: a non-negative integer of bytes, e.g. 1048576")
    return value


class SymmAllReduce:
    """The one-shot all-reduce of messages up to ``max_bytes`` of ``dtype`` (module docstring)."""

    def __init__(self, group, device: torch.device, max_bytes: int, dtype=torch.bfloat16):
        import torch.distributed._symmetric_memory as symm_mem

        self.name = group.group_name
        self.buf = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, self.name)

    def takes(self, x: torch.Tensor) -> bool:
        return (
            x.is_cuda
            and x.dtype == self.buf.dtype
            and x.is_contiguous()
            and 0 < x.numel() <= self.buf.numel()
        )

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        head = self.buf[: x.numel()]  # offset 0 in the symmetric allocation
        head.copy_(x.reshape(-1))
        x.copy_(torch.ops.symm_mem.one_shot_all_reduce(head, "sum", self.name).view_as(x))
        return x


def symm_reducer(group, device, max_bytes: int | None = None) -> SymmAllReduce | None:
    """A SymmAllReduce for ``group`` on ``device``, or None (NCCL/Gloo for every message) on a
    CPU, with ``max_bytes`` 0, or where symmetric memory is unavailable (its error is not
    raised: the collectives fall back, as documented)."""
    device = torch.device(device)
    limit = max_bytes_from_env() if max_bytes is None else max_bytes
    if device.type != "cuda" or group is None or limit <= 0:
        return None
    try:
        return SymmAllReduce(group, device, limit)
    except Exception:  # no symmetric memory here (driver, build): NCCL it is
        return None
