"""The engine: one thread owns the model, its KV cache, the GraphRunner and the continuous batcher
(server/core/batching.py). Requests enter through a queue and join between steps: each step decodes the
running requests and prefills prompts in chunks within the plan's token budget, in one batch; a
finished request frees its cache row at once. Plan swaps are captured on the same thread between
steps, so a step never sees two runners; so are on-demand captures (cudagraph.on_demand)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from ..errors import RequestError, not_serving
from ..requests import EventSink, Request, Sampled, greedy_requests
from . import lora_serving
from .batching import StepBatch
from .metrics import ServerMetrics, render_metrics
from .model import ModelSpec, ServingSpec
from .outbox import Outbox
from .pipeline import Pipeline
from .plan_swap import Swap, capture_runner, checked_table, swap_result, wait_for_swap
from .startup import build_parts, checked_speculation, make_batcher
from .step_sampler import StepSampler

log = logging.getLogger("graphplan.server")


class Engine(lora_serving.LoraMethods):
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
        async_scheduling: bool = True,
        fused_sampler: bool | None = None,
        speculative: Any = None,
        enable_prefix_caching: bool = True,
    ):
        self.enable_prefix_caching = enable_prefix_caching  # models/prefix_cache.py
        self.table, self.source, self.overrides = table, str(source), overrides
        self.spec, self.device, self.progress = spec, device, progress
        self.max_waiting = max_waiting
        # StepSampler(fused=...): server/core/sampling_kernels.py; None: on where the model is on CUDA
        self.fused_sampler = fused_sampler
        self.on_demand = on_demand  # None: the table's cudagraph.on_demand setting
        self.metrics = ServerMetrics()
        self.outbox = Outbox(self.metrics)  # a step's events, delivered once the next one runs
        # speculative decoding (a spec.config.SpeculativeConfig): synchronous steps
        self.speculative = speculative
        self.spec_step: Any = None  # its step (server/core/spec/step.py)
        self.proposer: Any = None  # its drafts (server/core/spec/proposer.py)
        async_scheduling &= speculative is None or checked_speculation(speculative, table)
        self.pipeline = Pipeline(self, async_scheduling)  # the step (server/core/pipeline.py)
        self.capture = lambda table: capture_runner(
            self.model, table, device, progress, self.compiled, on_demand
        )  # a runner of this engine's model for ``table``
        self.state = "starting"  # -> ready -> draining -> stopped, or failed
        self.error: BaseException | None = None
        self.model: Any = None
        self.runner: Any = None
        self.batcher: Any = None
        self.compiled: Any = None
        self.sampler: StepSampler | None = None
        self._kv_total = 0
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()  # submitted, not yet handed to the batcher
        self._swaps: deque[Swap] = deque()
        self._pending: Swap | None = None
        self._live: list[Request] = []  # in the batcher (engine thread only)
        self._stop = False
        self._ready = threading.Event()
        self.reload_lock = threading.Lock()
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

    def is_ready(self) -> int:
        return int(self.state == "ready")

    def kv_blocks_free(self) -> int:
        """Free KV blocks (a model without a block pool: free cache rows)."""
        pool = self.model.kv_pool if self.model is not None else None
        if pool is None:
            return self.model.cfg.num_cache_rows - self.num_running() if self.model else 0
        return pool.num_free()

    def quiet(self) -> bool:
        """No plan swap is pending (async scheduling may go on). Requests that arrived meanwhile
        join the batcher's queue at the next loop, mid-pipeline; whether one could join the next
        step is the batcher's ``speculate`` to say."""
        return not (self._swaps or self._pending is not None)

    def kv_blocks_used(self) -> int:
        return max(0, self._kv_total - self.kv_blocks_free())

    def submit(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        stop_token_ids: tuple[int, ...] = (),
        sink: EventSink | None = None,
    ) -> tuple[Any, list[Request]]:
        """Greedy requests, one per prompt (all or none): (their sink, the requests)."""
        sink, reqs = greedy_requests(prompts, max_tokens, stop_token_ids, sink)
        self.enqueue(reqs)
        return sink, reqs

    def enqueue(self, reqs: list[Request]) -> None:
        """Queue requests (all or none): RequestError 503 while not serving, 429 when full."""
        with self._cond:
            if self.state != "ready":
                raise not_serving(self.state)
            lora_serving.check_requests(getattr(self, "model", None), reqs)
            if len(self._waiting) + len(reqs) > self.max_waiting:
                raise RequestError(
                    429,
                    f"{len(self._waiting)} requests are queued (limit "
                    f"{self.max_waiting}); retry later",
                )
            self._waiting.extend(reqs)
            self._cond.notify()

    def cancel(self, reqs: list[Request], status: int = 499) -> None:
        """Abort these requests at the next step: their seats and KV blocks are freed then. Status
        499: their client left; 200: the front end ended them (a stop string matched), so they
        count as served, with their latency. Any thread; finished ones are ignored."""
        with self._cond:
            for r in reqs:
                if not r.cancelled:  # the first reason stands (a stop string, then the hang-up)
                    r.cancelled, r.cancel_status = True, status
            self._cond.notify()

    def health(self) -> dict:
        """/healthz's body: the state, the plan serving, and the start-up error if any."""
        body: dict = {
            "status": self.state,
            "plan": self.table.settings.name,
            "fingerprint": self.table.fingerprint,
        }
        if self.error is not None:
            body["error"] = f"{type(self.error).__name__}: {self.error}"
        return body

    def count_response(self, code: int, path: str) -> None:
        """One HTTP response a front end answered (the metrics count them by route)."""
        self.metrics.response(code, path)

    async def scrape(self) -> str:
        """/metrics' text: the runner's series, then the server's."""
        return render_metrics(self)

    def reload(
        self, source: str | None = None, overrides: dict | None = None, timeout: float = 600
    ) -> dict:
        """Compile-and-load a table, capture it on the engine thread between steps, switch.
        Raises RequestError (the old table stays) if it is invalid, does not fit or fails."""
        if not self.reload_lock.acquire(blocking=False):
            raise RequestError(409, "a reload is already in progress; retry when it finishes")
        try:
            if self.state != "ready":
                raise RequestError(503, f"cannot reload: server is {self.state}")
            src = str(source) if source else self.source
            ov = overrides if overrides is not None or source else self.overrides
            old = self.table.fingerprint
            table = checked_table(src, ov, self.model, old, self.metrics)
            if self.speculative is not None:
                from .spec.engine import check_reload

                check_reload(self.speculative, table, self.metrics)
            if table.content_fingerprint == self.table.content_fingerprint:  # same graphs, routes
                self.metrics.reload("unchanged")
                self.source, self.overrides = src, ov
                return {"fingerprint": old, "previous": old, "plan": table.settings.name} | {
                    "unchanged": True
                }
            swap = Swap(table, src, ov)
            with self._cond:
                self._swaps.append(swap)
                self._cond.notify()
            return wait_for_swap(swap, self._thread, timeout, old, self.metrics)
        finally:
            self.reload_lock.release()

    def stop(self, drain_timeout: float = 30.0) -> bool:
        """Stop accepting, let queued and running requests finish (up to drain_timeout), fail the
        rest with 503, and join the engine thread. True when none had to be failed."""
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
        drained = not (self._waiting or self._live)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        if self.state != "failed":
            self.state = "stopped"
        return drained

    # -- the engine thread ------------------------------------------------------------------
    def _main(self) -> None:
        try:
            build_parts(self)
        except BaseException as e:
            log.error("start-up failed: %s: %s", type(e).__name__, e)
            self.error, self.state = e, "failed"
            self._ready.set()
            return
        self.batcher = make_batcher(self)
        self._kv_total = self.kv_blocks_free()
        self.metrics.attach(self)
        with self._cond:
            if self.state == "starting":
                self.state = "ready"
        self._ready.set()
        log.info(
            "ready: plan %r (fingerprint %s), %d KV-cache rows",
            self.table.settings.name,
            self.table.fingerprint[:19],
            self.model.cfg.num_cache_rows,
        )
        try:
            self._loop()
        finally:
            self._fail_all(RequestError(503, "server is shutting down"))
            if self.sampler is not None:
                self.sampler.release_graphs()

    def _loop(self) -> None:
        awake = self.pipeline.awake
        while True:
            with self._cond:
                while not (self._waiting or self._live or self._swaps or self._stop or awake()):
                    self.outbox.flush()
                    self._cond.wait()
                if self._stop and self.pipeline.leave():  # DP: between waves, together
                    return
                swaps, new = list(self._swaps), list(self._waiting)
                self._swaps.clear()
                self._live = self._live + new  # before the clear: stop() never sees neither
                self._waiting.clear()
            for r in new:  # joining the queue changes no running request: safe mid-pipeline
                self.batcher.add(
                    r, r.prompt, r.max_tokens, r.stop,
                    extra_key=r.lora,  # an adapter's blocks are its own
                    cache_lookup=r.prompt_logprobs is None,
                )  # fmt: skip
                self.metrics.prompt_tokens.inc(len(r.prompt))
            if self.pipeline.busy:  # async scheduling: a step is in flight
                cancelled = any(r.cancelled for r in self._live)
                if not (swaps or self._pending or cancelled) and self.pipeline.advance():
                    self._live = [r for r in self._live if not r.finished]
                    continue
                self.pipeline.drain()
            for swap in swaps:
                self._capture_swap(swap)
            if self._pending is not None:
                self._maybe_switch()
            for r in self._live:
                if r.cancelled:
                    self.batcher.abort(r)
                    if r.cancel_status == 200:  # a stop string: served, ends as "stop"
                        r.finish_reason = "stop"
                        self.finish(r)
                    else:
                        self.finish(r, RequestError(499, "cancelled: the client left"))
            preempted = self.batcher.num_preemptions
            batch = self.batcher.schedule()
            if self.batcher.num_preemptions > preempted:
                self.metrics.preemptions.inc(self.batcher.num_preemptions - preempted)
            self.metrics.prefix_cache(self.batcher)
            for r in self.batcher.preempted:  # rebound where they resume, replaying their tokens
                self.sampler.release(r)  # type: ignore[union-attr]
            self.batcher.preempted.clear()
            if batch is not None:
                self._step(batch)
            else:
                self.pipeline.idle()  # with data parallelism, a dummy step while peers work
            self._live = [r for r in self._live if not r.finished]
            if batch is None and self._live:  # nothing can run yet: do not spin
                time.sleep(0.001)

    def _capture_swap(self, swap: Swap) -> None:
        try:
            swap.runner = self.capture(swap.table)
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
        assert swap is not None
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
        swap.result = swap_result(swap, prev)
        swap.runner = None
        log.info(
            "switched to plan %r (fingerprint %s) with %d requests running",
            swap.table.settings.name,
            swap.table.fingerprint[:19],
            self.num_running(),
        )
        swap.done.set()

    def sample_step(self, batch: StepBatch, logits) -> list[Sampled]:
        """The step's new tokens, one per request that samples (``batch.sampling_rows`` order)."""
        assert self.sampler is not None
        return self.sampler.sample(batch, logits)

    def _step(self, batch: StepBatch) -> None:
        if self.spec_step is not None:
            self.spec_step.step(batch)
            return
        self.pipeline.step(batch)

    def ended(self, r: Request, token: int, items: list) -> None:
        self.batcher.finished.pop(r, None)
        r.finish_reason = "stop" if token in r.stop else "length"
        self.finish(r, batched=items)

    def finish(
        self, r: Request, error: RequestError | None = None, batched: list | None = None
    ) -> None:
        if r.finished:
            return
        r.finished = True
        if self.sampler is not None:
            self.sampler.release(r)
        self.metrics.finished(r, error.status if error else 200, time.perf_counter())
        event = (r.tag, "error", error) if error else (r.tag, "done", r.finish_reason)
        if batched is not None:
            batched.append(event)
        else:  # after what the outbox holds for it, in order
            self.outbox.flush()
            r.events.put_many([event])

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
            self.finish(r, error)
        self._live = []
