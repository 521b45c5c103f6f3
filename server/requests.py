"""What travels between the HTTP handlers and the engine thread: a ``Request`` (one prompt, one
choice), the ``Sampled`` token it gets each step, and the sinks its events go to.

Events are ``(tag, kind, value)``: ``(tag, "prompt_logprobs", [Sampled, ...])`` for the prompt
positions a step computed (only when the request asks for them), ``(tag, "token", Sampled)`` for
every new token, then one of
``(tag, "done", finish_reason)`` ("stop": EOS or a stop token id; "length": max_tokens) or
``(tag, "error", RequestError)``. The engine hands a request's events of one step to its sink in one
call (``put_many``), so an asyncio handler is woken once per step, not once per token.
"""

from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from .sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
Event = tuple[int, str, Any]


class EventSink(Protocol):
    def put_many(self, items: list[Event]) -> None:
        """Called by the engine thread; must not block."""
        ...


class QueueSink:
    """Events into a thread-safe queue (threads, tests, offline callers)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def put_many(self, items: list[Event]) -> None:
        for item in items:
            self.queue.put(item)

    def get(self, timeout: float | None = None) -> Event:
        return self.queue.get(timeout=timeout)


class AsyncSink:
    """Events into an asyncio queue, handed over with ``loop.call_soon_threadsafe``: the engine
    thread never waits for the event loop. ``gone`` is set by the loop side when the client left."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def put_many(self, items: list[Event]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.put_on_loop, items)
        except RuntimeError:  # the loop is closed: the server is stopping, nobody listens
            pass

    def put_on_loop(self, items: list[Event]) -> None:
        """On the event loop's thread: queue ``items``."""
        for item in items:
            self.queue.put_nowait(item)

    async def get(self) -> Event:
        return await self.queue.get()


@dataclass(frozen=True, slots=True)
class Sampled:
    """One new token of a request, with its logprob and the top logprobs when it asked for them."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False, slots=True)
class Request:
    """One prompt and one choice; also its id in the batcher (hashed by identity)."""

    prompt: list[int]
    max_tokens: int
    """New tokens at most (already checked against the context)."""
    events: EventSink
    params: SamplingParams = GREEDY
    tag: int = 0
    """Its index among the requests of one HTTP request (a choice, or a prompt of /generate)."""
    stop: tuple[int, ...] = ()
    """Token ids that end it (EOS unless ignore_eos, and the request's stop_token_ids)."""
    logprobs: int | None = None
    """Top logprobs to return per token (None: no logprobs at all)."""
    prompt_logprobs: int | None = None
    """Top logprobs to return per prompt token (completions' echo with logprobs; None: none):
    server/core/prompt_logprobs.py sends them as ``(tag, "prompt_logprobs", [Sampled, ...])`` events."""
    prompt_logprobs_sent: int = 1
    """The next prompt position whose logprob is to be sent (position 0 has none): a preempted
    request that recomputes its prompt sends none twice."""
    out: list[int] = field(default_factory=list)
    arrived: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None  # first in a step (queue time ends)
    last_token_at: float | None = None
    admitted: bool = False  # holds a KV-cache row (it was in a step)
    cancelled: bool = False  # set by the handler when its client went away or a stop string hit
    cancel_status: int = 499  # 200: a stop string ended it (served, not cancelled)
    wire_id: int | None = None  # its id between a front end process and the engine's
    finished: bool = False
    finish_reason: str | None = None
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at its admission (the usage's cached_tokens)."""
    cached_sent: bool = False  # the engine process sent cached_tokens to its front end
    lora: str | None = None
    """The LoRA adapter it runs (the request's ``model`` names it); None: the base model."""


def greedy_requests(
    prompts: list[list[int]],
    max_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
    sink: EventSink | None = None,
) -> tuple[Any, list[Request]]:
    """/generate's requests: greedy, one per prompt, tagged by its index (and their sink)."""
    sink = sink or QueueSink()
    stop = tuple(stop_token_ids)
    return sink, [
        Request(p, max_tokens, sink, GREEDY, tag=i, stop=stop) for i, p in enumerate(prompts)
    ]
