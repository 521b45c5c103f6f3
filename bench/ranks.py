"""Run a benchmark worker on several local ranks (one process each) and collect what they wrote."""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path


def spawn_ranks(worker, ranks: int, a) -> list[dict]:
    """``worker(rank, ranks, a, out_dir)`` in ``ranks`` spawned processes, ``a.init`` set to a
    free TCP rendezvous on 127.0.0.1; each rank writes ``out_dir/rank{r}.json``, returned in
    rank order."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        a.init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(ranks, a, tmp), nprocs=ranks, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
