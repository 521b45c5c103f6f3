"""What every route shares: reading a body (bounded in size and time), answering JSON and errors in
the one error shape, and noticing that a client went away while its request runs."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..errors import RequestError
from ..requests import AsyncSink, Event
from .bodies import error_body

log = logging.getLogger("graphplan.server")


GONE: Event = (-1, "gone", None)
"""Put in a request's event queue when its client disconnects (compared by identity)."""


class ClientGone(Exception):
    """The client closed its connection; nothing more is sent."""


def json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    data = (json.dumps(obj, ensure_ascii=False, allow_nan=False) + "\n").encode()
    return Response(data, status, headers=headers, media_type="application/json")


def error_response(e: RequestError) -> Response:
    if e.status >= 500 and e.status != 501:  # 501: a client's method no route takes
        log.warning("-> %d %s", e.status, e.message)
    return json_response(e.status, error_body(e), e.headers or None)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body: 411 without a length, 413 over ``limit`` bytes (before reading it when the
    length says so), 408 when it does not arrive within ``timeout`` seconds (a body that stops
    half-way), ClientGone when the client hangs up."""
    length = request.headers.get("content-length")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    if length is None and not chunked:
        raise RequestError(411, "send the JSON body with a Content-Length header")
    if length is not None:
        if not length.isdigit() or len(length) > 18:
            raise RequestError(400, f"bad Content-Length {length[:40]!r}")
        if int(length) > limit:
            raise RequestError(413, f"body of {length} bytes is over the limit of {limit} bytes")
    parts: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"body over the limit of {limit} bytes")
            parts.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        got = f"{size} of {length}" if length is not None else f"{size}"
        raise RequestError(
            408, f"the body did not arrive within {timeout:g} s ({got} bytes received)"
        ) from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(parts)


async def events(sink: AsyncSink, request: Request) -> AsyncIterator[Event]:
    """The engine's events for one HTTP request, until the caller stops; raises ClientGone as soon
    as the client disconnects (the caller then cancels its engine requests)."""
    gone = asyncio.ensure_future(_disconnected(request))

    # the disconnect wakes the same queue the engine fills: no task or wait set per event
    def wake(task: asyncio.Future) -> None:
        if not task.cancelled():
            sink.queue.put_nowait(GONE)

    gone.add_done_callback(wake)
    try:
        while True:
            event = await sink.get()
            if event is GONE:
                raise ClientGone()
            yield event
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the ASGI server reports ``http.disconnect`` (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
