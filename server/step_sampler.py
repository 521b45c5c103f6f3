"""The engine's sampling step: the batched ``Sampler`` (server/sampling.py) over the logits rows
that sample this step, one sampler slot per KV-cache row.

A request binds its row's slot the first time it samples in that row: its parameters, its seed and,
after a preemption moved it to another row, the tokens it already generated (the step counter its
noise reads and the history its penalties read), so a seeded request gives the same tokens alone, in
any batch and across preemptions. A step whose every row is greedy, unpenalised and asks for no
logprobs takes the argmax directly (the sampler's own greedy rows give the same tokens)."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from .batching import StepBatch
from .requests import Request, Sampled
from .sampling import Sampler

MAX_LOGPROBS = 20


class StepSampler:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str):
        self.sampler = Sampler(
            num_slots, vocab_size, device=device, max_logprobs=MAX_LOGPROBS, penalties=True
        )
        self._owner: list[Request | None] = [None] * num_slots

    def sample(self, batch: StepBatch, logits: torch.Tensor) -> list[Sampled]:
        """One ``Sampled`` per request that samples this step, in ``batch.sampling_rows`` order."""
        rows = batch.sampling_rows
        if not rows:
            return []
        reqs = _sampling_requests(batch.request_ids, batch.sample_rows)
        picked = logits.index_select(0, torch.tensor(rows, device=logits.device))
        if all(r.params.greedy and not r.params.penalised and r.logprobs is None for r in reqs):
            return [Sampled(t) for t in picked.argmax(dim=-1).tolist()]
        slots = batch.sampling_cache_rows
        for r, slot in zip(reqs, slots):
            if self._owner[slot] is not r:
                self._bind(r, slot)
        view = self.sampler.load_slots(slots)
        out = self.sampler.sample(picked, view)
        self.sampler.update(view, out.token_ids)
        tokens = out.token_ids.tolist()  # the step's one wait for the device
        if all(r.logprobs is None for r in reqs) or out.logprobs is None:
            return [Sampled(t) for t in tokens]
        assert out.top_logprobs is not None and out.top_ids is not None
        chosen = out.logprobs.tolist()
        top_lp, top_ids = out.top_logprobs.tolist(), out.top_ids.tolist()
        result = []
        for i, (r, t) in enumerate(zip(reqs, tokens)):
            if r.logprobs is None:
                result.append(Sampled(t))
            else:
                k = r.logprobs
                result.append(Sampled(t, chosen[i], tuple(zip(top_ids[i][:k], top_lp[i][:k]))))
        return result

    def _bind(self, r: Request, slot: int) -> None:
        self.sampler.set_row(slot, r.params, r.prompt)
        if r.out:  # moved here by a preemption: replay what it generated into the slot
            self.sampler.update([slot] * len(r.out), r.out)
        self._owner[slot] = r

    def release(self, r: Request) -> None:
        """Forget ``r``'s slot (it finished or was aborted)."""
        for i, owner in enumerate(self._owner):
            if owner is r:
                self._owner[i] = None


def _sampling_requests(ids: Sequence[Hashable], sample_rows: Sequence[int]) -> list[Request]:
    out = []
    for rid, row in zip(ids, sample_rows):
        if row >= 0:
            assert isinstance(rid, Request)
            out.append(rid)
    return out
