"""The first front end's watch over the server's other processes: it starts the engine process and
the extra front ends, and follows them. The engine's death (not a stop) ends every open request with
an error at once, in this front end and, through their sockets, in the others, and fails the server;
a front end's death makes the engine free that front end's requests. With data parallelism
(server/core/dp_serving.py) it starts one engine process per DP rank, each on its own devices, and
holds their DP group's store: any engine's death fails the server. ``stop`` drains: the engine
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
    def __init__(self, client: Any, addresses: Addresses, log_level: int, tp: int = 1):
        self.client, self.addresses, self.log_level = client, addresses, log_level
        self.tp = tp  # each engine's tensor-parallel ranks (its devices, with data parallelism)
        self.engine: Any = None
        self.engines: list[Any] = []  # data parallelism: every engine (engine is engines[0])
        self._store: Any = None
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
        peers: tuple[str, ...] = ()
        port = 0
        if a.engines > 1:
            from ..core.dp_serving import store

            self._store = store(a.engines)
            port, peers = self._store.port, tuple(a.engine_at(d) for d in range(a.engines))
        for d in range(a.engines):
            kwargs = dict(engine_kwargs)
            if peers:
                from ..core.dp_serving import engine_device

                kwargs["device"] = engine_device(engine_kwargs["device"], d, self.tp)
            config = EngineConfig(
                source=source,
                overrides=overrides,
                engine_kwargs=kwargs,
                address=a.engine_at(d),
                frontends=[a.frontend(i) for i in range(a.frontends)],
                log_level=self.log_level,
                dp_rank=d,
                dp_port=port,
                peers=peers,
            )
            name = "graphplan-engine" + (f"-{d}" if peers else "")
            self.engines.append(spawn(engine_main, config, name=name))
        self.engine = self.engines[0]
        for i in range(1, api_server_count):
            fc = FrontendConfig(
                server=server_settings, index=i, addresses=a, server_class=server_class
            )
            self.frontends.append(spawn(frontend_main, fc, sock, name=f"graphplan-api-{i}"))
        threading.Thread(target=self._watch, name="graphplan-supervisor", daemon=True).start()
        log.info(
            "engine process %s, %d front end process(es)",
            ", ".join(str(p.pid) for p in self.engines),
            api_server_count,
        )

    def _watch(self) -> None:
        engines = {p.sentinel: (d, p) for d, p in enumerate(self.engines)}
        watched = {
            **{s: 0 for s in engines},
            **{p.sentinel: i + 1 for i, p in enumerate(self.frontends)},
        }
        while any(s in watched for s in engines):
            for s in multiprocessing.connection.wait(list(watched)):
                who = watched.pop(s)
                if who == 0 and self.client.state not in ("stopped", "failed"):
                    d, p = engines[s]
                    name = f"engine process {d}" if len(engines) > 1 else "engine process"
                    self._engine_gone(f"the {name} died (exit code {p.exitcode})")
                    self._end_engines()
                elif who and not self.stopping:
                    log.error("front end process %d died: freeing its requests", who)
                    self.client.broadcast(m.Gone(who))

    def _engine_gone(self, message: str) -> None:
        log.error("%s: ending every open request", message)
        self.client.engine_died(message)
        ctx: Any = zmq.Context.instance()
        for i in range(1, self.addresses.frontends):  # as the engine would have told them
            s = ctx.socket(zmq.PUSH)
            s.connect(self.addresses.frontend(i))
            s.send(m.encoder.encode(m.Status("failed", error=message)))
            s.close(linger=1000)

    def _end_engines(self) -> None:
        """Data parallelism: an engine died, so its peers wait on it in their DP steps: end them."""
        for p in self.engines:
            if p.is_alive():
                p.kill()

    def stop(self, drain_timeout: float) -> bool:
        """Drain and end every process; True when no request was cut short."""
        self.stopping = True
        client, engine = self.client, self.engine
        drained = False
        if engine.is_alive() and client.state not in ("failed", "stopped"):
            client.drain(drain_timeout)
            client.stopped.wait(drain_timeout + 10)
            drained = client.state == "stopped" and client.drained
        if client.state == "failed":  # an engine died or failed to start: its DP peers wait on it
            self._end_engines()
        for p in [*self.engines, *self.frontends]:
            end(p, 10)
        client.close()
        self.addresses.remove()
        return drained
