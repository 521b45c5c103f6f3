"""The continuous batcher with speculative decoding: a decoding request that speculates puts its
last token and k drafts in the step (q = 1 + k tokens: a step of only such rows is the plan's
uniform decode, ``scheduler.decode_query_len``), and ``commit_spec`` takes 1..k+1 tokens per
request (server/core/spec/verify.py), rolling back the KV slots of the rejected drafts: ``computed``
drops to the last token plus the accepted drafts, and the blocks past it go back to the pool, so
the block accounting is what it would be without the drafts.

Drafts are cut to what the request may still generate (max_tokens: at most ``remaining - 1``
drafts, so the step's tokens never pass it), to ``max_model_len`` and to the step's token budget.
A proposer with fewer than k guesses is padded with the request's last token, so a steady step stays
uniform (its FULL graph); a request that does not speculate (``speculates``: penalised requests)
decodes one token as usual, and that step is a mixed one (piecewise or eager, as the table routes
it). Async scheduling (``speculate``/``resolve``) is not used with speculation: the engine runs its
steps synchronously."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Hashable, Sequence

from ..batching import ContinuousBatcher, StepBatch, TokenEvent, _Request
from .proposer import Proposer


class SpecBatcher(ContinuousBatcher):
    def __init__(
        self,
        *,
        proposer: Proposer,
        speculates: Callable[[Hashable], bool] = lambda rid: True,
        **kw: Any,
    ):
        super().__init__(**kw)
        self.proposer = proposer
        self.speculates = speculates
        self.drafts: dict[Hashable, tuple[int, ...]] = {}
        """The drafts each request of the last scheduled step carries (its step's extra tokens)."""
        self._asks: dict[Hashable, tuple[int, tuple[int, ...], int]] = {}
        """The step's requests that speculate: (cache row, prompt + output, k)."""

    def schedule(self) -> StepBatch | None:
        """The next step: the decoding requests' drafts are proposed together, once the step's
        requests and token counts are settled (a request speculating k_i reserves 1 + k_i
        tokens; a proposer with fewer guesses is padded with the last token)."""
        self.drafts, self._asks = {}, {}
        batch = super().schedule()
        if batch is None or not self._asks:
            return batch
        ids = list(self._asks)
        rows, seqs, ks = zip(*(self._asks[i] for i in ids))
        proposed = self.proposer.propose(list(seqs), list(ks), list(rows))
        for rid, seq, k, got in zip(ids, seqs, ks, proposed):
            drafts = tuple(int(t) for t in got[:k])
            self.drafts[rid] = drafts + (seq[-1],) * (k - len(drafts))
        reqs = tuple(
            (row, start, toks[:1] + self.drafts[rid]) if rid in self.drafts else (row, start, toks)
            for rid, (row, start, toks) in zip(batch.request_ids, batch.reqs)
        )
        return replace(batch, reqs=reqs)

    def _decode_tokens(self, r: _Request, budget: int) -> tuple[int, ...]:
        last = r.chunk(1)
        k = min(
            self.proposer.k,
            r.max_new_tokens - len(r.output) - 1,
            self.max_model_len - r.computed - 1,
            budget - 1,
        )
        if k <= 0 or not self.speculates(r.id):
            return last
        self._asks[r.id] = (r.row, r.prompt + tuple(r.output), k)
        self.drafts[r.id] = last * k  # the count now; the tokens once the step is settled
        return last * (1 + k)

    def _preempt(self, r: _Request) -> None:
        self.drafts.pop(r.id, None)  # preempted in the step that drafted for it: a prompt again
        self._asks.pop(r.id, None)
        super()._preempt(r)

    def num_drafts(self, batch: StepBatch) -> list[int]:
        """Drafts per request of ``batch`` (the step just scheduled), batch order."""
        return [len(self.drafts.get(rid, ())) for rid in batch.request_ids]

    def commit_spec(
        self, batch: StepBatch, outputs: Sequence[Sequence[int] | None]
    ) -> list[TokenEvent]:
        """Record a speculative step: ``outputs[i]`` is request i's accepted tokens (the drafts
        kept, then the target's token; None where it samples nothing: a prompt chunk). A request
        that ends (a stop token, max_tokens) at one of them ends there; the rest are dropped."""
        by_id = {r.id: r for r in self._running}
        events = []
        for rid, (row, start, toks), out in zip(batch.request_ids, batch.reqs, outputs):
            r = by_id.get(rid)
            if r is None:  # aborted while its step ran
                continue
            drafts = len(toks) - 1 if rid in self.drafts else 0
            if out is None:
                r.computed += len(toks)
                continue
            if not 1 <= len(out) <= drafts + 1:
                raise ValueError(f"request {rid!r}: {len(out)} tokens for {drafts} drafts")
            if drafts:
                r.computed = start + len(out)  # the last token and the drafts kept
                if self.kv_pool is not None:
                    self.kv_pool.truncate(row, r.computed)
            else:
                r.computed += len(toks)
            for tok in out:
                r.output.append(int(tok))
                events.append(self._ended_or_not(r))
                if events[-1].finished:
                    break
        return events
