"""uvicorn's h11 protocol with the guards the stock one lacks: a connection that has not sent a
whole request head within the idle timeout is closed (the stock keep-alive timer is armed only
after a response, so a client could hold a connection open forever with half a request line), and
an unparsable request gets a JSON error in the one error shape, not a text/plain one: 414 for a
request line over ``MAX_REQUEST_LINE`` bytes, 431 for a head over h11's buffer (16 KiB) that has
not ended, 400 for anything else. Heads that arrive whole are bounded by http_app.Guard."""

from __future__ import annotations

import asyncio
import http
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import RequestError
from .bodies import error_body

MAX_REQUEST_LINE = 8 * 1024
"""Bytes of a request line (method, target, version), as nginx's default buffer for it."""
MAX_HEAD_BYTES = 16 * 1024
"""Bytes of a request head (its line and headers): h11's bound on a head that has not ended."""


def over_bounds(line_bytes: int, head_bytes: int) -> RequestError | None:
    """414 for a request line over ``MAX_REQUEST_LINE`` bytes, 431 for a head over
    ``MAX_HEAD_BYTES``; None within both. One rule for heads that h11 parsed (http_app.Guard)
    and heads it gave up on."""
    if line_bytes > MAX_REQUEST_LINE:
        return RequestError(
            414,
            f"the request line is over {MAX_REQUEST_LINE} bytes; send a shorter URL "
            "(a request's data goes in its body)",
        )
    if head_bytes > MAX_HEAD_BYTES:
        return RequestError(431, f"the request headers are over {MAX_HEAD_BYTES} bytes")
    return None


class GuardedH11Protocol(H11Protocol):
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # a request head arrived: its body has the route's own timeout

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 refuses (its message is always the same words): the
        one error shape, with 414 or 431 where the head is over a bound (``refused_head``)."""
        error = RequestError(400, msg)
        data = self.conn.trailing_data[0]
        if len(data) > MAX_HEAD_BYTES:  # h11 gave up waiting for the end of the head
            end = data.find(b"\n")
            error = over_bounds(len(data) if end < 0 else end, len(data)) or error
        status = error.status
        reason = http.HTTPStatus(status).phrase.encode()
        body = (json.dumps(error_body(error)) + "\n").encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=status, headers=headers, reason=reason),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()
