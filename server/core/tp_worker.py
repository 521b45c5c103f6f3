"""A tensor-parallel worker rank of graphplan-serve (docs/semantics.md §7.7): a process the engine
process (rank 0) starts for each rank 1..N-1 (server/core/tp_serving.py). It joins the ranks'
process groups over a TCP store on loopback (NCCL for the model's collectives on CUDA, rank r on
``cuda:(base + r)``, and a Gloo group for rank 0's messages; Gloo for both on the CPU), checks
rank 0's table fingerprint against its own before loading anything, loads only its shard
(models/hf/tp_load.py), captures the same graphs as rank 0, then follows rank 0's steps
(server/wire/ranks.py's ``follow``) until rank 0 says stop (exit 0).

It ends with rank 0: the parent-death signal (a worker blocked in a collective is killed, never
waited on), and it ignores the terminal's and ``timeout``'s process-group signals as the engine
process does. A start-up failure is one line, sent to rank 0 (which reports it as the engine's
failure) and logged, with exit code 1 and no traceback."""

from __future__ import annotations

import datetime
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..wire.procs import die_with_parent
from ..wire.ranks import follow, receive_hello

log = logging.getLogger("graphplan.server")

IDLE_TIMEOUT = datetime.timedelta(days=30)
"""The message group's collective timeout: a worker waits in a broadcast for rank 0's next step
however long the server is idle (a rank 0 that dies ends it by the parent-death signal)."""
JOIN_TIMEOUT = datetime.timedelta(minutes=10)
"""How long the ranks wait for each other at start-up (every rank loads its shard meanwhile)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankConfig:
    """What a worker rank is started with (pickled by multiprocessing's spawn)."""

    rank: int
    size: int
    port: int
    """The TCP store's port on 127.0.0.1 (rank 0 holds the store)."""
    source: str
    overrides: dict | None
    spec: Any
    """The served ``ServingSpec`` (its ``build(table, device, tp=...)`` loads this rank's shard)."""
    device: str
    """This rank's device (``rank_device``)."""
    on_demand: bool | None
    log_level: int = logging.INFO
    dp_rank: int = 0
    """Data parallelism (a DP x TP plan): the DP rank of this worker's engine."""


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device when the server runs on ``device``: ``cuda:(index + rank)`` on
    CUDA, the CPU for every rank on the CPU."""
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


def init_groups(store: Any, rank: int, size: int, device: torch.device) -> tuple[Any, Any]:
    """Join the ranks: (the model's group, the messages' Gloo group)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=size, device_id=device, timeout=JOIN_TIMEOUT
        )
        return dist.group.WORLD, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    return dist.group.WORLD, dist.group.WORLD


def agree_blocks(model: Any, messages: Any) -> None:
    """Every rank hands out the smallest KV pool among them (each sized its own from its free
    memory), so that a follower's blocks always hold what rank 0's batcher admits."""
    pool = model.kv_pool
    n = torch.tensor([pool.num_free()], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=messages)
    if int(n) < pool.num_free():
        log.info("KV pool: %d of this rank's %d blocks (the ranks' least)", int(n), pool.num_free())
        pool.limit(int(n))


def tp_group(rank: int, size: int, group: Any, device: torch.device, messages: Any) -> Any:
    """This rank's ``TPGroup``: on GPUs the all-reduces of messages up to
    ``GRAPHPLAN_TP_SYMM_MAX_BYTES`` (default 8 MiB; 0: NCCL for all) by torch symmetric memory,
    faster than NCCL at those sizes (bench/results/allreduce_bench.md), on every rank or none."""
    from graphplan.models.hf.tp import TPGroup
    from graphplan.models.hf.tp_symm import symm_reducer

    return TPGroup(rank, size, group, symm_reducer(group, device, agree=messages))


def _start(cfg: RankConfig) -> tuple[Any, Any, str, Any]:
    from .model import load_table
    from .plan_swap import capture_runner

    table = load_table(cfg.source, cfg.overrides)
    device = torch.device(cfg.device)
    store = dist.TCPStore("127.0.0.1", cfg.port, cfg.size, False, timeout=JOIN_TIMEOUT)
    group, messages = init_groups(store, cfg.rank, cfg.size, device)
    receive_hello(table.fingerprint, messages)  # before loading: another plan fails at once
    model = cfg.spec.build(table, device, tp=tp_group(cfg.rank, cfg.size, group, device, messages))
    agree_blocks(model, messages)
    runner = capture_runner(model, table, device, False, None, cfg.on_demand)
    if table.settings.data_parallel_size > 1:  # steps at rank 0's DP decisions
        from .dp_serving import worker_runner

        runner = worker_runner(runner, table, messages, cfg.dp_rank)
    return model, runner, table.fingerprint, messages


def worker_main(cfg: RankConfig, report: Any) -> None:
    """The worker rank process's target; ``report``: the sending end of a pipe to rank 0 (one
    line on a start-up failure)."""
    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a process group's signals
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(
        level=cfg.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s[tp-rank {cfg.rank}]: %(message)s",
    )
    try:
        model, runner, fingerprint, messages = _start(cfg)
    except Exception as e:  # a bad shard, another table, TP that does not divide the heads
        why = f"tensor-parallel rank {cfg.rank} ({cfg.device}): {type(e).__name__}: {e}"
        log.error("start-up failed: %s", why)
        report.send(why)
        logging.shutdown()
        os._exit(1)
    report.close()
    try:
        steps = follow(model, runner, fingerprint, messages, greeted=True)
    except Exception as e:  # rank 0 is gone (its death also ends this process), or a protocol error
        log.error("tensor-parallel rank %d stopped: %s: %s", cfg.rank, type(e).__name__, e)
        logging.shutdown()
        os._exit(1)
    log.info("tensor-parallel rank %d: stopped after %d steps", cfg.rank, steps)
    logging.shutdown()
    os._exit(0)  # no interpreter teardown: CUDA contexts and process groups end with the process
