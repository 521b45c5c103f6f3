"""Prefix caching (models/prefix_cache.py, BlockTables, server/core/prefix_blocks.py; issue 38):
blocks found by their content, shared by reference count, kept in an LRU once free and evicted only
when the pool needs a block; the batcher admits a request past its cached blocks.

The property test drives the batcher over a simulated KV cache: each step writes its tokens into
the slots its block tables give, and the "model" reads every position of a request back from the
cache through its table, so a block shared wrongly (other tokens, a stale or evicted block) would
change the tokens; a write into a block that is shared or registered fails at once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_kv_blocks import next_token, reference

from graphplan.models.paged_kv import BlockTables
from graphplan.models.prefix_cache import chain_keys, root_key
from graphplan.server.core.batching import ContinuousBatcher


def tables(blocks: int, bs: int = 4, seats: int = 2, width: int = 8) -> BlockTables:
    return BlockTables(
        num_blocks=blocks,
        block_size=bs,
        num_seats=seats,
        max_blocks_per_seq=width,
        prefix_caching=True,
    )


def keys(tokens, bs=4, extra=None):
    return chain_keys(tokens, bs, root_key(extra), 0, len(tokens) // bs)


# -- keys ----------------------------------------------------------------------------------------
def test_a_key_names_the_whole_prefix_and_the_extra_key():
    a, b = keys([1, 2, 3, 4, 5, 6, 7, 8]), keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, other first: other key
    assert keys([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # a partial block has no key
    assert keys([1, 2, 3, 4]) == a[:1]
    assert keys([1, 2, 3, 4], extra="lora-a") != keys([1, 2, 3, 4], extra="lora-b") != a[:1]
    assert keys([1, 2, 3, 4], extra="x") != keys([1, 2, 3, 4], extra=b"x")
    assert len(a[0]) == 32 and keys([1 << 40, 0, 0, 0]) != keys([0, 0, 0, 0])
    # keys grow incrementally: blocks 1.. chained from block 0's key equal the whole chain's
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, a[0], 1, 1) == a[1:]


# -- the pool: refcounts, the LRU, eviction ------------------------------------------------------
def test_shared_blocks_are_counted_once_and_stay_cached_when_free():
    t = tables(6)
    t.reserve(0, 0, 8)  # blocks 0, 1
    k = keys(range(8))
    t.register(0, k)
    assert t.lookup(k) == [0, 1] and t.lookup(keys([7] * 8)) == []
    t.attach(1, t.lookup(k))  # seat 1 shares both
    assert t.cache.ref.tolist()[:2] == [2, 2] and t.num_free() == 4 and t.free_cost([0, 1]) == 0
    t.check_accounting()
    t.release(0)
    assert t.num_free() == 4  # still held by seat 1
    t.release(1)
    assert t.num_free() == 6 and list(t.cache.lru) == [1, 0]  # the tail first: evicted first
    assert t.free_cost([0, 1]) == 2 and t.lookup(k) == [0, 1]
    t.check_accounting()


def test_eviction_takes_plain_free_blocks_first_then_the_least_recently_used():
    t = tables(4, width=4)
    t.reserve(0, 0, 8)  # 0, 1
    t.register(0, keys(range(8)))
    t.release(0)  # LRU: 1, 0
    t.reserve(1, 0, 8)  # plain free 2, 3 first: the cached blocks survive
    assert t.row(1)[:2] == [2, 3] and t.lookup(keys(range(8))) == [0, 1]
    t.reserve(1, 8, 4)  # one more: evicts block 1 (the tail), forgetting its key
    assert t.row(1)[:3] == [2, 3, 1] and t.cache.evictions == 1
    assert t.lookup(keys(range(8))) == [0] and t.num_free() == 1
    t.check_accounting()
    t.attach(0, [0])  # a hit leaves the LRU: nothing is free, no block can be taken
    assert t.num_free() == 0 and not t.cache.lru
    t.check_accounting()


def test_a_key_computed_twice_keeps_the_first_block_and_the_copy_is_plainly_freed():
    t = tables(4, width=4)
    t.reserve(0, 0, 4)
    t.reserve(1, 0, 4)
    k = keys(range(4))
    t.register(0, k)
    t.register(1, k)  # the same content computed at once by two requests
    assert t.cache.key_of == {0: k[0]}
    t.release(1)
    assert t.free_blocks() == [2, 3, 1] and not t.cache.lru
    t.check_accounting()


def test_attach_needs_an_empty_seat_and_register_held_blocks():
    t = tables(4, width=4)
    t.reserve(0, 0, 4)
    with pytest.raises(RuntimeError, match="empty seat"):
        t.attach(0, [1])
    with pytest.raises(IndexError, match="2 keys for 1 blocks"):
        t.register(0, keys(range(8)))
    plain = BlockTables(num_blocks=4, block_size=4, num_seats=1, max_blocks_per_seq=4)
    plain.reserve(0, 0, 4)
    with pytest.raises(RuntimeError, match="while no seat holds"):
        plain.enable_prefix_caching()
    plain.check_accounting()
    assert plain.lookup(keys(range(4))) == []


def test_the_accounting_check_catches_a_leak_and_a_double_hold():
    t = tables(4, width=4)
    t.reserve(0, 0, 4)
    t.held[0], t.table[0, 0] = 0, t.pad_block  # forget the seat's block without releasing it
    with pytest.raises(AssertionError, match="reference counts"):
        t.check_accounting()
    p = BlockTables(num_blocks=4, block_size=4, num_seats=2, max_blocks_per_seq=4)
    p.reserve(0, 0, 4)
    p.table[1, 0], p.held[1] = p.table[0, 0], 1
    with pytest.raises(AssertionError, match="held twice"):
        p.check_accounting()


# -- the batcher over a simulated cache ----------------------------------------------------------
def batcher(pool, seqs: int, budget: int, max_len: int, **kw) -> ContinuousBatcher:
    return ContinuousBatcher(
        max_num_seqs=seqs,
        token_budget=budget,
        max_model_len=max_len,
        num_cache_rows=seqs,
        kv_pool=pool,
        **kw,
    )


def run(prompts, max_new, *, cache, blocks, bs, seqs, budget, max_len, arrivals, cancels):
    """Serve ``prompts`` (request i arrives at step ``arrivals[i]``; ``cancels`` {i: step} aborts
    it then) over a simulated cache. Returns the finished outputs, the batcher, the pool."""
    pool = BlockTables(
        num_blocks=blocks,
        block_size=bs,
        num_seats=seqs,
        max_blocks_per_seq=-(-max_len // bs),
        prefix_caching=cache,
    )
    b = batcher(pool, seqs, budget, max_len, prefix_caching=cache)
    kv = np.full((blocks + 1) * bs, -1, dtype=np.int64)  # the token whose K/V each slot holds
    step = added = 0
    while added < len(prompts) or b.has_work():
        while added < len(prompts) and arrivals[added] <= step:
            b.add(added, prompts[added], max_new)
            added += 1
        for i, at in cancels.items():
            if at == step:
                b.abort(i)
        pool.check_accounting()
        batch = b.schedule()
        step += 1
        if batch is None:
            continue
        tokens = []
        for (row, start, toks), sample in zip(batch.reqs, batch.sample_rows):
            pool.reserve(row, start, len(toks))  # what make_batch does
            slots = pool.slots(row, start, len(toks))
            for s in slots:
                blk = s // bs
                if pool.cache is not None:  # never a write into a shared or named block
                    assert pool.cache.ref[blk] == 1 and blk not in pool.cache.key_of
            kv[slots] = toks
            seen = kv[pool.slots(row, 0, start + len(toks))].tolist()  # read back via the table
            tokens.append(next_token(seen) if sample >= 0 else None)
        pool.check_accounting()
        b.commit_tokens(batch, tokens)
    pool.check_accounting()
    return b.finished, b, pool


SHARED = [[(11 * k + j) % 89 + 1 for j in range(40)] for k in range(3)]


@settings(max_examples=200, deadline=None)
@example(  # two requests with one 2-block system prompt, one after the other: the second hits
    reqs=[(0, 9, 2), (0, 9, 3)], max_new=3, extra_blocks=20, budget=64, seqs=2, bs=4,
    spacing=12, cancels=[],
)  # fmt: skip
@example(  # a whole prompt cached: the last block is computed again
    reqs=[(0, 8, 0), (0, 8, 0)], max_new=2, extra_blocks=20, budget=64, seqs=1, bs=4,
    spacing=0, cancels=[],
)  # fmt: skip
@given(
    reqs=st.lists(  # (shared prefix, its length in tokens, a suffix seed; 0: no suffix)
        st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 5)), min_size=1,
        max_size=7,
    ),
    max_new=st.integers(1, 10),
    extra_blocks=st.integers(0, 10),
    budget=st.integers(1, 24),
    seqs=st.integers(1, 4),
    bs=st.sampled_from([1, 2, 4, 8]),
    spacing=st.integers(0, 4),
    cancels=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30)), max_size=3),
)  # fmt: skip
def test_with_the_cache_every_request_gets_exactly_its_tokens_and_no_block_leaks(
    reqs, max_new, extra_blocks, budget, seqs, bs, spacing, cancels
):
    """Any interleaving of requests with shared and unshared prefixes, cancellations and the
    preemptions a small pool forces: each request not cancelled gets the tokens it gets without
    the cache (its reference), the accounting holds at every step, and every block comes back."""
    max_len = 64
    prompts = []
    for shared, n, seed in reqs:
        head = SHARED[shared][:n] if shared < 3 else []
        tail = [(seed * 5 + j) % 89 + 1 for j in range(seed * 3)] if seed or not head else []
        prompts.append((head + tail) or [1])
    prompts = [p[: max_len - max_new] for p in prompts]
    blocks = -(-max_len // bs) + extra_blocks
    kw = dict(
        blocks=blocks,
        bs=bs,
        seqs=seqs,
        budget=budget,
        max_len=max_len,
        arrivals=[i * spacing for i in range(len(prompts))],
        cancels={i: at for i, at in cancels if i < len(prompts)},
    )
    out, b, pool = run(prompts, max_new, cache=True, **kw)
    plain, _, _ = run(prompts, max_new, cache=False, **kw)
    for i, p in enumerate(prompts):
        if i in out:
            assert out[i] == reference(p, max_new)
        if i not in kw["cancels"]:
            assert i in out and i in plain
        assert b.prefix.cached_tokens.get(i, 0) % bs == 0
    assert pool.num_free() == blocks and not pool.held.any()
    assert b.prefix.hits <= b.prefix.queries


def test_a_second_request_sharing_a_system_prompt_computes_only_its_own_tokens():
    """Exact numbers: a 40-token shared prefix, 4-token blocks; the second request, admitted once
    the first has filled the prefix, starts 40 tokens in and its first step runs only its rest."""
    system = SHARED[0]
    prompts = [system + [5, 6, 7], system + [8, 9]]
    out, b, pool = run(
        prompts,
        2,
        cache=True,
        blocks=40,
        bs=4,
        seqs=2,
        budget=64,
        max_len=64,
        arrivals=[0, 3],
        cancels={},
    )
    assert out == {0: reference(prompts[0], 2), 1: reference(prompts[1], 2)}
    assert b.prefix.queries == 43 + 42 and b.prefix.hits == 40
    assert b.prefix.cached_tokens == {0: 0, 1: 40}


def test_admission_counts_only_the_blocks_still_needed():
    """A pool of 12 blocks of 4 and a cached 32-token prompt: a request sharing it needs 1 more
    block (its 33rd token), not 9, and is admitted though 8 of its blocks are cached ones."""
    pool = tables(12, seats=3, width=12)
    b = batcher(pool, 2, 64, 48, watermark=0.0, prefix_caching=True)
    system = SHARED[1][:32]
    b.add("a", system + [1], 1)
    s = b.schedule()
    pool.reserve(*s.reqs[0][:2], len(s.reqs[0][2]))
    b.commit_tokens(s, [3])  # a finishes: its 9 blocks, 8 of them named, stay cached
    assert pool.num_free() == 12 and len(pool.cache.lru) == 8
    pool.reserve(2, 0, 12)  # something else holds 3 blocks: 9 left, 1 plain + 8 cached
    b.add("b", system + [2], 1)
    s = b.schedule()
    assert s.reqs == ((1, 32, (2,)),) and s.num_tokens == 1  # the budget sees one token
    pool.reserve(1, 32, 1)
    assert pool.num_free() == 0
    pool.check_accounting()
