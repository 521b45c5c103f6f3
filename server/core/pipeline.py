"""The engine's step, and async scheduling (``Engine(async_scheduling=True)``, ``serve
--async-scheduling``: vLLM's ``--async-scheduling`` idea): in the steady decode state, step N+1 is
launched before step N's tokens are read, so the host's work between two steps (commit, schedule,
the model's batch, the runner's input copies) overlaps the device's instead of leaving it idle.

Without it, a step is launched, its tokens read (the wait for the device), committed, and its
events queued for the outbox (delivered once the next step runs), exactly as it always was.

With it, after step N is launched with its tokens left on the device (``StepSampler.launch(keep=
True)``, their copy to the host started), the batcher records a placeholder token for each of N's
requests (``ContinuousBatcher.speculate``) when the next step is surely every one of them decoding
once more, but those whose token at N is their last (max_tokens: they end at N whatever it is,
and N+1 leaves them out): all of N's requests decode and sample, none asks for prompt logprobs,
none is cancelled, no request in the batcher's queue could be admitted (arrivals join the queue at
the next loop, mid-pipeline; with every seat taken they wait either way; a request that arrives
while a step is in flight, or a seat freed by a request that stops at N, is taken up one step
later than synchronously), no plan swap is pending, not all of them reach max_tokens at N, and
the free KV blocks hold every next token (so ``schedule()`` preempts nothing). Then step
N+1 is scheduled, its batch built (``make_batch(non_blocking=True)``: no wait for the device) and
its ``input_ids`` replaced on the device by N's sampled tokens, and it is launched with its
sampling. Only then are N's tokens read and resolved (``ContinuousBatcher.resolve``): the
placeholders become the tokens, N's events go to the outbox, and requests that stop at N finish
at once (seat and KV blocks freed). They are in N+1 too: their N+1 token is dropped (no event),
and N+1's writes into their freed blocks are ordered on the device before those of any later step
that reuses them; a sampler slot they leave is rebound before its next use. Each loop iteration
then continues the pipeline (``advance``) or, when a condition fails (a request that could join, a
cancellation, a swap, prompt logprobs, preemption risk, all at max_tokens), reads and commits the
step in flight first (``drain``), so the batcher is never left speculative across a synchronous
schedule.

Sampling gives the same tokens either way: a step's sampling runs after the previous one's on the
device, so every slot's counter and history advance as they do synchronously."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from graphplan.runtime.buffers import to_device

from ..errors import RequestError
from ..requests import Request, Sampled
from . import prompt_logprobs
from .batching import StepBatch
from .step_logits import StepLogits
from .step_sampler import Pending

log = logging.getLogger("graphplan.server")


@dataclass(slots=True)
class _Flight:
    """A launched step whose tokens are not read yet."""

    batch: StepBatch
    pending: Pending
    t0: float


class Pipeline:
    def __init__(self, engine: Any, async_scheduling: bool = False):
        self.engine = engine  # the Engine whose step this is (its model, runner, batcher...)
        self.async_scheduling = async_scheduling
        self.tp: Any = None
        """Tensor parallelism: rank 0's ``tp_serving.Ranks`` (set by the engine process), which
        sends each step to the worker ranks before it runs."""
        self.dp: Any = None
        """Data parallelism: this engine's ``dp_serving.DPWave`` (set by the engine process): its
        steps are the DP group's, and it runs dummy steps while a peer has work."""
        self.speculated = 0
        """Steps launched before the previous step's tokens were read."""
        self._flight: _Flight | None = None

    @property
    def busy(self) -> bool:
        """A step is in flight (async scheduling): ``advance()`` or ``drain()`` it."""
        return self._flight is not None

    def awake(self) -> bool:
        """Data parallelism: in a wave (the engine steps, dummy steps included, and stops only
        after it); False without DP."""
        return self.dp is not None and self.dp.awake()

    def leave(self) -> bool:
        """The engine is stopping (under its condition): may its loop end now? Without data
        parallelism at once; with it only between waves and together with every DP peer
        (``DPWave.leave``, which waits for them), so no peer steps waiting on one that left."""
        return self.dp is None or self.dp.leave()

    def idle(self) -> None:
        """A loop of the engine without a step to run: deliver what the outbox holds; with data
        parallelism, the dummy step while the wave lasts."""
        self.engine.outbox.flush()
        if self.dp is not None:
            self.dp.idle()

    def step(self, batch: StepBatch) -> None:
        """Run a freshly scheduled step (the engine's ``_step``)."""
        e = self.engine
        if self.dp is not None:  # a wave starts (every DP peer is woken) or goes on
            self.dp.begin()
        t0 = time.perf_counter()
        try:
            nb = {"non_blocking": True} if self.async_scheduling else {}
            loras = lora_step(e.model, batch)  # before make_batch: it reads the seats' slots
            inputs = e.model.make_batch(batch.reqs, **nb)
            if self.tp is not None:  # tensor parallelism: the worker ranks run this step too
                self.tp.step(batch)  # after make_batch: with the blocks it reserved
            out = e.runner.step(inputs, batch.num_reqs, batch.max_query_len, loras)
            logits = StepLogits.of(e.model, out)  # read at the rows a step samples (and prompts')
            prompt_lps = prompt_logprobs.launch(batch, logits)  # None unless a request asks
            if self.async_scheduling and prompt_lps is None and self._eligible(batch):
                assert e.sampler is not None
                pending = e.sampler.launch(batch, logits, keep=True)
                e.outbox.flush()  # the last step's events, while this one runs on the device
                flight = _Flight(batch, pending, t0)
                if self._launch_next(flight):
                    return
                sampled = pending.read()
            else:
                e.outbox.flush()
                sampled = e.sample_step(batch, logits)
            prompt_found = prompt_lps.read() if prompt_lps is not None else {}
            events = e.batcher.commit(batch, sampled=[s.token for s in sampled])
        except Exception as exc:
            self.fail([batch], exc)
            return
        prompt_logprobs.merge_into(e.outbox, prompt_found)
        self._deliver(batch, sampled, events, t0)

    def advance(self) -> bool:
        """Continue the pipeline: launch the step after the one in flight, then resolve that one.
        False (nothing done) when the conditions do not hold: ``drain()`` then."""
        f = self._flight
        assert f is not None
        if not self._eligible(f.batch):
            return False
        try:
            return self._launch_next(f)
        except Exception as exc:
            self.fail([f.batch], exc)
            return True

    def drain(self) -> None:
        """Read and commit the step in flight, if any (the pipeline stops)."""
        f, self._flight = self._flight, None
        if f is None:
            return
        try:
            sampled = f.pending.read()
            events = self.engine.batcher.commit(f.batch, sampled=[s.token for s in sampled])
        except Exception as exc:
            self.fail([f.batch], exc)
            return
        self._deliver(f.batch, sampled, events, f.t0)

    def _launch_next(self, f: _Flight) -> bool:
        """``f`` launched, unread: speculate, launch the next step, then read and resolve ``f``.
        False, the batcher untouched, when the next step would not be ``f``'s requests decoding."""
        e = self.engine
        if not e.batcher.speculate(f.batch):
            return False
        t0 = time.perf_counter()
        batch = e.batcher.schedule()
        pos = {rid: i for i, rid in enumerate(f.batch.request_ids)}
        idx = [] if batch is None else [pos.get(rid, -1) for rid in batch.request_ids]
        if batch is None or -1 in idx or any(len(t) != 1 for _, _, t in batch.reqs):
            e.batcher.unspeculate(f.batch)
            return False
        self._flight = None
        try:
            assert f.pending.tokens is not None
            loras = lora_step(e.model, batch)
            inputs = e.model.make_batch(batch.reqs, non_blocking=True)
            tokens = f.pending.tokens  # f's sampling order is its batch order: all sample
            if idx != list(range(len(f.batch.request_ids))):
                tokens = tokens.index_select(0, to_device(torch.tensor(idx), tokens.device))
            inputs["input_ids"] = tokens
            out = e.runner.step(inputs, batch.num_reqs, batch.max_query_len, loras)
            assert e.sampler is not None
            pending = e.sampler.launch(batch, StepLogits.of(e.model, out), keep=True)
            self.speculated += 1
            e.outbox.flush()  # the last step's events, while this one runs on the device
            sampled = f.pending.read()
            events = e.batcher.resolve(f.batch, [s.token for s in sampled])
        except Exception as exc:
            self.fail([f.batch, batch], exc)
            return True
        self._deliver(f.batch, sampled, events, f.t0)
        self._flight = _Flight(batch, pending, t0)
        if all(r.finished for r in _requests(batch)):  # everyone stopped at f: nothing to overlap
            self.drain()
        return True

    def _eligible(self, batch: StepBatch) -> bool:
        """The conditions on requests and the engine (the batcher checks its own)."""
        e = self.engine
        if not e.quiet():
            return False
        for r in _requests(batch):
            if r.cancelled or r.prompt_logprobs is not None:
                return False
        return True

    def _deliver(self, batch: StepBatch, sampled: list[Sampled], events, t0: float) -> None:
        e = self.engine
        now = time.perf_counter()
        e.metrics.step(now - t0, batch, e.table.q)
        for rid in _requests(batch):
            if not rid.admitted:  # its queue time ended when this step was scheduled
                rid.admitted, rid.admitted_at = True, t0
                rid.cached_tokens = e.batcher.prefix.cached_tokens.pop(rid, 0)
                e.metrics.queue_seconds.observe(t0 - rid.arrived)
        sampling = [r for r, i in zip(batch.request_ids, batch.sample_rows) if i >= 0]
        by_request = dict(zip(sampling, sampled))
        e.outbox.tokens(events, by_request, now, e.ended)

    def fail(self, batches: list[StepBatch], exc: Exception) -> None:
        e = self.engine
        reqs = {id(r): r for b in batches for r in _requests(b)}
        log.error(
            "engine step of %d requests failed; failing them",
            len(reqs),
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        e.metrics.step_errors.inc()
        self._flight = None
        err = RequestError(500, f"internal error in the engine step: {type(exc).__name__}: {exc}")
        for r in reqs.values():
            e.batcher.abort(r)
            e.finish(r, err)


def _requests(batch: StepBatch) -> list[Request]:
    out = []
    for rid in batch.request_ids:
        assert isinstance(rid, Request)
        out.append(rid)
    return out


def lora_step(model, batch: StepBatch) -> int:
    """Bind the step's sequence seats to their requests' LoRA adapters (``Request.lora``) on a
    model that serves adapters; the step's ``num_active_loras`` (0 without LoRA)."""
    lora = getattr(model, "lora", None)
    if lora is None:
        return 0
    return lora.assign(
        [(req[0], getattr(r, "lora", None)) for req, r in zip(batch.reqs, batch.request_ids)]
    )
