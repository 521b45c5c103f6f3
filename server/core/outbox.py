"""What a step tells its clients, handed over while the next step runs on the device.

The engine thread collects a step's events per sink (tokens, prompt logprobs, ends) and the token
times its latency histograms need, and delivers them after it has launched the next step (or before
it waits for work): the hand-over to the HTTP event loop and the histograms' bookkeeping then
overlap the device's work instead of delaying the next launch, and the event loop formats the
clients' chunks while the engine thread waits for the device with the GIL released. All the
asyncio sinks of one event loop get one ``call_soon_threadsafe`` per delivery, not one each.
Events of one request keep their order: an event sent outside a step (an error, a cancellation)
flushes what is pending first."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable

from ..requests import AsyncSink, Event, EventSink


class Outbox:
    def __init__(self, metrics: Any):
        self.metrics = metrics
        self._by_sink: dict[int, tuple[EventSink, list[Event]]] = {}
        self._tokens: list[tuple[Any, float]] = []

    def events(self, sink: EventSink) -> list[Event]:
        """The pending events of ``sink`` (append to it, in order)."""
        return self._by_sink.setdefault(id(sink), (sink, []))[1]

    def token_at(self, r: Any, now: float) -> None:
        """Request ``r`` got a token at ``now`` (its TTFT or inter-token latency, observed at
        delivery)."""
        self._tokens.append((r, now))

    def tokens(self, events: Iterable[Any], sampled: dict, now: float, ended: Callable) -> None:
        """A step's token events (the batcher's, ``request_id`` a Request): each request's
        token, with its ``Sampled`` from ``sampled``; ``ended(r, token, items)`` for the last."""
        for ev in events:
            r = ev.request_id
            r.out.append(ev.token)
            self.token_at(r, now)
            items = self.events(r.events)
            items.append((r.tag, "token", sampled[r]))
            if ev.finished:
                ended(r, ev.token, items)

    def flush(self) -> None:
        tokens, self._tokens = self._tokens, []
        self.metrics.tokens(tokens)
        by_sink, self._by_sink = self._by_sink, {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[AsyncSink, list[Event]]]] = {}
        for sink, items in by_sink.values():
            if isinstance(sink, AsyncSink):
                by_loop.setdefault(sink.loop, []).append((sink, items))
            else:
                sink.put_many(items)
        for loop, batches in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batches)
            except RuntimeError:  # the loop is closed: the server is stopping, nobody listens
                pass


def _put_all(batches: list[tuple[AsyncSink, list[Event]]]) -> None:
    for sink, items in batches:
        sink.put_on_loop(items)
