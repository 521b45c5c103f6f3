"""The serving process: an engine thread (server/core/engine.py) behind an ASGI app (http_app.py) served
by uvicorn on a thread of its own. ``Server.start()`` listens at once and captures on the engine
thread; /healthz turns 200 when that is done. Handlers never block the engine: they hand requests
over through its queue and await their events (``loop.call_soon_threadsafe``)."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import uvicorn

from ..core.engine import Engine
from ..core.model import ModelSpec, ServingSpec, load_table
from ..errors import RequestError
from .http_app import build_app
from .http_protocol import GuardedH11Protocol
from .security import AdminGate, ReloadDir

log = logging.getLogger("graphplan.server")


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
    ):
        self.admin = AdminGate(admin_token)  # no token: admin routes are off
        self.reload_dir = ReloadDir(
            reload_dir if reload_dir is not None else Path(source).resolve().parent
        )
        self.idle_timeout = idle_timeout
        self.max_body_bytes, self.drain_timeout = max_body_bytes, drain_timeout
        table = load_table(source, overrides)  # GraphplanError: the caller reports it
        self.engine = Engine(
            table,
            str(source),
            overrides,
            spec=spec,
            device=device,
            progress=progress,
            on_demand=on_demand,
            max_waiting=max_waiting,
            async_scheduling=async_scheduling,
            fused_sampler=fused_sampler,
        )
        self.app = build_app(self)  # reads the tokenizer and chat template: errors now
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(2048)  # bursts of clients connect at once
        except OSError:
            self._sock.close()
            raise
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
        self._http_thread = threading.Thread(
            target=self.uvicorn.run, kwargs={"sockets": [self._sock]}, name="graphplan-http"
        )
        self._stopped = False

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> Server:
        self._http_thread.start()
        log.info("listening on %s; /healthz is 503 until the graphs are captured", self.url)
        self.engine.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.engine.wait_ready(timeout)

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

    def stop(self) -> None:
        """Drain the engine (requests in flight finish, up to drain_timeout), stop listening,
        close idle connections, join every thread."""
        if self._stopped:
            return
        self._stopped = True
        self.engine.stop(self.drain_timeout)
        self.uvicorn.should_exit = True
        if self._http_thread.is_alive():
            self._http_thread.join()
        self._sock.close()
        log.info("stopped")
