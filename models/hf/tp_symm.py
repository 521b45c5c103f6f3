"""torch's symmetric-memory one- and two-shot all-reduces for a tensor-parallel group's messages
up to ``max_bytes`` (``TPGroup.symm``): graphplan-serve's ranks use it
(server/core/tp_worker.py), the benches and tests when asked (``symm_reducer``); NCCL keeps
larger messages and the all-gathers.

One buffer of ``max_bytes`` is allocated from symmetric memory and exchanged with the peers once,
at start-up (a rendezvous cannot happen inside a CUDA graph); each all-reduce copies its message
into the buffer's head, runs ``torch.ops.symm_mem.one_shot_all_reduce`` on it (each rank reads the
whole message from every peer) up to ``ONE_SHOT_MAX_BYTES``, ``two_shot_all_reduce_`` in place
above (each rank sums its 1/N of the message from every peer, then gathers the others' sums;
``GRAPHPLAN_TP_SYMM_ALGO`` one_shot or two_shot forces one), and copies the sum back: three
kernels, all capturable. NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST,
bench/ranks.py). Which sizes go this way is the device's measurement (bench/allreduce_bench.py,
bench/results/allreduce_bench.md: on 2 and 4 H200s, each alone in a graph, the two-shot was
1.3-2.9x faster than NCCL at every size from 8 KiB to 8 MiB): ``max_bytes`` from
``GRAPHPLAN_TP_SYMM_MAX_BYTES`` or ``DEFAULT_MAX_BYTES``."""

from __future__ import annotations

import os

import torch

MAX_BYTES_ENV = "GRAPHPLAN_TP_SYMM_MAX_BYTES"
DEFAULT_MAX_BYTES = 8 << 20
"""Messages up to this size (bf16 [512, 8192], a 70B decode step of 512 requests, is 8 MiB) use
symmetric memory when it is on: the largest size measured, still 1.3x faster than NCCL."""


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


ALGO_ENV = "GRAPHPLAN_TP_SYMM_ALGO"
ALGOS = ("auto", "one_shot", "two_shot")
DEFAULT_ALGO = "auto"
ONE_SHOT_MAX_BYTES = 64 << 10
"""auto: one-shot up to this size, two-shot above. In a TP=2 8B decode step on 2 H200s one-shot was
the faster for batch 1's 8 KiB messages (3.56 against 3.59 ms a step) and two-shot for batch 64's
512 KiB (5.43 against 5.49 ms), twice each in one run (bench/results/allreduce_bench.md)."""


def algo_from_env(environ=os.environ) -> str:
    """``GRAPHPLAN_TP_SYMM_ALGO`` (auto, one_shot or two_shot), else the default; ValueError
    naming the variable for anything else."""
    raw = environ.get(ALGO_ENV) or DEFAULT_ALGO
    if raw not in ALGOS:
        raise ValueError(f"{ALGO_ENV}={raw!r}: one of {', '.join(ALGOS)}")
    return raw


class SymmAllReduce:
    """The ``algo`` all-reduce of messages up to ``buf``'s size (module docstring): ``buf`` this
    rank's symmetric allocation, exchanged with the peers of ``group`` here."""

    def __init__(self, group, buf: torch.Tensor, algo: str = DEFAULT_ALGO):
        import torch.distributed._symmetric_memory as symm_mem

        self.name, self.buf = group.group_name, buf
        one_shot_max = {"auto": ONE_SHOT_MAX_BYTES, "one_shot": buf.nbytes, "two_shot": 0}
        self.one_shot_max = one_shot_max[algo]
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
        if x.nbytes <= self.one_shot_max:
            x.copy_(torch.ops.symm_mem.one_shot_all_reduce(head, "sum", self.name).view_as(x))
        else:  # in place in the buffer
            torch.ops.symm_mem.two_shot_all_reduce_(head, "sum", self.name)
            x.copy_(head.view_as(x))
        return x


def _allocate(device: torch.device, max_bytes: int, dtype=torch.bfloat16) -> torch.Tensor | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem

        return symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
    except Exception:  # no symmetric memory here (driver, build): NCCL it is
        return None


def symm_reducer(group, device, max_bytes: int | None = None, agree=None) -> SymmAllReduce | None:
    """A SymmAllReduce for ``group`` on ``device``, or None (NCCL/Gloo for every message) on a
    CPU, with ``max_bytes`` 0, or where symmetric memory is unavailable (its error is not
    raised: the collectives fall back, as documented).

    ``agree`` (a Gloo group of the same ranks; the server's): every rank uses symmetric memory
    or none does. Each allocates its buffer, the ranks take the least of their answers, and
    only then exchange the buffers; a rank without symmetric memory would otherwise leave its
    peers waiting in the exchange, or in the first all-reduce."""
    device = torch.device(device)
    limit = max_bytes_from_env() if max_bytes is None else max_bytes
    algo = algo_from_env()
    if device.type != "cuda" or group is None or limit <= 0:
        return None
    buf = _allocate(device, limit)
    if agree is not None:
        import torch.distributed as dist

        ok = torch.tensor([int(buf is not None)], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=agree)
        if int(ok) == 0 or buf is None:  # (every rank has a buffer when ok is 1)
            return None
        # the exchange's error is raised: the peers are in it too
        return SymmAllReduce(group, buf, algo)
    if buf is None:
        return None
    try:
        return SymmAllReduce(group, buf, algo)
    except Exception:
        return None
