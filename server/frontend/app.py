"""The serving process: a front end (``http_app.py``'s ASGI app served by uvicorn on a thread of its
own) over an engine, in one of two shapes.

- One process (``processes=False``, what embedders get): the engine thread (server/core/engine.py)
  runs in this process; handlers hand requests over through its queue.
- Processes (``graphplan-serve``'s default): the engine core runs in a process of its own
  (server/wire/engine_proc.py) and this process's front end reaches it through an
  ``EngineClient`` (server/wire/client.py); ``api_server_count`` > 1 starts more front end
  processes accepting on the same listening socket (server/wire/frontend_proc.py). This process
  supervises them: the engine's death ends every open stream with an error within a second and
  turns the server ``failed``; a front end's death frees its requests' seats and KV blocks.

``Server.start()`` listens at once; /healthz turns 200 once the graphs are captured."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from pathlib import Path
from typing import Any

import uvicorn

from ..core.dp_serving import check_serving as check_dp_serving
from ..core.model import ModelSpec, ServingSpec, load_table
from ..core.tp_serving import check_serving as check_tp_serving
from ..errors import RequestError
from .http_app import build_app
from .http_protocol import GuardedH11Protocol
from .security import AdminGate, ReloadDir

log = logging.getLogger("graphplan.server")


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # bursts of clients connect at once
    except OSError:
        sock.close()
        raise
    return sock


class Server:
    """A model (``spec``: the tiny Llama, or a Hugging Face checkpoint) behind graphplan's
    runtime, over HTTP."""

    def __init__(
        self,
        source,
        *,
        overrides: dict | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        device: str = "cpu",
        spec: ServingSpec = ModelSpec(),
        progress: bool = True,
        max_body_bytes: int = 1 << 20,
        drain_timeout: float = 30.0,
        admin_token: str | None = None,
        reload_dir=None,
        idle_timeout: float = 30.0,
        on_demand: bool | None = None,
        max_waiting: int = 1024,
        async_scheduling: bool = True,
        fused_sampler: bool | None = None,
        enable_prefix_caching: bool = True,
        speculative: Any = None,
        processes: bool = False,
        api_server_count: int = 1,
        log_level: int = logging.INFO,
        frontend: Any = None,
    ):
        """``frontend``: (index, Addresses, socket) when this is an extra front end process
        (server/wire/frontend_proc.py): it serves on that socket through a client of its own."""
        self.source, self.overrides, self.spec = str(source), overrides, spec
        self.admin = AdminGate(admin_token)  # no token: admin routes are off
        self.reload_dir = ReloadDir(
            reload_dir if reload_dir is not None else Path(source).resolve().parent
        )
        self.idle_timeout = idle_timeout
        self.max_body_bytes, self.drain_timeout = max_body_bytes, drain_timeout
        self.processes = processes or frontend is not None
        self.api_server_count = api_server_count
        self.log_level = log_level
        self._supervisor: Any = None  # the engine and extra front end processes (index 0)
        self._addresses: Any = None
        self.engine: Any  # the in-process Engine, or an EngineClient to the engine process
        self.drained = True
        self._stopped = False
        table = load_table(source, overrides)  # GraphplanError: the caller reports it
        check_tp_serving(
            table,
            device=device,
            processes=self.processes,
            speculative=speculative,
            compile=spec.compile,
        )
        check_dp_serving(table, device=device, processes=self.processes, speculative=speculative)
        self.tp = table.settings.tensor_parallel_size
        engines = table.settings.data_parallel_size  # one engine process per DP rank
        self.engine_kwargs: dict[str, Any] = dict(
            spec=spec,
            device=device,
            progress=progress,
            on_demand=on_demand,
            max_waiting=max_waiting,
            async_scheduling=async_scheduling,
            fused_sampler=fused_sampler,
            enable_prefix_caching=enable_prefix_caching,
        )
        if speculative is not None:  # a SpeculativeConfig (server/core/spec/config.py)
            from ..core.spec.config import check_plan

            check_plan(speculative, table.q, f"plan {table.settings.name!r}")
            self.engine_kwargs["speculative"] = speculative
        if self.processes:
            from ..wire.client import EngineClient
            from ..wire.procs import Addresses

            if frontend is not None:
                self.index, self._addresses, self._sock = frontend
            else:
                self.index, self._addresses = 0, Addresses.new(api_server_count, engines)
            a = self._addresses
            inboxes = [a.engine_at(d) for d in range(a.engines)]
            self.engine = EngineClient(spec, table, self.index, inboxes, a.frontend(self.index))
        else:
            from ..core.engine import Engine

            self.index = 0
            self.engine = Engine(table, str(source), overrides, **self.engine_kwargs)
        self.app = build_app(self)  # reads the tokenizer and chat template: errors now
        if frontend is None:
            self._sock = listening_socket(host, port)
        config = uvicorn.Config(
            self.app,
            http=GuardedH11Protocol,
            lifespan="off",
            log_config=None,
            access_log=False,  # http_app.Guard writes one line per request
            server_header=False,
            timeout_keep_alive=idle_timeout,  # type: ignore[arg-type]
            timeout_graceful_shutdown=5,
        )
        self.uvicorn = uvicorn.Server(config)
        self._http_thread = threading.Thread(target=self._serve_http, name="graphplan-http")

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def state(self) -> str:
        return self.engine.state

    def _serve_http(self) -> None:
        """uvicorn on a loop of this thread's own; with an engine process, its messages are read
        on the same loop."""
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main() -> None:
            events = None
            if self.processes:
                events = asyncio.ensure_future(self.engine.serve_events())
            try:
                await self.uvicorn.serve(sockets=[self._sock])
            finally:
                if events is not None:
                    events.cancel()

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    def start(self) -> Server:
        self._http_thread.start()
        log.info("listening on %s; /healthz is 503 until the graphs are captured", self.url)
        if not self.processes:
            self.engine.start()
            return self
        if self.index == 0:
            from ..wire.supervisor import Supervisor

            self._supervisor = Supervisor(self.engine, self._addresses, self.log_level, self.tp)
            self._supervisor.start(
                self.source,
                self.overrides,
                self.engine_kwargs,
                self._settings(),
                self._sock,
                self.api_server_count,
                type(self),
            )
        return self

    def _settings(self) -> dict:
        """What an extra front end needs to build a Server like this one."""
        return dict(
            source=self.source,
            overrides=self.overrides,
            spec=self.spec,
            max_body_bytes=self.max_body_bytes,
            drain_timeout=self.drain_timeout,
            admin_token=self.admin.token,
            reload_dir=str(self.reload_dir.root),
            idle_timeout=self.idle_timeout,
            log_level=self.log_level,
        )

    def wait_ready(self, timeout: float | None = None) -> bool:
        if not self.processes:
            return self.engine.wait_ready(timeout)
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.engine.state == "starting":
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return self.engine.state == "ready"

    def reload(self, source=None, overrides=None) -> dict:
        return self.engine.reload(source, overrides)

    def handle_sighup(self, signum=None, frame=None) -> threading.Thread:
        """SIGHUP: re-read the plan path in use, off the signal handler (returns the thread)."""

        def run():
            try:
                r = self.reload()
                log.info(
                    "SIGHUP reload: %s",
                    "unchanged"
                    if r["unchanged"]
                    else f"{r['previous'][:19]} -> {r['fingerprint'][:19]}",
                )
            except RequestError as e:
                log.error("SIGHUP reload: %s", e.message)

        t = threading.Thread(target=run, name="graphplan-sighup-reload")
        t.start()
        return t

    def stop(self) -> bool:
        """Drain (requests in flight finish, up to drain_timeout; new ones get 503 with a
        Retry-After), stop listening, close idle connections, join every thread and process.
        True when no request had to be cut short."""
        if self._stopped:
            return self.drained
        self._stopped = True
        if not self.processes:
            self.drained = self.engine.stop(self.drain_timeout)
        elif self._supervisor is not None:
            self.drained = self._supervisor.stop(self.drain_timeout)
        self.uvicorn.should_exit = True
        if self._http_thread.is_alive():
            self._http_thread.join()
        self._sock.close()
        log.info("stopped")
        return self.drained
