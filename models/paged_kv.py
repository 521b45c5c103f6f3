"""A paged KV cache: fixed-size blocks of token slots, a block table per sequence seat, and one
padding block that padded rows write to and nothing real ever reads.

Model-agnostic and free of transformers: ``KVCacheShape`` says what one token costs, ``size_blocks``
turns a token budget or a memory fraction into a block count (and refuses one that cannot hold a
single ``max_model_len`` sequence), ``PagedKVCache`` owns the tensor and ``BlockTables`` hands
blocks to seats as their sequences grow and takes them back when they finish (the server's batcher
admits and preempts requests by its free count: ``server/core/batching.py``).

Layout: ``kv [layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]``; block ``num_blocks``
is the padding block, so the padding slot is ``num_blocks * block_size``. A token's slot is
``block * block_size + position % block_size`` with ``block = table[seat][position // block_size]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from graphplan.compiler.errors import GraphplanError

from .prefix_cache import PrefixCache

GiB = 1 << 30


class KVCacheSizeError(GraphplanError):
    """The KV cache cannot hold max_num_seqs sequences of max_model_len tokens."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KVCacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * 2 * self.kv_heads * self.head_dim * elem

    def blocks_per_seq(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory on CUDA; on the CPU, what the kernel can hand out without swapping
    (/proc/meminfo's MemAvailable, which counts reclaimable page cache), else the free pages."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


HEADROOM = 0.10
"""Share of the free memory (after the weights and a step's measured peak) left beside a
default-sized CUDA pool: graphs, allocator fragmentation."""


def size_blocks(
    shape: KVCacheShape,
    *,
    max_num_seqs: int,
    max_model_len: int,
    tokens: int | None = None,
    memory_fraction: float | None = None,
    device: torch.device | str = "cpu",
    reserve_bytes: int = 0,
) -> int:
    """The pool's block count: for a token budget, or ``memory_fraction`` of the free memory (a
    ``gpu_memory_utilization``-style knob, taken after the weights are loaded); neither: enough
    for ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at what fits in the free
    memory less ``HEADROOM``. Blocks are handed out on demand (``BlockTables``), so the pool need
    not hold every seat at its longest; it must hold one ``max_model_len`` sequence, so that every
    request can finish (the batcher preempts others for it). ``reserve_bytes``: what a step needs
    beside the pool (its activations, logits and sampling at the largest step; measured by the
    model's loader), taken off the free memory before either share. Raises KVCacheSizeError
    otherwise."""
    if tokens is not None and memory_fraction is not None:
        raise KVCacheSizeError("give a KV-cache token budget or a memory fraction, not both")
    one_seq = shape.blocks_per_seq(max_model_len)
    per_block = shape.bytes_per_token * shape.block_size
    if tokens is not None:
        blocks, source = tokens // shape.block_size, f"a budget of {tokens} tokens"
    elif memory_fraction is not None:
        if not 0 < memory_fraction <= 1:
            raise KVCacheSizeError(
                f"KV-cache memory fraction must be in (0, 1], not {memory_fraction}"
            )
        free = free_memory_bytes(torch.device(device)) - reserve_bytes
        blocks = int(free * memory_fraction) // per_block - 1  # one block is the padding block
        source = f"memory fraction {memory_fraction:g} of {free / GiB:.2f} GiB free"
    else:
        free = free_memory_bytes(torch.device(device)) - reserve_bytes
        fit = int(free * (1 - HEADROOM)) // per_block - 1
        blocks = min(max_num_seqs * one_seq, fit)
        source = f"{1 - HEADROOM:g} of the {free / GiB:.2f} GiB free beside a step's"
    if blocks < one_seq:
        want = one_seq * shape.block_size
        raise KVCacheSizeError(
            f"KV cache from {source} has {max(blocks, 0)} blocks of {shape.block_size} tokens; "
            f"one sequence of max_model_len={max_model_len} needs {one_seq} blocks ({want} "
            f"tokens, {want * shape.bytes_per_token / GiB:.3f} GiB): raise the budget, or lower "
            "max_model_len"
        )
    return blocks


class PagedKVCache:
    """The cache tensor, zero-filled (padding and stale slots hold finite values, so masked
    attention weights of 0 never meet a NaN)."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, device: torch.device | str):
        self.shape, self.num_blocks = shape, num_blocks
        self.kv = torch.zeros(
            (shape.layers, 2, num_blocks + 1, shape.block_size, shape.kv_heads, shape.head_dim),
            dtype=shape.dtype,
            device=device,
        )

    @property
    def pad_block(self) -> int:
        return self.num_blocks

    @property
    def pad_slot(self) -> int:
        return self.num_blocks * self.shape.block_size

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class BlockTables:
    """Blocks per seat (a batcher's cache row), allocated as its sequence grows. A chunk that starts
    at position 0 is a new sequence: the seat's old blocks go back first.

    Kept as arrays, so a step's work is a few array operations however long its sequences are:
    ``table`` [num_seats, max_blocks_per_seq] int32 holds every seat's row (its blocks in order,
    then the padding block), ``held`` how many blocks each seat holds; the free blocks are a ring,
    handed out first in, first out. A step's rows are gathered straight into the buffer that goes
    to the device (``rows_into``) and its slots computed for all its tokens at once
    (``slots_into``).

    With prefix caching (``enable_prefix_caching``; ``prefix_cache.PrefixCache``) blocks are
    shared between seats by reference count: ``attach`` starts a seat's row with cached blocks
    (``lookup``), ``register`` names a seat's full written blocks by their keys, and a released
    block that has a key stays cached, counted free, until ``_take`` evicts it (least recently
    used first, after the plainly free blocks)."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_seats: int,
        max_blocks_per_seq: int,
        prefix_caching: bool = False,
    ):
        self.block_size, self.max_blocks = block_size, max_blocks_per_seq
        self.pad_block = num_blocks
        # the free blocks: ring[head], ring[head + 1], ... (mod num_blocks), _num_free of them
        self._ring = np.arange(num_blocks, dtype=np.int32)
        self._head, self._num_free = 0, num_blocks
        self.held = np.zeros(num_seats, dtype=np.int64)
        """[num_seats]: blocks each seat holds, the first ``held[seat]`` of its row."""
        self.table = np.full((num_seats, max_blocks_per_seq), num_blocks, dtype=np.int32)
        """[num_seats, max_blocks_per_seq] int32: every seat's row, padded with the padding
        block."""
        self.cache: PrefixCache | None = None
        self.mirror = False  # a TP follower's rows: rank 0's blocks (``assign``)
        if prefix_caching:
            self.enable_prefix_caching()

    def limit(self, num_blocks: int) -> None:
        """Hand out only blocks [0, num_blocks) (a fresh pool, before any is taken): the ranks of
        a tensor-parallel server agree on the smallest pool among them, so that every rank's
        blocks hold what rank 0's batcher admits."""
        if self._num_free != len(self._ring) or not 0 < num_blocks <= len(self._ring):
            raise ValueError(f"limit({num_blocks}): only a fresh pool of at least that many")
        self._ring = self._ring[:num_blocks].copy()
        self._head, self._num_free = 0, num_blocks

    def num_free(self) -> int:
        """Blocks a seat can take: the plainly free ones and the cached ones no seat holds."""
        return self._num_free + (len(self.cache.lru) if self.cache is not None else 0)

    def free_blocks(self) -> list[int]:
        """The free blocks in the order they will be handed out."""
        return np.roll(self._ring, -self._head)[: self._num_free].tolist()

    def _take(self, out: np.ndarray) -> None:
        """Fill ``out`` with the next ``len(out)`` free blocks (there are that many): plainly free
        ones first, then (prefix caching) the least recently used cached ones, evicted."""
        if self.cache is not None:
            plain = min(len(out), self._num_free)
            if plain < len(out):
                out[plain:] = self.cache.evict(len(out) - plain)
            self._take_ring(out[:plain])
            self.cache.ref[out[:plain]] = 1
        else:
            self._take_ring(out)

    def _take_ring(self, out: np.ndarray) -> None:
        k, n, h = len(out), len(self._ring), self._head
        if not k:
            return
        first = min(k, n - h)
        out[:first] = self._ring[h : h + first]
        out[first:] = self._ring[: k - first]
        self._head = (h + k) % n
        self._num_free -= k

    def _give(self, blocks: np.ndarray) -> None:
        """Put ``blocks`` back at the ring's end, in order."""
        k, n = len(blocks), len(self._ring)
        if not k:
            return
        tail = (self._head + self._num_free) % n
        first = min(k, n - tail)
        self._ring[tail : tail + first] = blocks[:first]
        self._ring[: k - first] = blocks[first:]
        self._num_free += k

    def assign(self, seat: int, first: int, blocks: Sequence[int]) -> None:
        """A tensor-parallel follower's row: rank 0's blocks of the seat from index ``first``
        (server/wire/ranks.py). From the first call the pool mirrors rank 0's scheduler and
        decides nothing: ``reserve`` only checks the rows cover a step, ``release`` forgets."""
        self.mirror, n = True, first + len(blocks)
        self.table[seat, first:n] = blocks
        self.table[seat, n:] = self.pad_block
        self.held[seat] = n

    def release(self, seat: int) -> None:
        k = int(self.held[seat])
        row = self.table[seat]
        if not self.mirror:
            self._give_back(row[:k])
        row[:k] = self.pad_block
        self.held[seat] = 0

    def _give_back(self, blocks: np.ndarray) -> None:
        """A seat's ``blocks`` let go: to the free ring, or (prefix caching) to the cache, which
        keeps those still shared or named and hands back the rest."""
        if self.cache is not None:
            self._give(np.asarray(self.cache.release(blocks.tolist()), dtype=np.int32))
        else:
            self._give(blocks)

    def truncate(self, seat: int, num_tokens: int) -> None:
        """Keep the blocks of positions [0, num_tokens) of the seat's sequence; give back those
        past them (speculative decoding's rejected tokens: server/core/spec/batcher.py)."""
        keep = -(-num_tokens // self.block_size)
        have = int(self.held[seat])
        if keep >= have:
            return
        row = self.table[seat]
        self._give_back(row[keep:have].copy())
        row[keep:have] = self.pad_block
        self.held[seat] = keep

    def reserve(self, seat: int, start: int, num_tokens: int) -> None:
        """Blocks for positions [0, start + num_tokens) of the seat's sequence."""
        if self.mirror and start + num_tokens > int(self.held[seat]) * self.block_size:
            raise KVCacheSizeError(f"seat {seat}: rank 0 sent no block for position {start}+")
        if self.mirror:
            return
        if start == 0:
            self.release(seat)
        have = int(self.held[seat])
        want = -(-(start + num_tokens) // self.block_size)
        if want > self.max_blocks:
            raise KVCacheSizeError(
                f"seat {seat}: {start + num_tokens} tokens exceed the "
                f"{self.max_blocks * self.block_size} a block table holds"
            )
        if want <= have:
            return
        k = min(want - have, self.num_free())  # as many as there are, then the error
        self._take(self.table[seat, have : have + k])
        self.held[seat] = have + k
        if have + k < want:
            raise KVCacheSizeError(f"seat {seat}: no free KV-cache block left")

    def reserve_all(self, seats: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """``reserve(seat, start, count)`` for each request of a step, in order (distinct seats):
        the call is made only for a request that starts a sequence or needs another block (a
        decode needs one every ``block_size`` steps), found with array operations."""
        if len(seats) and not (0 <= seats.min() and seats.max() < len(self.held)):
            raise IndexError(f"seats {seats.tolist()}: a seat is out of [0, {len(self.held)})")
        want = -(-(starts + counts) // self.block_size)
        for i in np.flatnonzero((starts == 0) | (want > self.held[seats])).tolist():
            self.reserve(int(seats[i]), int(starts[i]), int(counts[i]))

    def slots(self, seat: int, start: int, num_tokens: int) -> list[int]:
        end = start + num_tokens
        if end > int(self.held[seat]) * self.block_size:
            raise IndexError(f"seat {seat}: positions up to {end} are past its blocks")
        pos = np.arange(start, end, dtype=np.int64)
        out = np.empty(num_tokens, dtype=np.int64)
        self.slots_into(np.full(num_tokens, seat), pos, out)
        return out.tolist()

    def slots_into(self, seats: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
        """``out[i]``: the slot of position ``positions[i]`` of seat ``seats[i]``'s sequence
        (``table[seat][p // block_size] * block_size + p % block_size``)."""
        bs = self.block_size
        np.multiply(self.table[seats, positions // bs], bs, out=out, dtype=np.int64)
        out += positions % bs

    def row(self, seat: int) -> list[int]:
        """The seat's block table, padded with the padding block to ``max_blocks_per_seq``."""
        return self.table[seat].tolist()

    def rows(self, seats: list[int]) -> torch.Tensor:
        """[len(seats), max_blocks_per_seq] int32 on the CPU: the seats' block tables."""
        return torch.from_numpy(self.table[np.asarray(seats, dtype=np.int64)])

    def rows_into(self, seats: np.ndarray, out: np.ndarray) -> None:
        """The seats' rows into ``out`` [len(seats), max_blocks_per_seq] int32, one gather
        (seats in range: ``reserve_all`` checks them)."""
        np.take(self.table, seats, axis=0, out=out, mode="clip")  # "raise" gathers via a copy

    # -- prefix caching (models/prefix_cache.py) ---------------------------------------------------
    def enable_prefix_caching(self) -> None:
        """Share full blocks by content from now on (while no seat holds a block)."""
        if self.cache is not None:
            return
        if self.held.any():
            raise RuntimeError("prefix caching can only be turned on while no seat holds blocks")
        self.cache = PrefixCache(self.pad_block)

    @property
    def prefix_caching(self) -> bool:
        return self.cache is not None

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``keys`` (none without prefix caching)."""
        return self.cache.match(keys) if self.cache is not None else []

    def free_cost(self, blocks: Sequence[int]) -> int:
        """Free blocks that attaching ``blocks`` takes (those cached that no seat holds)."""
        return self.cache.free_cost(blocks) if self.cache is not None else 0

    def attach(self, seat: int, blocks: Sequence[int]) -> None:
        """Start ``seat``'s sequence (it holds none) with the cached ``blocks`` (``lookup``'s)."""
        if not blocks:
            return
        if self.cache is None or self.held[seat]:
            raise RuntimeError(f"seat {seat}: attach needs prefix caching and an empty seat")
        self.cache.acquire(blocks)
        self.table[seat, : len(blocks)] = blocks
        self.held[seat] = len(blocks)

    def register(self, seat: int, keys: Sequence[bytes], first: int = 0) -> None:
        """``keys[i]`` names the seat's block i (full, its K/V written by a launched step), for
        ``i >= first``."""
        if self.cache is None:
            return
        if len(keys) > int(self.held[seat]):
            raise IndexError(f"seat {seat}: {len(keys)} keys for {int(self.held[seat])} blocks")
        row = self.table[seat]
        for i in range(first, len(keys)):
            self.cache.register(int(row[i]), keys[i])

    def check_accounting(self) -> None:
        """Raise AssertionError unless every block is exactly one of: plainly free, cached and
        free, or held by the seats (each holder counted in its reference count)."""
        held = [self.table[s, : int(k)] for s, k in enumerate(self.held.tolist())]
        rows = np.concatenate(held) if held else np.zeros(0, dtype=np.int32)
        assert (rows < self.pad_block).all(), "a seat holds the padding block"
        for s, k in enumerate(self.held.tolist()):
            assert (self.table[s, k:] == self.pad_block).all(), f"seat {s}: a stale block"
        holders = np.bincount(rows, minlength=self.pad_block)
        free = self.free_blocks()
        if self.cache is not None:
            self.cache.check(free, holders)
            return
        assert holders.max(initial=0) <= 1, "a block is held twice"
        seen = holders.copy()
        np.add.at(seen, np.asarray(free, dtype=np.int64), 1)
        assert (seen == 1).all(), "a block is lost, or both free and held"
