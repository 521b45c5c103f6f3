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

from typing import Any, Protocol, Sequence, runtime_checkable

from graphplan.models.prefix_cache import chain_keys


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


def register(r: Any, pool: PrefixPool) -> None:
    """Name ``r``'s blocks that are full of real tokens whose K/V a launched step writes."""
    full = min(r.computed, real_tokens(r)) // pool.block_size
    if full > r.registered:
        pool.register(r.row, keys_up_to(r, pool, full)[:full], r.registered)
        r.registered = full
