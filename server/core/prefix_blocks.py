"""The batcher's side of prefix caching (``models/prefix_cache.py``; issue 38): the keys of a
request's full blocks, the cached blocks a waiting request starts with, and the registration of
the blocks its steps fill.

A request's sequence is its prompt then its output (a preempted request is readmitted over both).
Its keys are computed as its blocks fill with real tokens (never over a speculated placeholder),
each chained from the one before; a lookup matches the longest run of cached blocks, capped at
whole blocks strictly before the sequence's last token, so the step that admits it computes at
least that token (a fully cached prompt recomputes its last block) and nothing writes into a shared
block. A block is registered once the batcher has recorded the step that filled it (``commit`` or
``resolve``): that step has been launched, and a later step that reads the block runs after it on
the device.
"""

from __future__ import annotations

from typing import Any, Hashable, Protocol, Sequence, runtime_checkable

from graphplan.models.prefix_cache import chain_keys, root_key


@runtime_checkable
class PrefixPool(Protocol):
    """A ``BlockPool`` that shares full blocks by content (``paged_kv.BlockTables``)."""

    block_size: int

    def enable_prefix_caching(self) -> None: ...

    def lookup(self, keys: Sequence[bytes]) -> list[int]: ...

    def free_cost(self, blocks: Sequence[int]) -> int: ...

    def attach(self, seat: int, blocks: Sequence[int]) -> None: ...

    def register(self, seat: int, keys: Sequence[bytes], first: int = 0) -> None: ...


def real_tokens(r: Any) -> int:
    """Tokens of ``r``'s sequence known on the host (speculated placeholders, < 0, excluded)."""
    n = len(r.prompt) + len(r.output)
    out = r.output
    while n > len(r.prompt) and out[n - len(r.prompt) - 1] < 0:
        n -= 1
    return n


def keys_up_to(r: Any, pool: PrefixPool, blocks: int) -> list[bytes]:
    """``r.keys`` grown to its first ``blocks`` full blocks (all of real tokens)."""
    have, bs = len(r.keys), pool.block_size
    if blocks > have:
        lo, hi, n = have * bs, blocks * bs, len(r.prompt)
        tokens = [*r.prompt[lo:hi], *r.output[max(0, lo - n) : max(0, hi - n)]]
        parent = r.keys[-1] if have else r.root
        r.keys += chain_keys(tokens, bs, parent, 0, blocks - have)
    return r.keys


def lookup(r: Any, pool: PrefixPool) -> list[int]:
    """The cached blocks ``r`` (holding none) can start with."""
    cap = (real_tokens(r) - 1) // pool.block_size  # whole blocks before its last token
    return pool.lookup(keys_up_to(r, pool, cap)[:cap]) if cap > 0 else []


class PrefixState:
    """A batcher's prefix caching: its pool (None: off, or a pool that cannot share blocks), the
    tokens looked up at admission and those found cached (vLLM's prefix cache queries and hits),
    and each request's hit at its first admission."""

    def __init__(self, pool: Any, on: bool):
        self.pool: PrefixPool | None = pool if on and isinstance(pool, PrefixPool) else None
        if self.pool is not None:
            self.pool.enable_prefix_caching()
        self.queries = self.hits = 0
        self.cached_tokens: dict[Hashable, int] = {}
        """request id -> prompt tokens found cached at its first admission (a server pops it)."""

    def root(self, extra_key: str | bytes | None) -> bytes:
        return root_key(extra_key) if self.pool is not None else b""

    def admit(self, r: Any) -> tuple[list[int], int]:
        """The cached blocks waiting ``r`` can start with, and how many free blocks they take."""
        if self.pool is None or not r.lookup:
            return [], 0
        hit = lookup(r, self.pool)
        return hit, self.pool.free_cost(hit)

    def admitted(self, r: Any, hit: list[int]) -> None:
        """``r`` took its seat (``r.row``) with ``hit``, its ``computed`` past them."""
        if self.pool is None:
            return
        self.pool.attach(r.row, hit)
        r.registered = len(hit)
        if r.lookup:
            self.queries += real_tokens(r)
            self.hits += r.computed
        if r.cached < 0:  # its first admission (not a readmission after a preemption)
            r.cached = self.cached_tokens[r.id] = r.computed

    def register(self, r: Any) -> None:
        """Name ``r``'s newly filled blocks (cheap when none filled)."""
        p = self.pool
        if p is not None and r.computed >= (r.registered + 1) * p.block_size:
            register(r, p)


def register(r: Any, pool: PrefixPool) -> None:
    """Name ``r``'s blocks that are full of real tokens whose K/V a launched step writes."""
    full = min(r.computed, real_tokens(r)) // pool.block_size
    if full > r.registered:
        pool.register(r.row, keys_up_to(r, pool, full)[:full], r.registered)
        r.registered = full
