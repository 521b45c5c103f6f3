"""The one exception a request (or a reload) fails with, in either process: an HTTP status, a
message for the client, OpenAI's ``param`` and ``code``. The front end turns it into the error
shape of every route (frontend/bodies.py); the engine core sends it over the wire."""

from __future__ import annotations


class RequestError(Exception):
    """Fails one request (or one reload) with an HTTP status and a message for the client; ``param``
    names the offending field and ``code`` is OpenAI's machine-readable code, where there are."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message = status, message
        self.param, self.code = param, code
        self.headers = headers or {}


APIError = RequestError
"""The name the OpenAI layer and SamplingParams use for it."""


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status in (401, 403):
        return "authentication_error" if status == 401 else "permission_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


def not_serving(state: str) -> RequestError:
    """The 503 of a request that arrives while the engine is not serving; a draining server asks
    clients to come back (Retry-After)."""
    detail = {
        "starting": ": capturing graphs",
        "draining": ": finishing the requests in flight before it stops",
    }
    headers = {"Retry-After": "5"} if state != "failed" else None
    return RequestError(503, f"server is {state}{detail.get(state, '')}", headers=headers)
