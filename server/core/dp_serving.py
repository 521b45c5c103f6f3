"""Data-parallel serving (docs/semantics.md §7.8): graphplan-serve with a plan whose
``parallel.data_parallel_size`` is D > 1 runs D engine processes (server/wire/supervisor.py), each
with its own scheduler, batcher, KV pool and sampler (and, with ``tensor_parallel_size`` T > 1, its
own T-1 worker ranks: server/core/tp_serving.py). The front ends route each request to one engine
and pin it there (server/wire/engines.py).

The engines' runners step together: each engine's runner is a ``DPRunner`` (runtime/dp/runner.py)
over a Gloo group of the D engines (rank-0s) on the CPU, built over a TCP store the supervisor
holds, beside each engine's own tensor-parallel world; every step is the DP agreement of
docs/semantics.md §7, so every engine runs each step at the agreed mode and padded size. An engine
with nothing to do while a peer has work runs the dummy step (``step(None)``), and under TP tells
its worker ranks to do the same (``DUMMY``, then the agreed decision: server/wire/ranks.py).

Waves (vLLM's DP "waves", vllm/v1/engine/coordinator.py): the engines step in waves. A wave
starts when any engine has work: that engine sends ``Wake(wave)`` to every peer's inbox, and a
peer woken for its current wave steps (dummy steps) too. A wave ends at the first step whose
agreement says no engine had work (``DPDecision.idle``): every engine sees the same decision, so
every one ends the wave at the same step, counts the next wave, and sleeps until work or a wake
for that wave arrives. A wake for a wave already ended is stale and ignored; one for the next
wave that arrives while an engine still finishes the current one is kept.

Leaving (a drain): engines leave only together, between waves. A stopping engine (it refuses new
requests already: its state is draining) that is between waves at wave w sends ``Leave(rank, w)``
to every peer and waits: woken for wave w by a peer that still has work, it steps with it (and
says ``Leave`` again at the next wave); once every peer said ``Leave`` for its own wave w, it
leaves. An engine that said ``Leave(w)`` starts no wave w (it has no work and gets none), so
when all D said it no engine starts wave w: none is left stepping alone, waiting in the exchange
for a peer that is gone. A request that reached one engine just before the drain is served, with
its peers' dummy steps, before any engine leaves.

What DP changes in an engine: reloads and LoRA adapter loads are refused (409: every engine would
have to switch together), speculative decoding and micro-batching (``parallel.ubatch``) are not
built, and an engine's runner is the ``DPRunner``. Async scheduling and prefix caching stay on:
they are each engine's own."""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

from graphplan.compiler.errors import GraphplanError

log = logging.getLogger("graphplan.server")

JOIN_TIMEOUT = datetime.timedelta(minutes=10)


def check_serving(table, *, device: str, processes: bool, speculative: Any) -> None:
    """Refuse, by name and with the fix, what data-parallel serving does not run (before any
    process starts); nothing for a plan of one DP rank."""
    s = table.settings
    dp, tp = s.data_parallel_size, s.tensor_parallel_size
    if dp == 1:
        return
    where = f"plan {s.name!r}: parallel.data_parallel_size={dp}"
    fix = "or serve with --set parallel.data_parallel_size=1"
    if not processes:
        raise GraphplanError(f"{where} runs one engine process per DP rank: drop --single-process")
    if speculative is not None:
        raise GraphplanError(f"{where} with --speculative-config is not built: drop it, {fix}")
    if s.ubatch.enabled:
        raise GraphplanError(
            f"{where} with parallel.ubatch.enabled is not built in graphplan-serve: "
            f"--set parallel.ubatch.enabled=false, {fix}"
        )
    d = torch.device(device)
    if d.type == "cuda":
        first, have = d.index or 0, torch.cuda.device_count()
        if first + dp * tp > have:
            raise GraphplanError(
                f"{where} x tensor_parallel_size={tp} puts engine d's rank r on "
                f"cuda:{first}+d*{tp}+r, but this machine has {have} CUDA device(s): use a plan "
                f"with data_parallel_size x tensor_parallel_size <= {max(have - first, 1)}"
            )


def engine_device(device: str, dp_rank: int, tp: int) -> str:
    """Engine ``dp_rank``'s device: ``cuda:(index + dp_rank * tp)`` (its TP ranks follow it), the
    CPU for every engine on the CPU."""
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + dp_rank * tp}"


def store(size: int) -> Any:
    """The DP group's TCP store on loopback (held by the supervisor, which outlives the engines)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, size, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)


class DPWave:
    """One engine's place among the DP engines: its DP group, its runner's wrapping and its
    waves (the module's docstring)."""

    def __init__(self, table: Any, rank: int, port: int, peers: list[str]):
        self.table, self.rank, self.size, self.port = table, rank, len(peers), port
        self.peers = [a for i, a in enumerate(peers) if i != rank]  # their inboxes
        self.wave = 0
        self.requested = -1  # the highest wave a peer woke this engine for
        self.running = False
        self.announced = -1  # the wave this engine said Leave for
        self.leaving: dict[int, int] = {}  # peer DP rank -> the wave it said Leave for
        self.engine: Any = None
        self.runner: Any = None
        self._sockets: list[Any] = []

    def attach(self, engine: Any) -> None:
        """Make ``engine``'s runner a ``DPRunner`` of this group, and its steps this group's."""
        self.engine = engine
        engine.pipeline.dp = self
        capture = engine.capture

        def dp_capture(table: Any) -> Any:
            self.runner = self._dp_runner(capture(table))
            return self.runner

        engine.capture = dp_capture

    def _dp_runner(self, runner: Any) -> Any:
        import torch.distributed as dist

        from graphplan.runtime.dp import DPCoordinator, DPRunner

        s = dist.PrefixStore(
            "graphplan-dp",
            dist.TCPStore("127.0.0.1", self.port, self.size, False, timeout=JOIN_TIMEOUT),
        )
        group = dist.ProcessGroupGloo(s, self.rank, self.size, JOIN_TIMEOUT)
        coord: Any = DPCoordinator.for_table(self.table, group, backend="gloo")
        tp = self.engine.pipeline.tp
        if tp is not None:  # its worker ranks take the decisions from here
            coord = RelayCoordinator(coord, tp.sender)
        log.info("data parallelism: engine %d of %d (a Gloo DP group)", self.rank, self.size)
        return DPRunner(runner, coord)

    # -- waves ------------------------------------------------------------------------------------
    def awake(self) -> bool:
        """In a wave, or woken for this one (read under the engine's condition)."""
        return self.running or self.requested >= self.wave

    def wake(self, wave: int) -> None:
        """A peer started ``wave`` (the engine process's main thread)."""
        cond = self.engine._cond
        with cond:
            if wave > self.requested:
                self.requested = wave
                cond.notify()

    def begin(self) -> None:
        """Before a step with work (the engine thread): start a wave, waking every peer."""
        if self.running:
            return
        self.running = True
        from ..wire import messages as m

        self._send(m.Wake(self.wave))

    def left(self, rank: int, wave: int) -> None:
        """Peer ``rank`` said Leave for ``wave`` (the engine process's main thread)."""
        cond = self.engine._cond
        with cond:
            self.leaving[rank] = max(wave, self.leaving.get(rank, -1))
            cond.notify()

    def leave(self) -> bool:
        """The engine is stopping (its thread, under its condition): True once every engine is
        between waves at this wave and said so (the module's docstring: Leaving); False when a
        peer woke it for this wave (step with it, then ask again)."""
        from ..wire import messages as m

        peers = [r for r in range(self.size) if r != self.rank]
        while not self.awake():
            if self.announced != self.wave:
                self.announced = self.wave
                self._send(m.Leave(self.rank, self.wave))
            if all(self.leaving.get(r) == self.wave for r in peers):
                log.info("data parallelism: every engine stops at wave %d: leaving", self.wave)
                return True
            self.engine._cond.wait()
        return False

    def _send(self, msg: Any) -> None:
        """To every peer's inbox (the engine thread)."""
        from ..wire import messages as m

        if not self._sockets:
            import zmq

            ctx: Any = zmq.Context.instance()
            for a in self.peers:
                s = ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.SNDHWM, 0)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(a)
                self._sockets.append(s)
        data = m.encoder.encode(msg)
        for s in self._sockets:
            s.send(data)

    def idle(self) -> None:
        """A loop without work (the engine thread): in a wave, the dummy step; the wave ends when
        no engine had work."""
        if not self.awake():
            return
        self.running = True
        tp = self.engine.pipeline.tp
        if tp is not None:
            assert tp.sender is not None
            tp.sender.dummy()
        with torch.no_grad():
            self.runner.step(None)
        if self.runner.last_decision.idle:
            with self.engine._cond:
                self.running = False
                self.wave += 1

    def metrics(self) -> str:
        """This engine's DP series (Prometheus text): steps by kind, waves, padding, sync time."""
        if self.runner is None:
            return ""
        c = self.runner.counts
        work = c["steps"] - c["dummy_steps"] - c["idle_steps"]
        lines = [
            "# HELP graphplan_dp_steps_total DP steps of this engine: with work, dummy (a peer "
            "had work), idle (no engine had work: a wave ended).",
            "# TYPE graphplan_dp_steps_total counter",
            f'graphplan_dp_steps_total{{kind="work"}} {work}',
            f'graphplan_dp_steps_total{{kind="dummy"}} {c["dummy_steps"]}',
            f'graphplan_dp_steps_total{{kind="idle"}} {c["idle_steps"]}',
            "# HELP graphplan_dp_padding_tokens_total Tokens run beyond this engine's own padding "
            "to match its DP peers.",
            "# TYPE graphplan_dp_padding_tokens_total counter",
            f"graphplan_dp_padding_tokens_total {c['dp_padding_tokens']}",
            "# HELP graphplan_dp_sync_seconds_total Time in the DP agreement's exchange.",
            "# TYPE graphplan_dp_sync_seconds_total counter",
            f"graphplan_dp_sync_seconds_total {self.runner.coord.sync_seconds}",
        ]
        return "\n".join(lines) + "\n"


class RelayCoordinator:
    """TP rank 0's DP coordinator: the group's, and each decision goes to the worker ranks."""

    def __init__(self, coord: Any, sender: Any):
        self._coord, self._sender = coord, sender

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coord, name)

    def sync(self, *column: int) -> Any:
        d = self._coord.sync(*column)
        self._sender.decision(d)
        return d

    def finish(self) -> Any:
        d = self._coord.finish()
        self._sender.decision(d)
        return d


class ReplayCoordinator:
    """A TP worker rank's DP coordinator: each step's decision is rank 0's (server/wire/ranks.py)."""

    backend = "relay"
    sync_seconds = 0.0

    def __init__(self, messages: Any, rank: int, size: int):
        self.messages, self.rank, self.size = messages, rank, size

    def sync(self, *column: int) -> Any:
        from ..wire.ranks import receive_decision

        return receive_decision(self.messages)

    def start(self, *column: int) -> None:
        pass

    def finish(self) -> Any:
        return self.sync()


def worker_runner(runner: Any, table: Any, messages: Any, dp_rank: int) -> Any:
    """A TP worker's runner in a DP x TP plan: a ``DPRunner`` that replays rank 0's decisions."""
    from graphplan.runtime.dp import DPRunner

    coord = ReplayCoordinator(messages, dp_rank, table.settings.data_parallel_size)
    return DPRunner(runner, coord, check_fingerprint=False)  # type: ignore[arg-type]
