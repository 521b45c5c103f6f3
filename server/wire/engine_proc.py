"""The engine core process: the in-process ``Engine`` (its engine thread owns the device, the
scheduler, the runner, the sampler and the KV blocks) behind ZeroMQ sockets.

The process's main thread reads the front ends' messages (one PULL socket) and hands them to the
engine: requests in, cancellations, reloads (each on a thread of its own: a capture takes a while),
metrics scrapes, the supervisor's ``Gone`` and ``Drain``. The engine thread's events leave
through one ``FrontendSink`` per front end: the engine's outbox groups a step's events by sink, so
each front end gets one ``Step`` message per engine step. It never waits on a front end (unbounded
send queues); a send goes under the sink's lock, as the main thread also answers calls.

The process ends with its parent: Linux's parent-death signal, and a check of the parent's pid
while idle. It ignores SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C, ``timeout`` or systemd signal
the whole process group: the server's supervisor decides, and drains it) and exits 0 once drained,
1 when its start-up failed."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

import zmq

from ..errors import RequestError
from ..requests import Event, Request
from . import messages as m
from .procs import die_with_parent

log = logging.getLogger("graphplan.server")


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """What the engine process is started with (pickled by multiprocessing's spawn)."""

    source: str
    overrides: dict | None
    engine_kwargs: dict
    """Engine(...)'s keyword arguments: spec, device, progress, max_waiting, on_demand, ..."""
    address: str
    frontends: list[str]
    log_level: int = logging.INFO
    dp_rank: int = 0
    """Data parallelism (server/core/dp_serving.py): this engine's DP rank, the DP group's store
    port on 127.0.0.1, and every engine's inbox (its Wake messages)."""
    dp_port: int = 0
    peers: tuple[str, ...] = ()


class FrontendSink:
    """One front end's events (an ``EventSink``): a step's events in one message."""

    def __init__(self, core: EngineCore, index: int, socket: zmq.Socket):
        self.core, self.index, self.socket = core, index, socket
        self.lock = threading.Lock()

    def put_many(self, items: list[Event]) -> None:
        live = self.core.live
        events = []
        for rid, kind, value in items:
            r = live.get((self.index, rid)) if kind == "token" else None
            cached = None
            if r is not None and not r.cached_sent:
                cached, r.cached_sent = r.cached_tokens, True
            events.append(m.event_out(rid, kind, value, cached))
            if kind in ("done", "error"):
                live.pop((self.index, rid), None)
        self.send(m.Step(events))

    def send(self, msg: Any) -> None:
        data = m.encoder.encode(msg)
        with self.lock:
            self.socket.send(data, copy=False)


class EngineCore:
    def __init__(self, engine: Any, config: EngineConfig):
        self.engine, self.config = engine, config
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.RCVHWM, 0)
        self.inbox.bind(config.address)
        self.sinks = []
        for i, address in enumerate(config.frontends):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 2000)
            s.connect(address)
            self.sinks.append(FrontendSink(self, i, s))
        self.live: dict[tuple[int, int], Request] = {}
        self.done = threading.Event()
        self.exit_code = 0

    def broadcast(self, **status: Any) -> None:
        e = self.engine
        msg = m.Status(
            plan=e.table.settings.name,
            fingerprint=e.table.fingerprint,
            engine=self.config.dp_rank,
            **status,
        )
        for sink in self.sinks:
            sink.send(msg)

    def run(self) -> int:
        """Start the engine, serve the front ends until drained or failed; the exit code."""
        parent = os.getppid()
        self.engine.start()
        threading.Thread(target=self._announce, name="graphplan-announce", daemon=True).start()
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while not self.done.is_set():
            if not poller.poll(50):
                if os.getppid() != parent:  # the server is gone: so is this process
                    return 1
                continue
            msg = m.to_engine.decode(self.inbox.recv())
            try:
                self._handle(msg)
            except Exception as e:  # a malformed message must not stop the engine
                log.error("engine process: %s: %s: %s", type(msg).__name__, type(e).__name__, e)
        return self.exit_code

    def _announce(self) -> None:
        e = self.engine
        e.wait_ready()
        if e.state == "failed":
            self.broadcast(state="failed", error=f"{type(e.error).__name__}: {e.error}")
            self.exit_code = 1
            self.done.set()
        else:
            self.broadcast(state=e.state)

    def _handle(self, msg: Any) -> None:
        e = self.engine
        if isinstance(msg, m.Add):
            sink = self.sinks[msg.frontend]
            reqs = [
                Request(
                    w.prompt,
                    w.max_tokens,
                    sink,
                    w.params,
                    tag=w.rid,
                    stop=w.stop,
                    logprobs=w.logprobs,
                    prompt_logprobs=w.prompt_logprobs,
                    lora=w.lora,
                )
                for w in msg.reqs
            ]
            for r in reqs:
                self.live[msg.frontend, r.tag] = r
            try:
                e.enqueue(reqs)
            except RequestError as err:
                for r in reqs:
                    self.live.pop((msg.frontend, r.tag), None)
                sink.put_many([(r.tag, "error", err) for r in reqs])
        elif isinstance(msg, m.Cancel):
            reqs = [
                self.live[msg.frontend, rid] for rid in msg.rids if (msg.frontend, rid) in self.live
            ]
            e.cancel(reqs, msg.status)
        elif isinstance(msg, m.Responses):
            for code, path in msg.items:
                e.count_response(code, path)
        elif isinstance(msg, m.Call):
            self._call(msg)
        elif isinstance(msg, m.Gone):
            gone = [r for (fe, _), r in list(self.live.items()) if fe == msg.frontend]
            log.warning("front end %d is gone: freeing its %d requests", msg.frontend, len(gone))
            e.cancel(gone)
        elif isinstance(msg, m.Drain):
            threading.Thread(target=self._drain, args=(msg.timeout,), daemon=True).start()
        elif isinstance(msg, m.Wake):  # a DP peer started a wave
            e.pipeline.dp.wake(msg.wave)
        elif isinstance(msg, m.Leave):  # a DP peer is stopping between waves
            e.pipeline.dp.left(msg.engine, msg.wave)

    def _call(self, msg: m.Call) -> None:
        sink = self.sinks[msg.frontend]
        if msg.what == "metrics":
            from ..core.metrics import render_metrics

            sink.send(m.Reply(msg.call, 200, render_metrics(self.engine)))
            return

        if msg.what in ("load_lora", "unload_lora"):
            call = getattr(self.engine, msg.what)

            def lora() -> None:
                try:
                    if self.engine.pipeline.dp is not None:  # every engine would load it
                        raise RequestError(
                            409,
                            "adapter loads are not built for data-parallel serving: "
                            "name the adapters at start-up (--lora-modules)",
                        )
                    sink.send(m.Reply(msg.call, 200, call(*msg.args)))
                except RequestError as err:
                    sink.send(m.Reply(msg.call, err.status, err.message))

            threading.Thread(target=lora, name="graphplan-lora", daemon=True).start()
            return

        def reload() -> None:
            try:
                if self.engine.pipeline.tp is not None:  # its worker ranks would capture it too
                    raise RequestError(
                        409, "reloads are not built for tensor-parallel serving: restart the server"
                    )
                if self.engine.pipeline.dp is not None:  # every engine would switch together
                    raise RequestError(
                        409, "reloads are not built for data-parallel serving: restart the server"
                    )
                body = self.engine.reload(*msg.args)
                sink.send(m.Reply(msg.call, 200, body))
                self.broadcast(state=self.engine.state)  # the new plan and fingerprint
            except RequestError as err:
                sink.send(m.Reply(msg.call, err.status, err.message))

        threading.Thread(target=reload, name="graphplan-reload", daemon=True).start()

    def _drain(self, timeout: float) -> None:
        self.broadcast(state="draining")  # every front end refuses new requests (503)
        drained = self.engine.stop(timeout)
        self.broadcast(state="stopped", drained=drained)
        self.done.set()

    def close(self) -> None:
        for sink in self.sinks:
            sink.socket.close(linger=2000)
        self.inbox.close(linger=0)
        self.ctx.term()


def engine_main(config: EngineConfig) -> None:
    """The engine process's target."""
    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a process group's signals
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s[engine"
        + (f" {config.dp_rank}" if config.peers else "")
        + "]: %(message)s",
    )
    from ..core.engine import Engine
    from ..core.model import load_table

    table = load_table(config.source, config.overrides)
    kwargs, ranks = config.engine_kwargs, None
    if table.settings.tensor_parallel_size > 1:  # this process is rank 0 and starts the others
        from ..core.tp_serving import Ranks

        ranks = Ranks(table, config.source, config.overrides, kwargs, dp_rank=config.dp_rank)
        kwargs = ranks.engine_kwargs(kwargs)
    engine = Engine(table, config.source, config.overrides, **kwargs)
    engine.pipeline.tp = ranks
    if config.peers:  # data parallelism: one of the DP engines
        from ..core.dp_serving import DPWave

        DPWave(table, config.dp_rank, config.dp_port, list(config.peers)).attach(engine)
    core = EngineCore(engine, config)
    if ranks is not None:
        ranks.watch(core)
    code = core.run()
    if ranks is not None:
        ranks.stop(served=engine.state == "stopped")
    core.close()
    logging.shutdown()
    os._exit(code)  # no interpreter teardown: CUDA contexts and threads end with the process
