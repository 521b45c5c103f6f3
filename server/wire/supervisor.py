"""The first front end's watch over the server's other processes: it starts the engine process and
the extra front ends, and follows them. The engine's death (not a stop) ends every open request with
an error at once, in this front end and, through their sockets, in the others, and fails the server;
a front end's death makes the engine free that front end's requests. ``stop`` drains: the engine
stops taking requests, lets those in flight finish up to the timeout, says so, and exits."""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
from typing import Any

import zmq

from . import messages as m
from .engine_proc import EngineConfig, engine_main
from .frontend_proc import FrontendConfig, frontend_main
from .procs import Addresses, end, spawn

log = logging.getLogger("graphplan.server")


class Supervisor:
    def __init__(self, client: Any, addresses: Addresses, log_level: int):
        self.client, self.addresses, self.log_level = client, addresses, log_level
        self.engine: Any = None
        self.frontends: list[Any] = []  # the extra ones, index 1..
        self.stopping = False

    def start(
        self,
        source: str,
        overrides: dict | None,
        engine_kwargs: dict,
        server_settings: dict,
        sock: Any,
        api_server_count: int,
        server_class: Any,
    ) -> None:
        a = self.addresses
        config = EngineConfig(
            source=source,
            overrides=overrides,
            engine_kwargs=engine_kwargs,
            address=a.engine,
            frontends=[a.frontend(i) for i in range(a.frontends)],
            log_level=self.log_level,
        )
        self.engine = spawn(engine_main, config, name="graphplan-engine")
        for i in range(1, api_server_count):
            fc = FrontendConfig(
                server=server_settings, index=i, addresses=a, server_class=server_class
            )
            self.frontends.append(spawn(frontend_main, fc, sock, name=f"graphplan-api-{i}"))
        threading.Thread(target=self._watch, name="graphplan-supervisor", daemon=True).start()
        log.info("engine process %d, %d front end process(es)", self.engine.pid, api_server_count)

    def _watch(self) -> None:
        engine = self.engine
        watched = {engine.sentinel: 0, **{p.sentinel: i + 1 for i, p in enumerate(self.frontends)}}
        while engine.sentinel in watched:
            for s in multiprocessing.connection.wait(list(watched)):
                who = watched.pop(s)
                if who == 0 and self.client.state not in ("stopped", "failed"):
                    self._engine_gone(f"the engine process died (exit code {engine.exitcode})")
                elif who and not self.stopping:
                    log.error("front end process %d died: freeing its requests", who)
                    self.client.send(m.Gone(who))

    def _engine_gone(self, message: str) -> None:
        log.error("%s: ending every open request", message)
        self.client.engine_died(message)
        ctx: Any = zmq.Context.instance()
        for i in range(1, self.addresses.frontends):  # as the engine would have told them
            s = ctx.socket(zmq.PUSH)
            s.connect(self.addresses.frontend(i))
            s.send(m.encoder.encode(m.Status("failed", error=message)))
            s.close(linger=1000)

    def stop(self, drain_timeout: float) -> bool:
        """Drain and end every process; True when no request was cut short."""
        self.stopping = True
        client, engine = self.client, self.engine
        drained = False
        if engine.is_alive() and client.state not in ("failed", "stopped"):
            client.drain(drain_timeout)
            client.stopped.wait(drain_timeout + 10)
            drained = client.state == "stopped" and client.drained
        for p in [engine, *self.frontends]:
            end(p, 10)
        client.close()
        self.addresses.remove()
        return drained
