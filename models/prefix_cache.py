"""Prefix caching: full KV blocks found by their content, shared between requests by reference
count, and kept after their last user leaves until the pool needs them (vLLM's automatic prefix
caching; issue 38).

A full block's key is ``blake2b(parent key || its block_size token ids)``, the chain starting at a
root key made from an extra key (anything else that changes a block's contents: a LoRA adapter;
none by default). Chaining makes a key name the whole prefix up to the block's end, so the longest
run of cached blocks matching a prompt is found by walking its keys until one is missing.

Why blake2b with 32-byte digests (not Python's ``hash`` of a tuple): a collision would let one
request read another's K/V (wrong tokens, and one client's prompt leaking into another's answer).
Python's integer hash is trivially invertible and 64 bits wide, so collisions can be built on
purpose; blake2b is a cryptographic hash (no known way to make a collision) and among the fastest
in hashlib: a 2,000-token prompt's 125 keys of 16 tokens cost ~0.1 ms, once per request.

``PrefixCache`` holds the reference counts, the key <-> block maps and the LRU of cached blocks
no request holds (``paged_kv.BlockTables`` owns one when prefix caching is on and asks it for
blocks; the batcher, ``server/core/batching.py``, looks prompts up and registers filled blocks).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np

DIGEST = 32
_ROOT_TAG = b"graphplan-prefix-v1"


def root_key(extra: str | bytes | None = None) -> bytes:
    """The chain's start for requests whose blocks differ by ``extra`` (a LoRA adapter id...)."""
    if extra is None:
        extra = b""
    elif isinstance(extra, str):
        extra = b"s" + extra.encode()
    else:
        extra = b"b" + bytes(extra)
    return hashlib.blake2b(_ROOT_TAG + extra, digest_size=DIGEST).digest()


def chain_keys(
    tokens: Sequence[int], block_size: int, parent: bytes, first: int, count: int
) -> list[bytes]:
    """Keys of blocks ``first .. first + count - 1`` of ``tokens`` (each of them full), chained from
    ``parent``, the key of block ``first - 1`` (the root key for block 0)."""
    if count <= 0:
        return []
    lo = first * block_size
    data = memoryview(array("q", tokens[lo : lo + count * block_size]).tobytes())  # one process's
    step = block_size * 8
    out = []
    for i in range(count):
        parent = hashlib.blake2b(
            parent + data[i * step : (i + 1) * step], digest_size=DIGEST
        ).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Reference counts of ``num_blocks`` blocks, the keys of cached ones, and the free cached ones
    in least recently used order. A block is in exactly one state: held (``ref > 0``, cached or
    not), cached and free (``ref == 0``, in ``lru``), or plain free (the owner's free list)."""

    def __init__(self, num_blocks: int):
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.key_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request holds, least recently used first (evicted first)."""
        self.evictions = 0

    def match(self, keys: Iterable[bytes]) -> list[int]:
        """The blocks of the longest run of ``keys`` that are all cached, in order."""
        out = []
        for k in keys:
            b = self.block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def free_cost(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` taking them removes from the free count (those in the LRU)."""
        return sum(1 for b in blocks if self.ref[b] == 0)

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more holder of each of ``blocks`` (cached ones leave the LRU)."""
        for b in blocks:
            if self.ref[b] == 0:
                del self.lru[b]
            self.ref[b] += 1

    def release(self, blocks: Sequence[int]) -> list[int]:
        """One holder fewer of each of ``blocks``; returns those now plainly free (not cached). A
        sequence's blocks are released last first, so its tail is evicted before its head (the
        head is what other prompts share)."""
        plain = []
        for b in reversed(blocks):
            b = int(b)
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.key_of:
                    self.lru[b] = None
                else:
                    plain.append(b)
        plain.reverse()
        return plain

    def evict(self, n: int) -> list[int]:
        """Take the ``n`` least recently used free cached blocks (there are that many), forgetting
        their keys; they come back held once."""
        out = []
        for _ in range(n):
            b, _ = self.lru.popitem(last=False)
            del self.block_of[self.key_of.pop(b)]
            self.ref[b] = 1
            out.append(b)
        self.evictions += n
        return out

    def register(self, block: int, key: bytes) -> None:
        """``block`` (held, full, its K/V written) now has ``key``. A key cached in another block
        already (two requests computed the same block at once) keeps that one; this block stays
        uncached and goes back plainly free when released."""
        if key in self.block_of or block in self.key_of:
            return
        self.key_of[block] = key
        self.block_of[key] = block

    def check(self, plain_free: Sequence[int], holders: np.ndarray) -> None:
        """Raise AssertionError unless the accounting holds: ``holders[b]`` is how many seat rows
        hold block ``b``, ``plain_free`` the owner's free list."""
        n = len(self.ref)
        free = np.zeros(n, dtype=np.int64)
        np.add.at(free, np.asarray(plain_free, dtype=np.int64), 1)
        assert free.max(initial=0) <= 1, "a block is twice in the free list"
        assert np.array_equal(self.ref, holders), "reference counts differ from the block tables"
        lru = np.zeros(n, dtype=bool)
        lru[list(self.lru)] = True
        assert not (lru & (self.ref > 0)).any(), "a held block is in the LRU"
        assert not (lru & (free > 0)).any(), "a cached free block is in the free list"
        assert not ((free > 0) & (self.ref > 0)).any(), "a held block is in the free list"
        state = (free > 0) | lru | (self.ref > 0)
        assert state.all(), f"blocks lost: {np.flatnonzero(~state).tolist()}"
        assert all(b in self.key_of for b in self.lru), "an uncached block is in the LRU"
        assert not any(free[b] for b in self.key_of), "a cached block is in the free list"
        assert len(self.key_of) == len(self.block_of), "keys and blocks disagree"
        assert all(self.block_of[k] == b for b, k in self.key_of.items()), "keys disagree"
