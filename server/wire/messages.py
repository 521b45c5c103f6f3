"""The messages between the front ends and the engine core process, as msgspec structs encoded
with msgpack (pyzmq carries the bytes; server/wire/sockets.py).

Front end -> engine (one socket, every front end pushes to it): ``Add`` (a front end's new requests,
all or none), ``Cancel`` (their client left, or a stop string ended them), ``Call`` (a reload or a
metrics scrape, answered by a ``Reply``), ``Responses`` (HTTP responses to count), and from the
server's supervisor ``Gone`` (a front end died: free its requests) and ``Drain``.

Engine -> one front end: ``Step`` carries every event of one engine step for that front end's
requests in one message (tokens, prompt logprobs, ends, errors), not one message per token;
``Status`` the engine's state (ready, draining, stopped, failed) and its plan; ``Reply``.

An event is ``[rid, kind, a, b, c]``; the kinds and their fields are ``TOKEN`` (token, logprob,
top; a request's first token event adds its prompt tokens found in the prefix cache), ``DONE`` (finish reason), ``ERROR`` (status, message, [param, code]) and ``PROMPT``
(a list of ``[token, logprob, top]``). ``event_out`` and ``event_in`` turn the engine's
``(tag, kind, value)`` events into these and back.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from ..errors import RequestError
from ..requests import Sampled
from ..sampling_params import SamplingParams

TOKEN, DONE, ERROR, PROMPT = 0, 1, 2, 3
KINDS = {"token": TOKEN, "done": DONE, "error": ERROR, "prompt_logprobs": PROMPT}


class WireRequest(msgspec.Struct, array_like=True, frozen=True):
    """One engine request (one prompt, one choice) as the engine process rebuilds it."""

    rid: int
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stop: tuple[int, ...]
    logprobs: int | None
    prompt_logprobs: int | None
    lora: str | None = None
    """Its LoRA adapter's name (``Request.lora``); None: the base model."""


class Add(msgspec.Struct, tag=True, array_like=True, frozen=True):
    frontend: int
    reqs: list[WireRequest]


class Cancel(msgspec.Struct, tag=True, array_like=True, frozen=True):
    frontend: int
    rids: list[int]
    status: int
    """499: the client left; 200: the front end ended it (a stop string): counted as served."""


class Call(msgspec.Struct, tag=True, array_like=True, frozen=True):
    frontend: int
    call: int
    what: str
    """"reload" (args: source, overrides), "metrics", "load_lora" (args: name, path) or
    "unload_lora" (args: name)."""
    args: list[Any] = []


class Responses(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """HTTP responses a front end answered: ``[status, path]`` each (the metrics count them)."""

    items: list[tuple[int, str]]


class Gone(msgspec.Struct, tag=True, array_like=True, frozen=True):
    frontend: int


class Drain(msgspec.Struct, tag=True, array_like=True, frozen=True):
    timeout: float


class Step(msgspec.Struct, tag=True, array_like=True, frozen=True):
    events: list[list[Any]]


class Status(msgspec.Struct, tag=True, array_like=True, frozen=True):
    state: str
    plan: str = ""
    fingerprint: str = ""
    error: str | None = None
    drained: bool = True
    """With ``stopped``: every request finished before the drain timeout."""
    engine: int = 0
    """Data parallelism: the engine (DP rank) whose state this is (server/wire/engines.py)."""


class Wake(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Data parallelism: a DP peer started ``wave``; step with it (server/core/dp_serving.py)."""

    wave: int


class Leave(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Data parallelism: DP peer ``engine`` is stopping, between waves, at ``wave``; it starts no
    wave again (server/core/dp_serving.py): the engines leave once every one said so."""

    engine: int
    wave: int


class Reply(msgspec.Struct, tag=True, array_like=True, frozen=True):
    call: int
    status: int
    """200, or the RequestError's status (``body`` its message)."""
    body: Any = None


ToEngine = Union[Add, Cancel, Call, Responses, Gone, Drain, Wake, Leave]
ToFrontend = Union[Step, Status, Reply]

encoder = msgspec.msgpack.Encoder()
to_engine = msgspec.msgpack.Decoder(ToEngine)
to_frontend = msgspec.msgpack.Decoder(ToFrontend)


def event_out(rid: int, kind: str, value: Any, cached: int | None = None) -> list[Any]:
    """An engine event for the wire (``cached``: with a request's first token, its prompt tokens
    found in the prefix cache)."""
    k = KINDS[kind]
    if k == TOKEN:
        e = [rid, k, value.token, value.logprob, value.top or None]
        return e if cached is None else [*e, cached]
    if k == DONE:
        return [rid, k, value]
    if k == ERROR:
        retry = value.headers.get("Retry-After")  # a refusal while draining: come back
        return [rid, k, value.status, value.message, [value.param, value.code, retry]]
    return [rid, k, [[s.token, s.logprob, s.top or None] for s in value]]


def cached_tokens(e: list[Any]) -> int | None:
    """The prefix-cache hit a first token event carries (None: not one)."""
    return int(e[5]) if e[1] == TOKEN and len(e) > 5 else None


def event_in(e: list[Any]) -> tuple[int, str, Any]:
    """A wire event back to ``(rid, kind, value)`` as the engine made it."""
    rid, k = e[0], e[1]
    if k == TOKEN:
        return rid, "token", _sampled(e[2], e[3], e[4])
    if k == DONE:
        return rid, "done", e[2]
    if k == ERROR:
        param, code, *retry = e[4]
        headers = {"Retry-After": str(retry[0])} if retry and retry[0] is not None else None
        return rid, "error", RequestError(e[2], e[3], param, code, headers)
    return rid, "prompt_logprobs", [_sampled(*s) for s in e[2]]


def _sampled(token: int, logprob: float | None, top) -> Sampled:
    if top is None and logprob is None:
        return Sampled(token)
    return Sampled(token, logprob, tuple((int(t), float(p)) for t, p in top or ()))
