"""The engine as a front end process sees it: ``EngineClient`` has the in-process ``Engine``'s
surface for the HTTP side (``enqueue``, ``submit``, ``cancel``, ``reload``, ``health``, ``scrape``,
``count_response``, ``state``) and talks to the engine core process over ZeroMQ.

Requests keep their ``Request`` objects here (the handlers read ``out``, ``finished`` and
``finish_reason`` as they do in one process); the engine process holds its own twins. Each engine
step arrives as one ``Step`` message, read by ``serve_events`` on the front end's event loop, which
updates the requests and hands each HTTP request its events in one call: no thread hop, no lock.
Sends go through one PUSH socket under a lock (the event loop sends requests and cancellations;
a reload waits on a thread of its own).

With data parallelism it talks to every engine process (server/wire/engines.py): each request goes
to one, its cancel to the same one; the state is all of theirs; /metrics labels each one's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from typing import Any

import zmq
import zmq.asyncio

from ..errors import RequestError, not_serving
from ..requests import AsyncSink, Request
from . import messages as m
from .engines import Router, merge_metrics, server_state

log = logging.getLogger("graphplan.server")


class EngineClient:
    def __init__(
        self, spec: Any, table: Any, index: int, engine_address: str | list[str], address: str
    ):
        self.spec, self.index = spec, index
        self.state = "starting"  # the engine's, as its Status messages say
        self.error: str | None = None
        self.drained = False
        self.plan, self.fingerprint = table.settings.name, table.fingerprint
        self.address = address  # this front end's PULL socket (bound by serve_events)
        self.live: dict[int, Request] = {}
        self.stopped = threading.Event()  # the engine said stopped or failed
        self._rids = itertools.count()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        addresses = [engine_address] if isinstance(engine_address, str) else engine_address
        self._pushes: list[Any] = []  # one per engine (data parallelism: several)
        for a in addresses:
            push: Any = zmq.Context.instance().socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a burst of requests
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(a)
            self._pushes.append(push)
        self._push = self._pushes[0]
        self.states = ["starting"] * len(addresses)  # each engine's, by its Status messages
        self._drained = [True] * len(addresses)
        self.router = Router(len(addresses))
        self._at: dict[int, int] = {}  # rid -> the engine that holds it
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the Engine surface the HTTP side uses ---------------------------------------------------
    def limits(self) -> dict:
        return self.spec.limits()

    def health(self) -> dict:
        body: dict = {"status": self.state, "plan": self.plan, "fingerprint": self.fingerprint}
        if self.error is not None:
            body["error"] = self.error
        return body

    def enqueue(self, reqs: list[Request]) -> None:
        if self.state != "ready":
            raise not_serving(self.state)
        wire: dict[int, list] = {}
        for r in reqs:
            rid = next(self._rids)
            self.live[rid] = r
            d = self.router.pick()
            self._at[rid] = d
            wire.setdefault(d, []).append(
                m.WireRequest(
                    rid,
                    r.prompt,
                    r.max_tokens,
                    r.params,
                    r.stop,
                    r.logprobs,
                    r.prompt_logprobs,
                    r.lora,
                )
            )
            r.wire_id = rid
        for d, ws in wire.items():
            self.send(m.Add(self.index, ws), d)

    def cancel(self, reqs: list[Request], status: int = 499) -> None:
        gone = [r for r in reqs if not (r.finished or r.cancelled)]
        rids = [r.wire_id for r in gone if r.wire_id is not None]
        for r in gone:  # the first reason stands (a stop string, then the hang-up)
            r.cancelled = True
        by_engine: dict[int, list[int]] = {}
        for rid in rids:
            by_engine.setdefault(self._at.get(rid, 0), []).append(rid)
        for d, ids in by_engine.items():
            self.send(m.Cancel(self.index, ids, status), d)

    def reload(
        self, source: str | None = None, overrides: dict | None = None, timeout: float = 600
    ) -> dict:
        reply = self.call("reload", [source, overrides]).result(timeout)
        if reply.status != 200:
            raise RequestError(reply.status, reply.body)
        return reply.body

    def load_lora(self, name: str, path: str, timeout: float = 120) -> dict:
        return self._answer(self.call("load_lora", [name, path]).result(timeout))

    def unload_lora(self, name: str, timeout: float = 120) -> dict:
        return self._answer(self.call("unload_lora", [name]).result(timeout))

    @staticmethod
    def _answer(reply) -> dict:
        if reply.status != 200:
            raise RequestError(reply.status, reply.body)
        return reply.body

    async def scrape(self) -> str:
        calls = [asyncio.wrap_future(self.call("metrics", to=d)) for d in range(len(self._pushes))]
        replies = await asyncio.wait_for(asyncio.gather(*calls), 30)
        if len(replies) == 1:
            return replies[0].body
        return merge_metrics([r.body for r in replies])

    def count_response(self, code: int, path: str) -> None:
        if self.state not in ("stopped", "failed"):
            self.send(m.Responses([(int(code), path)]))

    # -- the wire --------------------------------------------------------------------------------
    def send(self, msg: Any, to: int = 0) -> None:
        """To engine ``to`` (engine 0: every call but a metrics scrape, the responses' counts)."""
        data = m.encoder.encode(msg)
        with self._lock:
            self._pushes[to].send(data, copy=False)

    def broadcast(self, msg: Any) -> None:
        """To every engine (a drain, a front end gone)."""
        for d in range(len(self._pushes)):
            self.send(msg, d)

    def call(self, what: str, args: list | None = None, to: int = 0) -> concurrent.futures.Future:
        """Ask the engine process (a reload, a metrics scrape); the Future gets its ``Reply``."""
        if self.state in ("stopped", "failed"):
            raise RequestError(503, f"the engine is {self.state}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        cid = next(self._call_ids)
        self._calls[cid] = fut
        self.send(m.Call(self.index, cid, what, args or []), to)
        return fut

    async def serve_events(self) -> None:
        """On the front end's event loop, for its life: the engine's messages to this front end."""
        self._loop = asyncio.get_running_loop()
        ctx = zmq.asyncio.Context.instance()
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.bind(self.address)
        try:
            while True:
                self._handle(m.to_frontend.decode(await pull.recv()))
        finally:
            pull.close(linger=0)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, m.Step):
            self._deliver(msg.events)
        elif isinstance(msg, m.Status):
            self._status(msg)
        else:
            fut = self._calls.pop(msg.call, None)
            if fut is not None:
                fut.set_result(msg)

    def _deliver(self, events: list) -> None:
        by_sink: dict[int, tuple[AsyncSink, list]] = {}
        for e in events:
            rid, kind, value = m.event_in(e)
            r = self.live.get(rid)
            if r is None:
                continue
            if kind == "token":
                r.out.append(value.token)
                cached = m.cached_tokens(e)
                if cached is not None:
                    r.cached_tokens = cached
            elif kind in ("done", "error"):
                del self.live[rid]
                d = self._at.pop(rid, None)
                if d is not None:
                    self.router.done(d)
                r.finished = True
                if kind == "done":
                    r.finish_reason = value
            sink = r.events
            by_sink.setdefault(id(sink), (sink, []))[1].append((r.tag, kind, value))  # type: ignore[arg-type]
        for sink, items in by_sink.values():
            sink.put_on_loop(items)

    def _status(self, s: m.Status) -> None:
        if s.state == "failed" and self.state == "starting":  # as the one-process engine logs it
            log.error("start-up failed: %s", s.error)
        self.plan, self.fingerprint = s.plan or self.plan, s.fingerprint or self.fingerprint
        if 0 <= s.engine < len(self.states):
            self.states[s.engine], self._drained[s.engine] = s.state, s.drained
        self.state, self.drained = server_state(self.states), all(self._drained)
        if s.state == "failed":
            self.state = "failed"
        if s.error:
            self.error = s.error
        if self.state in ("stopped", "failed"):
            self.fail_all(s.error or f"the engine {s.state}")
            self.stopped.set()
            for fut in self._calls.values():
                fut.set_result(m.Reply(-1, 503, f"the engine {s.state}"))
            self._calls.clear()

    def drain(self, timeout: float) -> None:
        """Refuse new requests here at once (503) and ask the engine to drain."""
        self.state = "draining"
        self.broadcast(m.Drain(timeout))

    def fail_all(self, message: str) -> None:
        """End every open request with a 503 (on the event loop): the engine is gone."""
        events = [[rid, m.ERROR, 503, message, [None, None]] for rid in list(self.live)]
        if events:
            self._deliver(events)

    def engine_died(self, message: str) -> None:
        """From another thread (the supervisor): the engine process is gone."""
        status = m.Status("failed", error=message)
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._status, status)
                return
            except RuntimeError:
                pass
        self._status(status)

    def close(self) -> None:
        with self._lock:
            for push in self._pushes:
                push.close(linger=100)
