"""Continuous batching: requests arrive over time; each step, every running request that decodes
takes one token, and prompts are prefilled in chunks with the rest of a per-step token budget, all
in one batch (vLLM-style chunked prefill).

Independent of HTTP, of the model and of torch, so a server can drive it: ``schedule()`` hands out
a ``StepBatch`` of ``(cache_row, start_pos, token_ids)`` per request (a model's ``make_batch`` turns
it into the step's inputs: ``graphplan.models.Model``), and ``commit()`` takes the step's logits or
the tokens a sampler picked (``server/core/sampling.py``) and reports each new token as a
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

KV blocks on demand (``kv_pool``, a paged cache's ``BlockTables``): a request holds
``ceil(tokens in the cache / block_size)`` blocks, taken as it grows and given back when it finishes.
A step schedules only what the free blocks hold: a waiting request is admitted only while its first
chunk fits with ``watermark`` of the pool to spare, and a prompt chunk is cut to what fits. When a
decode cannot get its next block, the most recently admitted requests not yet in this step are
preempted (vLLM's recompute policy): their blocks and row go back, and they wait at the head of the
queue with the tokens they generated, which are prefilled again when they are readmitted. Nothing is
lost, and a pool that holds one ``max_model_len`` sequence lets every request finish.

Prefix caching (``prefix_caching=True``, ``prefix_blocks.PrefixState``): a request is admitted
past its cached blocks, so admission and the token budget count only what it still computes.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Sequence

from graphplan.models.protocol import BlockPool

from . import prefix_blocks
from .batch_request import PLACEHOLDER, _Request
from .step_batch import StepBatch, TokenEvent


class ContinuousBatcher:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        token_budget: int,
        max_model_len: int,
        num_cache_rows: int,
        kv_pool: BlockPool | None = None,
        watermark: float = 0.01,
        prefix_caching: bool = False,
    ):
        if min(max_num_seqs, token_budget, max_model_len, num_cache_rows) < 1:
            raise ValueError(
                "max_num_seqs, token_budget, max_model_len and num_cache_rows must all be >= 1"
            )
        self.max_num_seqs, self.token_budget = max_num_seqs, token_budget
        self.max_model_len = max_model_len
        self.kv_pool = kv_pool
        self._watermark = int(watermark * kv_pool.num_free()) if kv_pool is not None else 0
        self.num_preemptions = 0
        self.prefix = prefix_blocks.PrefixState(kv_pool, prefix_caching)
        self.preempted: list[Hashable] = []  # since a server last cleared it (its sampler slots)
        self._free_rows = deque(range(num_cache_rows))
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # admission order
        self._known: set = set()
        self.max_loras = 0
        """With LoRA: the most distinct adapters (``request_id.lora``) running at once (the
        model's slots); a request of another adapter waits. 0: no limit."""
        self.finished: dict[Hashable, list[int]] = {}
        """request id -> generated tokens of each finished request (a server pops what it sent)."""

    def add(
        self,
        request_id: Hashable,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        extra_key: str | bytes | None = None,
        cache_lookup: bool = True,
    ) -> None:
        """Queue a request; it joins a batch at the next ``schedule()`` with room for it.
        ``extra_key``: what else changes its K/V (a LoRA adapter id): blocks are shared only
        between requests with the same one. ``cache_lookup=False``: it computes its whole prompt
        (it asks for the prompt's logprobs, which cached positions would not have)."""
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
                root=self.prefix.root(extra_key),
                lookup=cache_lookup,
            )
        )

    def _lora_fits(self, r: _Request) -> bool:
        name = getattr(r.id, "lora", None)
        if name is None:
            return True
        running = {getattr(x.id, "lora", None) for x in self._running} - {None}
        return name in running or len(running) < self.max_loras

    def abort(self, request_id: Hashable) -> None:
        """Drop a waiting or running request (e.g. its client went away); frees its cache row."""
        self._waiting = deque(r for r in self._waiting if r.id != request_id)
        for r in [r for r in self._running if r.id == request_id]:
            self._retire(r)
        self._known.discard(request_id)  # a waiting one held no row
        self.prefix.cached_tokens.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def schedule(self) -> StepBatch | None:
        """The next step's batch, or None when nothing can run."""
        budget = self.token_budget
        free = self.kv_pool.num_free() if self.kv_pool is not None else None
        picked: list[tuple[_Request, tuple[int, ...]]] = []
        for r in list(self._running):  # decodes, oldest first; may preempt the newest
            # one preempted by an earlier decode of this step is skipped here: it recomputes
            # its whole sequence (pending = prompt + output >= 2)
            if r.pending != 1 or not budget or r.ending:
                continue
            toks = self._decode_tokens(r, budget)  # its last token (and drafts: spec/batcher.py)
            if free is not None:
                grow = self._grow(r, len(toks))
                free = self._make_room(r, grow, free, picked)
                if free is None:  # r itself was preempted
                    free = self._free_after(picked)
                    break
                free -= grow
            picked.append((r, toks))
            budget -= len(toks)
        for r in self._running:  # the next chunk of prompts already started
            if r.pending > 1 and budget and all(r is not p for p, _ in picked):
                n = self._fits(r, min(budget, r.pending), free, 0)
                if n:
                    picked.append((r, r.chunk(n)))
                    budget -= n
                    free = None if free is None else free - self._grow(r, n)
        while (
            budget and self._waiting and self._free_rows and len(self._running) < self.max_num_seqs
        ):
            r = self._waiting[0]
            if self.max_loras and not self._lora_fits(r):
                break  # its adapter waits for a slot, in arrival order
            hit, taken = self.prefix.admit(r)  # cached blocks; the free ones of them it takes
            r.computed = len(hit) * self._blocks.block_size if hit else 0
            room = None if free is None else free - taken
            n = self._fits(r, min(budget, r.pending), room, self._watermark)
            if not n:
                r.computed = 0
                break  # admission waits for blocks, in arrival order
            self._waiting.popleft()
            r.row = self._free_rows.popleft()
            self._running.append(r)
            self.prefix.admitted(r, hit)
            picked.append((r, r.chunk(n)))
            budget -= n
            free = None if room is None else room - self._grow(r, n)
        if not picked:
            return None
        reqs, rows, first = [], [], 0
        for r, toks in picked:
            reqs.append((r.row, r.computed, toks))
            first += len(toks)
            done = len(toks) >= r.pending  # more: a decode with drafts (spec/batcher.py)
            rows.append(first - 1 if done else -1)
        return StepBatch(
            reqs=tuple(reqs),
            request_ids=tuple(r.id for r, _ in picked),
            sample_rows=tuple(rows),
            num_tokens=first,
            max_query_len=max(len(t) for _, t in picked),
        )

    def _decode_tokens(self, r: _Request, budget: int) -> tuple[int, ...]:
        """What a decoding request puts in the step: its last token (speculative decoding adds
        drafts: server/core/spec/batcher.py)."""
        return r.chunk(1)

    # -- KV blocks ----------------------------------------------------------------------------
    @property
    def _blocks(self) -> BlockPool:
        """The pool; the block accounting below runs only when there is one (``free`` is None
        without it)."""
        assert self.kv_pool is not None
        return self.kv_pool

    def _grow(self, r: _Request, n: int) -> int:
        """Blocks a step of ``n`` more tokens takes: the pool reserves whole blocks for positions
        [0, computed + n), and the request holds those of [0, computed) already."""
        bs = self._blocks.block_size
        return -(-(r.computed + n) // bs) - -(-r.computed // bs)

    def _fits(self, r: _Request, n: int, free: int | None, spare: int) -> int:
        """The most of ``n`` tokens whose blocks fit in ``free`` with ``spare`` left (all of
        them without a pool)."""
        if free is None or self.kv_pool is None:
            return n
        bs = self._blocks.block_size
        room = free - spare
        if room < 0:
            return 0
        # positions up to the end of the blocks held plus ``room`` new ones
        return max(0, min(n, (-(-r.computed // bs) + room) * bs - r.computed))

    def _make_room(self, r: _Request, need: int, free: int, picked) -> int | None:
        """Preempt the newest running requests not in this step until ``need`` blocks are free;
        None when ``r`` itself had to go."""
        while free < need:
            victim = self._running[-1]
            self._preempt(victim)
            if victim is r:
                return None
            free = self._free_after(picked)
        return free

    def _free_after(self, picked) -> int:
        """Blocks free once this step's picks have taken theirs (the pool reserves them later,
        in ``make_batch``)."""
        return self._blocks.num_free() - sum(self._grow(p, len(t)) for p, t in picked)

    def _preempt(self, r: _Request) -> None:
        """Give back its blocks and row; it waits first in line and recomputes what it had."""
        self._running.remove(r)
        self._free_rows.append(r.row)
        self._blocks.release(r.row)
        r.row, r.computed, r.registered = -1, 0, 0
        self._waiting.appendleft(r)
        self.preempted.append(r.id)
        self.num_preemptions += 1

    def commit(self, batch: StepBatch, logits=None, *, sampled=None) -> list[TokenEvent]:
        """Record a step from its ``logits`` [num_tokens, vocab] (a tensor; greedy: the argmax of
        each sampling row), or from ``sampled``: the token a sampler picked for each request in
        ``batch.sampling_rows`` order (a tensor or a sequence, e.g. ``Sampler.sample``'s
        ``token_ids``; entries past those, a captured graph's padding, are ignored)."""
        if (logits is None) == (sampled is None):
            raise ValueError("commit takes either the step's logits or the sampled token ids")
        rows = batch.sampling_rows
        if sampled is None:
            sampled = logits[list(rows)].argmax(dim=-1) if rows else []
        picked = list(sampled) if isinstance(sampled, (list, tuple)) else sampled.tolist()
        if len(picked) < len(rows):
            raise ValueError(f"{len(picked)} sampled tokens for {len(rows)} sampling requests")
        it = iter(picked)
        return self.commit_tokens(batch, [next(it) if i >= 0 else None for i in batch.sample_rows])

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
            self.prefix.register(r)
            if row < 0 or tok is None:
                continue
            if tok is None:
                raise ValueError(f"request {rid!r} samples a token this step, but got None")
            r.output.append(int(tok))
            events.append(self._ended_or_not(r))
        return events

    # -- async scheduling (server/core/pipeline.py) ----------------------------------------------
    def speculate(self, batch: StepBatch) -> bool:
        """Step ``batch`` was launched and its tokens are not read yet: record a placeholder
        token for each of its requests (what ``commit_tokens`` advances, no events, nothing
        retired), so that ``schedule()`` hands out the next step now. Only in the steady decode
        state where that next step is surely every one of these requests decoding once more:
        each decodes one token and samples, they are all the running requests (those of them that
        finished since are skipped), no waiting request could join (the seats are all taken: a
        seat that frees when a request stops at ``batch`` is given out one step later than
        without speculation), and the free KV blocks hold every request's next token (no
        preemption). A request whose token at ``batch`` is its last (``max_new_tokens``) ends
        there whatever the token: it is ``ending`` and the next step leaves it out (not
        all of them may end). Returns False, changing nothing, otherwise.
        ``resolve(batch, tokens)`` puts the real tokens in place."""
        by_id = {r.id: r for r in self._running}
        reqs = [by_id.get(rid) for rid in batch.request_ids]
        live = [r for r in reqs if r is not None]  # the others finished at the step before
        if not live or len(live) != len(self._running):
            return False
        if self._waiting and self._free_rows and len(self._running) < self.max_num_seqs:
            return False  # a waiting request would join the next step
        if len(live) > self.token_budget:
            return False
        need = ends = 0
        for r, (_, start, toks), row in zip(reqs, batch.reqs, batch.sample_rows):
            if len(toks) != 1 or row < 0:
                return False
            if r is None:
                continue
            if r.pending != 1 or r.computed != start:
                return False
            if len(r.output) + 1 >= r.max_new_tokens:
                ends += 1  # its token at batch is its last: ``ending`` then, not in the next step
            elif self.kv_pool is not None:  # the next step's token, after the placeholder's
                need += self._grow(r, 2) - self._grow(r, 1)
        if ends == len(live):
            return False  # no next step of these requests
        if self.kv_pool is not None and need > self._blocks.num_free():
            return False
        for r in live:
            r.computed += 1
            r.output.append(PLACEHOLDER)
        return True

    def unspeculate(self, batch: StepBatch) -> None:
        """Undo ``speculate(batch)`` (the next step was not what it expected)."""
        by_id = {r.id: r for r in self._running}
        for r in filter(None, map(by_id.get, batch.request_ids)):
            assert r.output and r.output[-1] == PLACEHOLDER
            r.output.pop()
            r.computed -= 1

    def resolve(self, batch: StepBatch, tokens: Sequence[int]) -> list[TokenEvent]:
        """The tokens of a speculated ``batch`` (one per request, batch order): each replaces its
        placeholder, with its ``TokenEvent``; a request that ends here finishes and is retired
        (its seat and blocks free). The next step, already launched, holds it too: its token
        there is dropped, as ``commit_tokens`` drops the tokens of requests no longer running.
        That step's writes into the freed blocks are ordered on the device before any later
        step's that reuses them."""
        by_id = {r.id: r for r in self._running}
        events = []
        for rid, tok in zip(batch.request_ids, tokens):
            r = by_id.get(rid)
            if r is None:  # aborted meanwhile
                continue
            assert r.output and r.output[-1] == PLACEHOLDER, "resolve without speculate"
            r.output[-1] = int(tok)
            self.prefix.register(r)
            events.append(self._ended_or_not(r))
        return events

    def _ended_or_not(self, r: _Request) -> TokenEvent:
        """The event of ``r``'s newest token; a request that ends with it is retired."""
        tok = r.output[-1]
        done = len(r.output) >= r.max_new_tokens or tok in r.stop
        if done:
            self.finished[r.id] = r.output
            self._retire(r)
        return TokenEvent(request_id=r.id, token=tok, finished=done)

    def _retire(self, r: _Request) -> None:
        self._running.remove(r)
        self._free_rows.append(r.row)
        if self.kv_pool is not None:
            self.kv_pool.release(r.row)
        self._known.discard(r.id)
