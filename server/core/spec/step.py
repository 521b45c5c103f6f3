"""The engine's step with speculative decoding on (``Engine(speculative=...)``): synchronous, one
step at a time (async scheduling is off with speculation, as vLLM did at first).

A step runs the batch the ``SpecBatcher`` scheduled (decoding requests with their drafts, prompt
chunks), reads the logits at every scored row (a decoding request's 1 + k rows, a finishing
prompt's last row), draws the target's token at each (``verify.target_tokens``: the sampler at
the request's step + position, greedy rows the argmax), keeps the drafts that match
(``verify.accepted``), records the kept tokens in each slot's sampler state (step counters,
penalty histories) and commits them (``SpecBatcher.commit_spec``). Each token's event carries its
own logprobs (the row that produced it)."""

from __future__ import annotations

import time
from typing import Any

import torch

from ...requests import Request, Sampled
from .. import prompt_logprobs
from ..batching import StepBatch
from ..pipeline import lora_step
from ..step_logits import StepLogits
from ..step_sampler import MAX_LOGPROBS
from .metrics import SpecMetrics
from .verify import accepted, target_tokens


class SpecStep:
    def __init__(self, engine: Any, k: int):
        self.engine = engine
        self.metrics = SpecMetrics(engine.metrics.registry, k)

    def step(self, batch: StepBatch) -> None:
        e = self.engine
        t0 = time.perf_counter()
        try:
            loras = lora_step(e.model, batch)  # a request's adapter applies to its drafts' rows too
            inputs = e.model.make_batch(batch.reqs)
            out = e.runner.step(inputs, batch.num_reqs, batch.max_query_len, loras)
            logits = StepLogits.of(e.model, out)
            prompt_lps = prompt_logprobs.launch(batch, logits)
            e.outbox.flush()
            outputs, sampled = self._verify(batch, logits)
            prompt_found = prompt_lps.read() if prompt_lps is not None else {}
            events = e.batcher.commit_spec(batch, outputs)
        except Exception as exc:
            e.pipeline.fail([batch], exc)
            return
        prompt_logprobs.merge_into(e.outbox, prompt_found)
        self._deliver(batch, sampled, events, t0)

    @torch.no_grad()
    def _verify(self, batch: StepBatch, logits: StepLogits):
        """(the tokens each request commits, or None; each committed token's ``Sampled``)."""
        e = self.engine
        drafts = e.batcher.num_drafts(batch)
        rows: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        reqs: list[Request] = []
        for rid, (slot, _, _), last, d in zip(
            batch.request_ids, batch.reqs, batch.sample_rows, drafts
        ):
            if last < 0:
                continue
            assert isinstance(rid, Request)
            reqs.append(rid)
            rows += range(last - d, last + 1)
            slots += [slot] * (d + 1)
            offsets += range(d + 1)
        outputs: list[list[int] | None] = [None] * len(batch.reqs)
        if not rows:
            return outputs, {}
        dev = logits.device
        step_sampler = e.sampler
        step_sampler.bind(reqs, [s for s, o in zip(slots, offsets) if o == 0])
        want_lp = any(r.logprobs is not None for r in reqs)
        index = torch.tensor(rows, dtype=torch.int64).to(dev)
        scored = logits.rows(index)
        if not want_lp and all(r.params.greedy and not r.params.penalised for r in reqs):
            values = scored.argmax(dim=-1).tolist()
            lps = None
        else:
            slot_t = torch.tensor(slots, dtype=torch.int64).to(dev)
            res = target_tokens(
                step_sampler.sampler,
                scored,
                slot_t,
                torch.tensor(offsets, dtype=torch.int64).to(dev),
                logprobs=want_lp,
                penalise=any(r.params.penalised for r in reqs),
            )
            values = res.token_ids.tolist()
            lps = None
            if want_lp:
                assert res.logprobs is not None and res.top_logprobs is not None
                assert res.top_ids is not None
                lps = (res.logprobs.tolist(), res.top_logprobs.tolist(), res.top_ids.tolist())
        sampled: dict[Request, list[Sampled]] = {}
        kept_slots: list[int] = []
        kept: list[int] = []
        i = j = 0
        for n, ((slot, _, toks), last, d) in enumerate(zip(batch.reqs, batch.sample_rows, drafts)):
            if last < 0:
                continue
            r = reqs[j]
            got = accepted(list(toks[1:]) if d else [], values[i : i + d + 1])
            if d:
                self.metrics.verified(d, len(got) - 1)
            outputs[n] = got
            sampled[r] = [_sampled(r, lps, i + m, t) for m, t in enumerate(got)]
            kept_slots += [slot] * len(got)
            kept += got
            i += d + 1
            j += 1
        step_sampler.sampler.update(kept_slots, kept)
        return outputs, sampled

    def _deliver(self, batch: StepBatch, sampled: dict, events, t0: float) -> None:
        e = self.engine
        now = time.perf_counter()
        e.metrics.step(now - t0, batch, e.table.q)
        for r in batch.request_ids:
            assert isinstance(r, Request)
            if not r.admitted:
                r.admitted, r.admitted_at = True, t0
                e.metrics.queue_seconds.observe(t0 - r.arrived)
        box = e.outbox
        for ev in events:
            r = ev.request_id
            r.out.append(ev.token)
            box.token_at(r, now)
            items = box.events(r.events)
            items.append((r.tag, "token", sampled[r].pop(0)))
            if ev.finished:
                e.ended(r, ev.token, items)


def _sampled(r: Request, lps, i: int, token: int) -> Sampled:
    if lps is None or r.logprobs is None:
        return Sampled(token)
    chosen, values, ids = lps
    top = r.logprobs
    assert top <= MAX_LOGPROBS
    return Sampled(token, chosen[i], tuple(zip(ids[i][:top], values[i][:top])))
