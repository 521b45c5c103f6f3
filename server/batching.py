"""Continuous batching: requests arrive over time; each step, every running request that decodes
takes one token, and prompts are prefilled in chunks with the rest of a per-step token budget, all
in one batch (vLLM-style chunked prefill).

Independent of HTTP, of the model and of torch, so a server can drive it: ``schedule()`` hands out
a ``StepBatch`` of ``(cache_row, start_pos, token_ids)`` per request (a model's ``make_batch`` turns
it into the step's inputs: ``graphplan.models.Model``), and ``commit()`` takes the step's logits
(or ``commit_tokens()`` the tokens a sampler picked) and reports each new token as a
``TokenEvent``.

    batcher = ContinuousBatcher(max_num_seqs=8, token_budget=32, max_model_len=128, num_cache_rows=8)
    batcher.add("a", [1, 2, 3], max_new_tokens=8)
    while batcher.has_work():
        batch = batcher.schedule()
        logits = runner.step(model.make_batch(batch.reqs), batch.num_reqs, batch.max_query_len)
        for event in batcher.commit(batch, logits): ...

Policy, each step: decodes first (one token each, oldest request first), then the next chunk of
each request already mid-prompt, then waiting requests in arrival order while the budget, a free
cache row and ``max_num_seqs`` allow. A request's cache row is freed when it finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence


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


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenEvent:
    request_id: Hashable
    token: int
    finished: bool


@dataclass(kw_only=True, slots=True)
class _Request:
    id: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop: frozenset[int]
    row: int = -1
    computed: int = 0  # tokens whose K/V is in the cache
    output: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


class ContinuousBatcher:
    def __init__(
        self, *, max_num_seqs: int, token_budget: int, max_model_len: int, num_cache_rows: int
    ):
        if min(max_num_seqs, token_budget, max_model_len, num_cache_rows) < 1:
            raise ValueError(
                "max_num_seqs, token_budget, max_model_len and num_cache_rows must all be >= 1"
            )
        self.max_num_seqs, self.token_budget = max_num_seqs, token_budget
        self.max_model_len = max_model_len
        self._free_rows = deque(range(num_cache_rows))
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # admission order
        self._known: set = set()
        self.finished: dict[Hashable, list[int]] = {}
        """request id -> generated tokens of each finished request (a server pops what it sent)."""

    def add(
        self,
        request_id: Hashable,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request; it joins a batch at the next ``schedule()`` with room for it."""
        if request_id in self._known:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt or max_new_tokens < 1:
            raise ValueError(
                f"request {request_id!r}: needs a non-empty prompt and max_new_tokens >= 1"
            )
        if len(prompt) + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: {len(prompt)} prompt + {max_new_tokens} new "
                f"tokens exceed max_model_len {self.max_model_len}"
            )
        self._known.add(request_id)
        self._waiting.append(
            _Request(
                id=request_id,
                prompt=tuple(prompt),
                max_new_tokens=max_new_tokens,
                stop=frozenset(stop_token_ids),
            )
        )

    def abort(self, request_id: Hashable) -> None:
        """Drop a waiting or running request (e.g. its client went away); frees its cache row."""
        self._waiting = deque(r for r in self._waiting if r.id != request_id)
        for r in [r for r in self._running if r.id == request_id]:
            self._retire(r)
        self._known.discard(request_id)  # a waiting one held no row

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def schedule(self) -> StepBatch | None:
        """The next step's batch, or None when nothing can run."""
        budget = self.token_budget
        picked: list[tuple[_Request, tuple[int, ...]]] = []
        for r in self._running:  # decodes: the last generated token
            if not r.prefilling and budget:
                picked.append((r, (r.output[-1],)))
                budget -= 1
        for r in self._running:  # the next chunk of prompts already started
            if r.prefilling and budget:
                picked.append((r, r.prompt[r.computed : r.computed + budget]))
                budget -= len(picked[-1][1])
        while (
            budget and self._waiting and self._free_rows and len(self._running) < self.max_num_seqs
        ):
            r = self._waiting.popleft()
            r.row = self._free_rows.popleft()
            self._running.append(r)
            picked.append((r, r.prompt[:budget]))
            budget -= len(picked[-1][1])
        if not picked:
            return None
        reqs, rows, first = [], [], 0
        for r, toks in picked:
            reqs.append((r.row, r.computed, toks))
            first += len(toks)
            done = r.computed + len(toks) == len(r.prompt) + len(r.output)
            rows.append(first - 1 if done else -1)
        return StepBatch(
            reqs=tuple(reqs),
            request_ids=tuple(r.id for r, _ in picked),
            sample_rows=tuple(rows),
            num_tokens=first,
            max_query_len=max(len(t) for _, t in picked),
        )

    def commit(self, batch: StepBatch, logits) -> list[TokenEvent]:
        """Greedy: the argmax of each sampling row of ``logits`` [num_tokens, vocab] (a tensor)."""
        rows = [i for i in batch.sample_rows if i >= 0]
        picked = iter(logits[rows].argmax(dim=-1).tolist() if rows else [])
        return self.commit_tokens(
            batch, [next(picked) if i >= 0 else None for i in batch.sample_rows]
        )

    def commit_tokens(self, batch: StepBatch, tokens: Sequence[int | None]) -> list[TokenEvent]:
        """Record a step: ``tokens[i]`` is request i's new token (None where it samples nothing)."""
        by_id = {r.id: r for r in self._running}
        events = []
        for rid, (_, _, toks), row, tok in zip(
            batch.request_ids, batch.reqs, batch.sample_rows, tokens
        ):
            r = by_id.get(rid)
            if r is None:  # aborted while its step ran
                continue
            r.computed += len(toks)
            if row < 0:
                continue
            r.output.append(int(tok))
            done = len(r.output) >= r.max_new_tokens or int(tok) in r.stop
            events.append(TokenEvent(request_id=rid, token=int(tok), finished=done))
            if done:
                self.finished[rid] = r.output
                self._retire(r)
        return events

    def _retire(self, r: _Request) -> None:
        self._running.remove(r)
        self._free_rows.append(r.row)
        self._known.discard(r.id)
