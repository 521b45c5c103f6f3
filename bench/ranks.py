"""Run a benchmark worker on several local ranks (one process each) and collect what they wrote."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""NVLink multicast stays off on the device machines (their KINDS.md says why); a value already
set in the environment wins."""


def multicast_off() -> None:
    """Set MULTICAST_OFF in this process's environment, which spawned ranks inherit; NCCL reads
    it when a communicator is created, so this must run before the process group is."""
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)


def spawn_ranks(worker, ranks: int, a) -> list[dict]:
    """``worker(rank, ranks, a, out_dir)`` in ``ranks`` spawned processes, ``a.init`` set to a
    free TCP rendezvous on 127.0.0.1; each rank writes ``out_dir/rank{r}.json``, returned in
    rank order."""
    import torch.multiprocessing as mp

    multicast_off()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        a.init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(ranks, a, tmp), nprocs=ranks, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
