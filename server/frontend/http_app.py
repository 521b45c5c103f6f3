"""The ASGI app (FastAPI): the OpenAI routes (openai_api.py) and graphplan's own.

    GET  /healthz        200 once the graphs are captured, 503 before (and while draining)
    GET  /metrics        Prometheus text: the runner's series and the server's (metrics.py)
    POST /generate       {"prompt": [ids], "max_tokens": N, "stream": false} or {"prompts": [...]}
    POST /admin/reload   {} (re-read the start-up plan) or {"path": ..., "set": {...}}

Every error, on every route, is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status for the client's mistakes (400 bad body, 401/403 admin token, 404 unknown path or model, 405
wrong method, 408 body too slow, 411 no length, 413 too large, 414 request line too long, 422 a
plan rejected, 429 queue full, 431 too many or too large headers) and 5xx only for the server's own
faults, or 501 for a method no route takes (TRACE, CONNECT, OPTIONS, FOO) on an unknown path. ``/admin/`` routes need
``Authorization: Bearer <token>`` (server/frontend/security.py) and are off without one. The guard
middleware counts every response by route and status and writes one access-log line per request.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from graphplan.compiler import __version__
from graphplan.compiler.errors import visible

from ..core.metrics import CONTENT_TYPE
from ..errors import RequestError
from ..requests import AsyncSink, greedy_requests
from .bodies import parse_generate, parse_reload
from .http_io import ClientGone, error_response, events, json_response, read_body
from .http_protocol import over_bounds
from .openai_api import OpenAIFrontEnd
from .security import ADMIN_PATHS, ADMIN_PREFIX

log = logging.getLogger("graphplan.server")
access = logging.getLogger("graphplan.server.access")
SERVER_HEADER = f"graphplan-server/{__version__}"  # the package's one version
MAX_HEADERS = 100
RESOURCE_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH")
"""Methods that name a resource: on an unknown path they get 404 (any other method, 501)."""


def build_app(server: Any) -> Guard:
    app = FastAPI(
        title="graphplan", version=__version__, docs_url=None, redoc_url=None, openapi_url=None
    )
    openai = OpenAIFrontEnd(server)
    app.include_router(openai.router())
    engine = server.engine

    @app.get("/healthz")
    async def healthz() -> Response:
        body = engine.health()
        return json_response(200 if body["status"] == "ready" else 503, body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await engine.scrape(), media_type=CONTENT_TYPE)

    @app.post("/generate")
    async def generate(request: HTTPRequest) -> Response:
        body = await read_body(request, server.max_body_bytes, server.idle_timeout)
        g = parse_generate(body, engine.limits())
        sink = AsyncSink(_loop())
        _, reqs = greedy_requests(g.prompts, g.max_tokens, engine.spec.stop_token_ids(), sink)
        engine.enqueue(reqs)
        if g.stream:
            return StreamingResponse(
                _ndjson(engine, request, sink, reqs, g.batch), media_type="application/x-ndjson"
            )
        try:
            left, errors = len(reqs), {}
            async for tag, kind, value in events(sink, request):
                if kind != "token":
                    left -= 1
                    if kind == "error":
                        errors[tag] = value
                if not left:
                    break
        finally:
            engine.cancel([r for r in reqs if not r.finished])
        if errors:
            tag, e = min(errors.items())
            raise RequestError(e.status, f"prompts[{tag}]: {e.message}" if g.batch else e.message)
        results = [
            {"tokens": r.out, "num_prompt_tokens": len(r.prompt), "finish_reason": r.finish_reason}
            for r in reqs
        ]
        return json_response(200, {"results": results} if g.batch else results[0])

    @app.post("/admin/reload")
    async def reload(request: HTTPRequest) -> Response:
        body = await read_body(request, server.max_body_bytes, server.idle_timeout)
        path, sets = parse_reload(body)
        if path is not None:
            path = server.reload_dir.confine(path)
        from starlette.concurrency import run_in_threadpool

        return json_response(200, await run_in_threadpool(engine.reload, path, sets))

    @app.exception_handler(RequestError)
    async def request_error(_: HTTPRequest, e: Exception) -> Response:
        assert isinstance(e, RequestError)
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, e: Exception) -> Response:
        assert isinstance(e, HTTPException)
        method, path = visible(request.method), visible(request.url.path)  # long ones cut
        status = e.status_code
        if status == 404 and request.method not in RESOURCE_METHODS:
            status = 501  # e.g. TRACE /, CONNECT host:443, OPTIONS *: implemented nowhere
            message = f"{method} is not implemented by this server; its routes take GET and POST"
        elif status == 404:
            message = f"no such endpoint: {method} {path}"
        elif status == 405:
            allow = {k.lower(): v for k, v in (e.headers or {}).items()}.get("allow", "")
            message = f"{method} is not allowed on {path}; use {allow}"
        else:
            message = visible(str(e.detail))
        return error_response(RequestError(status, message, headers=dict(e.headers or {})))

    @app.exception_handler(ClientGone)
    async def client_gone(_: HTTPRequest, e: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it; counted and logged as 499

    @app.exception_handler(Exception)
    async def internal(request: HTTPRequest, e: Exception) -> Response:
        log.error(
            "%s %s failed: %s: %s",
            request.method,
            request.url.path,
            type(e).__name__,
            e,
            exc_info=e,
        )
        return error_response(RequestError(500, f"internal error: {type(e).__name__}: {e}"))

    return Guard(app, server)


def _loop():
    import asyncio

    return asyncio.get_running_loop()


async def _ndjson(engine, request, sink, reqs, batch: bool):
    """/generate's stream: a line per token, then a final line per prompt."""
    left = len(reqs)
    try:
        async for tag, kind, value in events(sink, request):
            line: dict[str, Any] = {"prompt": tag} if batch else {}
            if kind == "token":
                line["token"] = value.token
            elif kind == "done":
                left -= 1
                line.update(done=True, tokens=reqs[tag].out, finish_reason=value)
            else:
                left -= 1
                line.update(error=value.message, status=value.status)
            yield (json.dumps(line) + "\n").encode()
            if not left:
                return
    except ClientGone:
        pass
    finally:
        engine.cancel([r for r in reqs if not r.finished])


class Guard:
    """Pure ASGI middleware around the app: the admin token on /admin/ (before routing, so an
    unknown admin path or method is refused the same way), a bound on the header count, the
    Server header, a count of every response by route and status, and the access log."""

    def __init__(self, app: ASGIApp, server: Any):
        self.app, self.server = app, server
        self.headers = [
            (b"server", SERVER_HEADER.encode()),
            (b"x-graphplan-frontend", str(server.index).encode()),  # which front end process
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        path, method = scope["path"], scope["method"]
        status = {"code": 499, "bytes": 0}

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], *self.headers]
            elif message["type"] == "http.response.body":
                status["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await error_response(refusal)(scope, receive, counted)
            else:
                await self.app(scope, receive, counted)
        finally:
            code = status["code"]
            self.server.engine.count_response(code, path)
            client = scope.get("client") or ("-", 0)
            access.info(
                '%s "%s %s" %d %d %.1fms',
                client[0],
                visible(method),  # escapes shown, long values cut: one line per request
                visible(path),
                code,
                status["bytes"],
                1000 * (time.perf_counter() - t0),
            )

    def _refusal(self, scope: Scope) -> RequestError | None:
        if len(scope["headers"]) > MAX_HEADERS:
            return RequestError(431, f"more than {MAX_HEADERS} request headers")
        query = scope.get("query_string") or b""
        target = len(scope.get("raw_path") or scope["path"].encode()) + (
            len(query) + 1 if query else 0
        )
        line = len(scope["method"]) + 1 + target + len(" HTTP/1.1\r\n")
        head = line + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        refused = over_bounds(line, head)  # the bounds of a head h11 gave up on, for whole ones
        if refused is not None:
            return refused
        if scope["path"].startswith(ADMIN_PREFIX) or scope["path"] in ADMIN_PATHS:
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                self.server.admin.check(auth.decode("latin-1") if auth is not None else None)
            except RequestError as e:
                if e.status == 401:
                    e.headers = {"WWW-Authenticate": "Bearer"}
                return e
        return None
