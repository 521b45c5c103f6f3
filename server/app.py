"""HTTP front end on the standard library: ThreadingHTTPServer (a thread per connection, HTTP/1.1
keep-alive, chunked NDJSON streams) in front of the single engine thread.

    GET  /healthz        200 once the graphs are captured, 503 before (and while draining)
    GET  /metrics        Prometheus text: the runner's series and the server's
    POST /generate       {"prompt": [ids], "max_tokens": N, "stream": false} or {"prompts": [...]}
    POST /admin/reload   {} (re-read the start-up plan) or {"path": ..., "set": {...}}
    GET  /v1/models, POST /v1/completions   the OpenAI-compatible API (openai_api.py)

Every answer is JSON (errors too: 4xx for the client's mistakes, 405 for a known path with the
wrong method, 501 for an unknown method, 5xx only for server faults). ``/admin/`` routes need
``Authorization: Bearer <token>`` (server/security.py) and are off without a token;
reload paths stay inside the reload directory. Idle and slow connections time out.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from graphplan.compiler import __version__

from .engine import Engine
from .metrics import render_metrics
from .model import ModelSpec, ServingSpec, load_table
from .openai_api import OpenAIFrontEnd
from .protocol import RequestError, parse_generate, parse_reload
from .security import AdminGate, GuardedHandler, ReloadDir

log = logging.getLogger("graphplan.server")


class Handler(GuardedHandler, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"graphplan-server/{__version__}"  # the package's one version
    server: "_HTTPServer"

    def send_response(self, code, message=None):  # every response, counted by code
        self.server.app.engine.metrics.response(code, urlsplit(getattr(self, "path", "")).path)
        super().send_response(code, message)

    def log_message(self, fmt, *args):  # access log at debug level; errors are logged by us
        log.debug("%s %s", self.address_string(), fmt % args)

    # -- routes -----------------------------------------------------------------------------
    def do_GET(self):
        app, path = self.server.app, urlsplit(self.path).path
        if self._admin(path):
            return
        if path == "/healthz":
            e = app.engine
            body = {
                "status": e.state,
                "plan": e.table.settings.name,
                "fingerprint": e.table.fingerprint,
            }
            if e.error is not None:
                body["error"] = f"{type(e.error).__name__}: {e.error}"
            self._json(200 if e.state == "ready" else 503, body)
        elif path.startswith("/v1/"):
            app.openai.handle(self, "GET", path)
        elif path == "/metrics":
            self._send(
                200, render_metrics(app.engine).encode(), "text/plain; version=0.0.4; charset=utf-8"
            )
        elif not self._wrong_method(path):
            self._error(RequestError(404, f"no such endpoint: GET {path}"))

    def do_POST(self):
        path = urlsplit(self.path).path
        if self._admin(path):
            return
        if path.startswith("/v1/"):
            return self.server.app.openai.handle(self, "POST", path)
        try:
            if path == "/generate":
                self._generate()
            elif path == "/admin/reload":
                path_, sets = parse_reload(self._body())
                if path_ is not None:
                    path_ = self.server.app.reload_dir.confine(path_)
                self._json(200, self.server.app.engine.reload(path_, sets))
            elif self._wrong_method(path):
                pass
            else:
                self.close_connection = True  # the body was not read
                raise RequestError(404, f"no such endpoint: POST {path}")
        except RequestError as e:
            self._error(e)
        except Exception as e:
            log.exception("%s %s failed", self.command, self.path)
            self.close_connection = True
            self._error(RequestError(500, f"internal error: {type(e).__name__}: {e}"))

    def _generate(self):
        app = self.server.app
        g = parse_generate(self._body(), app.engine.limits())
        events, reqs = app.engine.submit(g.prompts, g.max_tokens, g.stream)
        try:
            if g.stream:
                self._stream(events, reqs, g.batch)
            else:
                self._collect(events, reqs, g.batch)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        finally:
            for r in reqs:  # a timed-out or disconnected client frees its rows
                r.cancelled = True

    def _next(self, events: queue.SimpleQueue):
        try:
            return events.get(timeout=self.server.app.request_timeout)
        except queue.Empty:
            raise RequestError(504, f"no result in {self.server.app.request_timeout} s") from None

    def _collect(self, events, reqs, batch: bool):
        left, errors = len(reqs), {}
        while left:
            tag, kind, val = self._next(events)
            if kind != "token":
                left -= 1
                if kind == "error":
                    errors[tag] = val
        if errors:
            tag, e = min(errors.items())
            raise RequestError(e.status, f"prompts[{tag}]: {e.message}" if batch else e.message)
        results = [
            {"tokens": r.out, "num_prompt_tokens": len(r.prompt), "finish_reason": "length"}
            for r in reqs
        ]
        self._json(200, {"results": results} if batch else results[0])

    def _stream(self, events, reqs, batch: bool):
        """NDJSON over chunked transfer: a line per token, then a final line per request."""
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        left = len(reqs)
        while left:
            try:
                tag, kind, val = self._next(events)
            except RequestError as e:  # the status line is sent: report it in the stream
                tag, kind, val, left = 0, "error", e, 1
            line = {"prompt": tag} if batch else {}
            if kind == "token":
                line["token"] = val
            elif kind == "done":
                left -= 1
                line.update(done=True, tokens=reqs[tag].out, finish_reason="length")
            else:
                left -= 1
                line.update(error=val.message, status=val.status)
            data = (json.dumps(line) + "\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.write(b"0\r\n\r\n")

    # -- plumbing ---------------------------------------------------------------------------
    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise RequestError(411, "send the JSON body with a Content-Length header")
        try:
            n = int(length)
        except ValueError:
            self.close_connection = True
            raise RequestError(400, f"bad Content-Length {length!r}") from None
        limit = self.server.app.max_body_bytes
        if n > limit or n < 0:
            self.close_connection = True  # the body stays unread
            raise RequestError(413, f"body of {n} bytes is over the limit of {limit} bytes")
        return self.rfile.read(n)

    def _send(self, status: int, data: bytes, ctype: str):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _json(self, status: int, obj):
        self._send(status, (json.dumps(obj) + "\n").encode(), "application/json")

    def _error(self, e: RequestError):
        if e.status >= 500:
            log.warning("%s %s -> %d %s", self.command, self.path, e.status, e.message)
        body = {"error": e.message, "status": e.status}
        self._json(e.status, body)


class _HTTPServer(ThreadingHTTPServer):
    """Tracks open connections so stop() can wake keep-alive readers (SHUT_RD) and join them."""

    daemon_threads = True  # block_on_close still makes server_close() join them
    request_queue_size = 1024  # listen backlog: bursts of clients connect at once

    def __init__(self, addr, app):
        self.app = app
        self.connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(addr, Handler)

    def process_request(self, request, client_address):
        with self._conn_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._conn_lock:
            self.connections.discard(request)
        super().shutdown_request(request)


class Server:
    """A model (``spec``: the tiny Llama, or a Hugging Face checkpoint) behind graphplan's
    runtime, over HTTP. ``start()`` listens at once and captures on the engine thread; /healthz
    turns 200 when that is done."""

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
        request_timeout: float = 300.0,
        drain_timeout: float = 30.0,
        admin_token: str | None = None,
        reload_dir=None,
        idle_timeout: float = 30.0,
        on_demand: bool | None = None,
    ):
        self.admin = AdminGate(admin_token)  # no token: admin routes are off
        self.reload_dir = ReloadDir(
            reload_dir if reload_dir is not None else Path(source).resolve().parent
        )
        self.idle_timeout = idle_timeout
        table = load_table(source, overrides)  # GraphplanError: the caller reports it
        self.engine = Engine(
            table,
            str(source),
            overrides,
            spec=spec,
            device=device,
            progress=progress,
            on_demand=on_demand,
        )
        self.openai = OpenAIFrontEnd(spec)
        self.max_body_bytes, self.request_timeout = max_body_bytes, request_timeout
        self.drain_timeout = drain_timeout
        self.httpd = _HTTPServer((host, port), self)
        self._http_thread = threading.Thread(
            target=self.httpd.serve_forever, name="graphplan-http", kwargs={"poll_interval": 0.05}
        )
        self._stopped = False

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "Server":
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
        """Drain the engine, stop listening, wake idle keep-alive connections, join every thread."""
        if self._stopped:
            return
        self._stopped = True
        self.engine.stop(self.drain_timeout)
        if self._http_thread.is_alive():
            self.httpd.shutdown()
            self._http_thread.join()
        with self.httpd._conn_lock:
            conns = list(self.httpd.connections)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        self.httpd.server_close()
        log.info("stopped")
