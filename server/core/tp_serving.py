"""Tensor-parallel serving, rank 0's side (docs/semantics.md §7.7): graphplan-serve with a plan
whose ``parallel.tensor_parallel_size`` is N > 1. The engine process is rank 0: it schedules,
samples and talks to the front ends as with one rank, and before each step sends the step's
batch, and each seat it releases, to the N-1 worker ranks (server/wire/ranks.py; the workers are
server/core/tp_worker.py), so every rank runs the same collectives in the same order.

The engine process starts the workers (not the supervisor): they are its children, so the
parent-death signal ends every one of them whenever rank 0 ends (SIGKILL included; a worker
blocked in a collective is killed, never waited on), and a worker's death ends rank 0 at once
(exit 1), which the supervisor already treats as the engine's death: open streams get an error,
/healthz says 503 and the server exits 1. The supervisor still watches one process.

What TP changes in the engine: steps are synchronous (async scheduling off: a speculated step's
tokens would have to reach the workers too), the LM head runs inside every rank's step
(``logits="all"``: its all-gather), plan reloads are refused, and the ranks agree on the smallest
KV pool among them. Prefix caching stays on, as in vLLM: rank 0's scheduler alone decides the KV
blocks (cached ones included), and each step message carries the blocks each request's seat got
since the last step (``Ranks.step``), which the followers' pools take as they are."""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from graphplan.compiler.errors import GraphplanError

from ..wire.procs import end, spawn
from ..wire.ranks import StepSender
from .tp_worker import (
    JOIN_TIMEOUT,
    RankConfig,
    agree_blocks,
    init_groups,
    rank_device,
    tp_group,
    worker_main,
)

log = logging.getLogger("graphplan.server")


def check_serving(table, *, device: str, processes: bool, speculative: Any, compile: str) -> None:
    """Refuse, by name and with the fix, what tensor-parallel serving does not run (before any
    process starts); nothing for a plan of one rank."""
    tp = table.settings.tensor_parallel_size
    if tp == 1:
        return
    where = f"plan {table.settings.name!r}: parallel.tensor_parallel_size={tp}"
    if not processes:
        raise GraphplanError(
            f"{where} runs one process per rank: drop --single-process (or serve with "
            "--set parallel.tensor_parallel_size=1)"
        )
    if speculative is not None:
        raise GraphplanError(
            f"{where} with --speculative-config: the worker ranks would not see the drafts or the "
            "rejected tokens' KV blocks; drop --speculative-config, or serve with "
            "--set parallel.tensor_parallel_size=1"
        )
    if compile:
        raise GraphplanError(f"{where} with --compile is not built: drop --compile")
    d = torch.device(device)
    if d.type == "cuda":
        first, have = d.index or 0, torch.cuda.device_count()
        if first + tp > have:
            raise GraphplanError(
                f"{where} puts rank r on cuda:{first}+r, but this machine has {have} CUDA "
                f"device(s): use a plan with tensor_parallel_size <= {max(have - first, 1)}"
            )


class Ranks:
    """Rank 0's worker processes, its place in the ranks' groups and its messages to them."""

    def __init__(
        self,
        table: Any,
        source: str,
        overrides: dict | None,
        engine_kwargs: dict,
        dp_rank: int = 0,
    ):
        self.table, self.size = table, table.settings.tensor_parallel_size
        self.device = engine_kwargs["device"]
        self.sender: StepSender | None = None
        self.kv: Any = None  # rank 0's KV pool (BlockTables): the blocks the followers are sent
        self.sent: dict[int, int] = {}  # seat -> blocks of its row the followers have
        self.messages: Any = None
        self.stopping = False
        self.store = dist.TCPStore(
            "127.0.0.1", 0, self.size, True, timeout=JOIN_TIMEOUT, wait_for_workers=False
        )
        self.procs: list[Any] = []
        self.reports: list[Any] = []
        for r in range(1, self.size):
            recv, send = mp.get_context("spawn").Pipe(duplex=False)
            cfg = RankConfig(
                rank=r,
                size=self.size,
                port=self.store.port,
                source=source,
                overrides=overrides,
                spec=engine_kwargs["spec"],
                device=rank_device(self.device, r),
                on_demand=engine_kwargs.get("on_demand"),
                log_level=log.getEffectiveLevel(),
                dp_rank=dp_rank,
            )
            self.procs.append(spawn(worker_main, cfg, send, name=f"graphplan-tp-{r}"))
            send.close()  # the worker holds the sending end now
            self.reports.append(recv)
        log.info(
            "tensor parallelism: %d ranks (worker rank pids %s); steps are synchronous (async "
            "scheduling off); rank 0 decides every KV block (prefix caching as configured)",
            self.size,
            ", ".join(str(p.pid) for p in self.procs),
        )

    def engine_kwargs(self, kwargs: dict) -> dict:
        """The engine's arguments on rank 0: synchronous steps, and a spec whose ``build`` joins
        the ranks and loads rank 0's shard."""
        return {**kwargs, "async_scheduling": False, "spec": RankZeroSpec(kwargs["spec"], self)}

    def join(self) -> Any:
        """Join the ranks (on the engine thread, at start-up) and greet them with the table's
        fingerprint; rank 0's ``TPGroup``."""
        device = torch.device(rank_device(self.device, 0))
        group, self.messages = init_groups(self.store, 0, self.size, device)
        self.sender = StepSender(self.messages)
        self.sender.hello(self.table.fingerprint)
        return tp_group(0, self.size, group, device, self.messages)

    def step(self, batch: Any) -> None:
        """Each of rank 0's steps, once its ``make_batch`` reserved the step's blocks and before
        it runs (server/core/pipeline.py), with each seat's new blocks: from the first the
        followers do not have (a sequence starting at 0, or a seat released since: the row)."""
        assert self.sender is not None
        blocks = None
        if self.kv is not None:
            blocks = []
            for seat, start, _ in batch.reqs:
                held = int(self.kv.held[seat])
                first = 0 if start == 0 else min(self.sent.get(seat, 0), held)
                blocks.append((first, self.kv.table[seat, first:held].tolist()))
                self.sent[seat] = held
        self.sender.step(batch.reqs, batch.num_reqs, batch.max_query_len, blocks)

    def pool(self, pool: Any) -> Any:
        """The batcher's view of rank 0's KV pool: each seat it releases goes to the workers."""
        self.kv = pool
        return _ReleasingPool(pool, self) if pool is not None else None

    def watch(self, core: Any) -> None:
        """End rank 0 (exit 1) when a worker dies while serving; at start-up, first tell the
        front ends why (the worker's one line)."""
        threading.Thread(
            target=self._watch, args=(core,), name="graphplan-tp-watch", daemon=True
        ).start()

    def _watch(self, core: Any) -> None:
        live = {p.sentinel: (r + 1, p, self.reports[r]) for r, p in enumerate(self.procs)}
        while live:
            for s in multiprocessing.connection.wait(list(live)):
                rank, p, report = live.pop(s)
                if self.stopping:
                    continue
                why = f"tensor-parallel rank {rank} died (exit code {p.exitcode})"
                try:
                    why = report.recv() if report.poll() else why
                except (EOFError, OSError):
                    pass
                log.error("%s: ending the engine process and every rank", why)
                if core.engine.state == "starting":
                    core.broadcast(state="failed", error=why)
                    time.sleep(0.5)  # the message leaves before the process does
                logging.shutdown()
                os._exit(1)

    def stop(self, served: bool) -> None:
        """After the engine thread ended: tell the workers to stop and wait for them (``served``:
        the engine drained), else kill them."""
        self.stopping = True
        if served and self.sender is not None:
            try:
                self.sender.stop()
            except RuntimeError as e:  # a worker already gone
                log.warning("tensor-parallel stop: %s", e)
        for p in self.procs:
            if served:
                end(p, 10)
            else:
                p.kill()
                p.join(2)


class _ReleasingPool:
    """Rank 0's KV pool (``paged_kv.BlockTables``) as the batcher sees it: ``release`` also tells the
    worker ranks. The members of ``BlockPool`` and ``prefix_blocks.PrefixPool`` are defined here,
    not only reached through ``__getattr__``: since Python 3.12 a runtime-checkable protocol's
    ``isinstance`` looks members up statically, and a proxy without them turned prefix caching off
    under TP without a word."""

    def __init__(self, pool: Any, ranks: Ranks):
        self._pool, self._ranks = pool, ranks
        self.block_size: int = pool.block_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def release(self, seat: int) -> None:
        assert self._ranks.sender is not None
        self._ranks.sender.release(seat)
        self._ranks.sent.pop(seat, None)
        self._pool.release(seat)

    def num_free(self) -> int:
        return self._pool.num_free()

    def truncate(self, seat: int, num_tokens: int) -> None:
        self._pool.truncate(seat, num_tokens)

    def enable_prefix_caching(self) -> None:
        self._pool.enable_prefix_caching()

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        return self._pool.lookup(keys)

    def free_cost(self, blocks: Sequence[int]) -> int:
        return self._pool.free_cost(blocks)

    def attach(self, seat: int, blocks: Sequence[int]) -> None:
        self._pool.attach(seat, blocks)

    def register(self, seat: int, keys: Sequence[bytes], first: int = 0) -> None:
        self._pool.register(seat, keys, first)


class RankZeroSpec:
    """The served spec on rank 0: every member is the spec's, but ``build`` joins the ranks and
    builds rank 0's shard (a ``ServingSpec``)."""

    def __init__(self, spec: Any, ranks: Ranks):
        self._spec, self._ranks = spec, ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spec, name)

    def build(self, table: Any, device: Any, tp: Any = None) -> Any:
        model = self._spec.build(table, device, tp=self._ranks.join())
        agree_blocks(model, self._ranks.messages)
        return model
