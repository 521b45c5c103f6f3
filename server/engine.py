"""The engine: one thread owns the model, its KV cache, the GraphRunner and the continuous batcher
(server/batching.py). Requests enter through a queue and join between steps: each step decodes the
running requests and prefills prompts in chunks within the plan's token budget, in one batch; a
finished request frees its cache row at once. Plan swaps are captured on the same thread between
steps, so a step never sees two runners; so are on-demand captures (cudagraph.on_demand: the
runner captures a graph first needed by a step before the next step)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from graphplan.compiler.errors import GraphplanError
from graphplan.runtime import GraphRunner

from .batching import ContinuousBatcher
from .metrics import ServerMetrics
from .model import ModelSpec, ServingSpec, build_model, check_fits, compiled_model, load_table
from .protocol import RequestError

log = logging.getLogger("graphplan.server")


@dataclass(eq=False, slots=True)
class Request:
    """One prompt; also its id in the batcher (hashed by identity)."""

    prompt: list[int]
    max_tokens: int
    events: queue.SimpleQueue
    """(tag, "token", id) when streaming, then (tag, "done", None) or (tag, "error", err)."""
    tag: int = 0
    stream: bool = False
    stop: tuple[int, ...] = ()
    out: list[int] = field(default_factory=list)
    arrived: float = field(default_factory=time.perf_counter)
    admitted: bool = False  # holds a KV-cache row (it was in a step)
    cancelled: bool = False  # set by the handler when its client went away
    finished: bool = False


@dataclass(eq=False, slots=True)
class _Swap:
    table: object
    source: str
    overrides: dict | None
    done: threading.Event = field(default_factory=threading.Event)
    runner: GraphRunner | None = None  # captured, waiting for the running requests to fit
    result: dict | None = None
    error: BaseException | None = None


class Engine:
    def __init__(
        self,
        table,
        source: str,
        overrides: dict | None = None,
        *,
        spec: ServingSpec = ModelSpec(),
        device: str = "cpu",
        progress: bool = True,
        max_waiting: int = 1024,
        on_demand: bool | None = None,
    ):
        self.table, self.source, self.overrides = table, str(source), overrides
        self.spec, self.device, self.progress = spec, device, progress
        self.max_waiting = max_waiting
        self.on_demand = on_demand  # None: the table's cudagraph.on_demand setting
        self.metrics = ServerMetrics()
        self.state = "starting"  # -> ready -> draining -> stopped, or failed
        self.error: BaseException | None = None
        self.model = self.runner = self.batcher = self.compiled = None
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()  # submitted, not yet handed to the batcher
        self._swaps: deque[_Swap] = deque()
        self._pending: _Swap | None = None
        self._live: list[Request] = []  # in the batcher (engine thread only)
        self._stop = False
        self._ready = threading.Event()
        self._reload_lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="graphplan-engine")

    # -- called from other threads ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout) and self.state == "ready"

    def limits(self) -> dict:
        return self.spec.limits()

    def queue_depth(self) -> int:
        return len(self._waiting) + sum(not (r.admitted or r.finished) for r in self._live)

    def num_running(self) -> int:
        return sum(r.admitted and not r.finished for r in self._live)

    def submit(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        stream: bool = False,
        stop_token_ids: tuple[int, ...] = (),
    ):
        """Queue one request per prompt (all or none); returns (events, requests)."""
        events = queue.SimpleQueue()
        reqs = [
            Request(p, max_tokens, events, tag=i, stream=stream, stop=tuple(stop_token_ids))
            for i, p in enumerate(prompts)
        ]
        with self._cond:
            if self.state != "ready":
                raise RequestError(
                    503,
                    f"server is {self.state}"
                    + (": capturing graphs" if self.state == "starting" else ""),
                )
            if len(self._waiting) + len(reqs) > self.max_waiting:
                raise RequestError(
                    429,
                    f"{len(self._waiting)} requests are queued (limit "
                    f"{self.max_waiting}); retry later",
                )
            self._waiting.extend(reqs)
            self._cond.notify()
        return events, reqs

    def reload(
        self, source: str | None = None, overrides: dict | None = None, timeout: float = 600
    ) -> dict:
        """Compile-and-load a table, capture it on the engine thread between steps, switch.
        Raises RequestError (the old table stays) if it is invalid, does not fit or fails."""
        if not self._reload_lock.acquire(blocking=False):
            raise RequestError(409, "a reload is already in progress; retry when it finishes")
        try:
            if self.state != "ready":
                raise RequestError(503, f"cannot reload: server is {self.state}")
            src = str(source) if source else self.source
            ov = overrides if overrides is not None or source else self.overrides
            old = self.table.fingerprint
            try:
                table = load_table(src, ov)
                check_fits(table, self.model)
            except (GraphplanError, RecursionError, ValueError) as e:  # the file's fault
                self.metrics.reload("rejected")
                raise RequestError(422, f"plan rejected, still serving {old[:19]}: {e}") from None
            if table.content_fingerprint == self.table.content_fingerprint:  # same graphs, routes
                self.metrics.reload("unchanged")
                self.source, self.overrides = src, ov
                return {
                    "fingerprint": old,
                    "previous": old,
                    "plan": table.settings.name,
                    "unchanged": True,
                }
            swap = _Swap(table, src, ov)
            with self._cond:
                self._swaps.append(swap)
                self._cond.notify()
            deadline = time.monotonic() + timeout
            while not swap.done.wait(0.05):
                if not self._thread.is_alive():
                    raise RequestError(503, "server is shutting down; the reload was dropped")
                if time.monotonic() > deadline:
                    raise RequestError(504, f"the reload did not finish in {timeout} s")
            if swap.error is not None:
                self.metrics.reload("failed")
                e = swap.error
                status = 422 if isinstance(e, GraphplanError) else 500
                raise RequestError(
                    status, f"capture failed, still serving {old[:19]}: {type(e).__name__}: {e}"
                )
            self.metrics.reload("ok")
            return swap.result
        finally:
            self._reload_lock.release()

    def stop(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let queued and running requests finish (up to drain_timeout), fail the
        rest with 503, and join the engine thread."""
        with self._cond:
            if self.state in ("ready", "starting"):
                self.state = "draining"
        deadline = time.monotonic() + drain_timeout
        while (
            (self._waiting or self._live)
            and self._thread.is_alive()
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        if self.state != "failed":
            self.state = "stopped"

    # -- the engine thread ------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.model = build_model(self.spec, self.table, self.device)
            self.compiled = compiled_model(self.spec, self.model)  # None unless --compile
            self.runner = self._capture(self.table)
        except BaseException as e:
            log.error("start-up failed: %s: %s", type(e).__name__, e)
            self.error, self.state = e, "failed"
            self._ready.set()
            return
        cfg, t = self.model.cfg, self.table
        self.batcher = ContinuousBatcher(
            max_num_seqs=t.max_num_seqs,
            token_budget=t.max_tokens,
            max_model_len=cfg.max_model_len,
            num_cache_rows=cfg.num_cache_rows,
            kv_pool=self.model.kv_pool,
        )
        with self._cond:
            if self.state == "starting":
                self.state = "ready"
        self._ready.set()
        log.info(
            "ready: plan %r (fingerprint %s), %d KV-cache rows",
            self.table.settings.name,
            self.table.fingerprint[:19],
            cfg.num_cache_rows,
        )
        try:
            self._loop()
        finally:
            self._fail_all(RequestError(503, "server is shutting down"))

    def _capture(self, table) -> GraphRunner:
        runner = GraphRunner(
            self.model,
            table,
            self.model.static_inputs(),
            device=self.device,
            progress=self.progress,
            compile=self.compiled,
            on_demand=self.on_demand,
        )
        log.info(
            "capturing %d graphs%s of plan %r (fingerprint %s) on %s",
            len(table.graphs),
            " on demand (the start set now, the rest on first use)" if runner.on_demand else "",
            table.settings.name,
            table.fingerprint[:19],
            self.device,
        )
        runner.capture()
        return runner

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._live or self._swaps or self._stop):
                    self._cond.wait()
                if self._stop:
                    return
                swaps, new = list(self._swaps), list(self._waiting)
                self._swaps.clear()
                self._live = self._live + new  # before the clear: stop() never sees neither
                self._waiting.clear()
            for r in new:
                self.batcher.add(r, r.prompt, r.max_tokens, r.stop)
                self.metrics.prompt_tokens += len(r.prompt)
            for swap in swaps:
                self._capture_swap(swap)
            if self._pending is not None:
                self._maybe_switch()
            for r in self._live:
                if r.cancelled:
                    self.batcher.abort(r)
                    self._finish(r, RequestError(499, "client closed the connection"))
            batch = self.batcher.schedule()
            if batch is not None:
                self._step(batch)
            self._live = [r for r in self._live if not r.finished]
            if batch is None and self._live:  # nothing can run yet: do not spin
                time.sleep(0.001)

    def _capture_swap(self, swap: _Swap) -> None:
        try:
            swap.runner = self._capture(swap.table)
        except Exception as e:
            log.error(
                "reload failed, keeping plan %r: %s: %s",
                self.table.settings.name,
                type(e).__name__,
                e,
            )
            swap.error = e
            swap.done.set()
            return
        self._pending = swap
        # a plan with fewer seats: admit no more than it allows, switch once the running fit
        self.batcher.max_num_seqs = min(self.batcher.max_num_seqs, swap.table.max_num_seqs)

    def _maybe_switch(self) -> None:
        swap = self._pending
        if self.num_running() > swap.table.max_num_seqs:
            return
        self._pending = None
        with self.metrics.lock:  # /metrics sees the old counters or the new runner plus them
            self.metrics.retire(self.runner.stats())
            old, self.runner = self.runner, swap.runner
        prev = self.table.fingerprint
        self.table, self.source, self.overrides = swap.table, swap.source, swap.overrides
        self.batcher.max_num_seqs = swap.table.max_num_seqs
        self.batcher.token_budget = swap.table.max_tokens
        old.release()
        cap = swap.runner.stats()["capture"]
        swap.result = {
            "fingerprint": swap.table.fingerprint,
            "previous": prev,
            "plan": swap.table.settings.name,
            "unchanged": False,
            "capture": {
                "graphs": cap.get("graphs", 0),
                "seconds": round(cap.get("seconds", 0.0), 4),
            },
        }
        swap.runner = None
        log.info(
            "switched to plan %r (fingerprint %s) with %d requests running",
            swap.table.settings.name,
            swap.table.fingerprint[:19],
            self.num_running(),
        )
        swap.done.set()

    def _step(self, batch) -> None:
        t0 = time.perf_counter()
        try:
            inputs = self.model.make_batch(batch.reqs)
            logits = self.runner.step(
                inputs, num_reqs=batch.num_reqs, max_query_len=batch.max_query_len
            )
            events = self.batcher.commit(batch, logits)
        except Exception as e:
            log.exception("engine step of %d requests failed; failing them", batch.num_reqs)
            self.metrics.step_errors += 1
            err = RequestError(500, f"internal error in the engine step: {type(e).__name__}: {e}")
            for r in batch.request_ids:
                self.batcher.abort(r)
                self._finish(r, err)
            return
        self.metrics.step(time.perf_counter() - t0, batch.num_tokens, batch.max_query_len > 1)
        for r in batch.request_ids:
            r.admitted = True
        for ev in events:
            r = ev.request_id
            r.out.append(ev.token)
            if r.stream:
                r.events.put((r.tag, "token", ev.token))
            if ev.finished:
                self.batcher.finished.pop(r, None)
                self._finish(r)

    def _finish(self, r: Request, error: RequestError | None = None) -> None:
        if r.finished:
            return
        r.finished = True
        self.metrics.finished(
            error.status if error else 200, time.perf_counter() - r.arrived, len(r.out)
        )
        r.events.put((r.tag, "error", error) if error else (r.tag, "done", None))

    def _fail_all(self, error: RequestError) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            swaps = [*self._swaps, *([self._pending] if self._pending else [])]
            self._swaps.clear()
            self._pending = None
        for s in swaps:
            if s.runner is not None:
                s.runner.release()
            s.error = RuntimeError("server is shutting down")
            s.done.set()
        for r in [*self._live, *waiting]:
            if self.batcher is not None:
                self.batcher.abort(r)
            self._finish(r, error)
        self._live = []
