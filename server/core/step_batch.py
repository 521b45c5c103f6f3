"""What a step of the continuous batcher (server/core/batching.py) hands out and reports: the batch a
model's ``make_batch`` turns into the step's inputs, and the event of each new token. Plain data,
importable from ``server.batching`` too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBatch:
    """One step's batch, requests in batch order."""

    reqs: tuple[tuple[int, int, tuple[int, ...]], ...]
    """(cache_row, start_pos, token_ids) per request: what a model's ``make_batch`` takes."""
    request_ids: tuple[Hashable, ...]
    sample_rows: tuple[int, ...]
    """Row of each request's last token in the batch, or -1 when the request samples nothing this
    step (a prompt chunk that does not finish the prompt)."""
    num_tokens: int
    max_query_len: int

    @property
    def num_reqs(self) -> int:
        return len(self.reqs)

    @property
    def sampling_rows(self) -> tuple[int, ...]:
        """The logits rows to sample from, one per request that samples this step (batch order):
        the rows a sampler's step takes, and the order ``commit(sampled=...)`` reads."""
        return tuple(i for i in self.sample_rows if i >= 0)

    @property
    def sampling_cache_rows(self) -> tuple[int, ...]:
        """The cache row of each request in ``sampling_rows`` (a sampler's slot for it)."""
        return tuple(req[0] for req, i in zip(self.reqs, self.sample_rows) if i >= 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenEvent:
    request_id: Hashable
    token: int
    finished: bool
