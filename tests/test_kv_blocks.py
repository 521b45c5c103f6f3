"""KV blocks on demand (server/core/batching.py with models/paged_kv.py's BlockTables): admission waits
for blocks, a decode that cannot grow preempts the newest requests, which recompute later; every
request finishes with the tokens it would have had with room for all, and every block comes back.

The "model" here is a pure function of each request's whole sequence, so a recomputed request must
produce the same tokens: a preemption that lost or duplicated a token would change them."""

import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from graphplan.models.paged_kv import BlockTables, KVCacheSizeError
from graphplan.server.core.batching import ContinuousBatcher

VOCAB = 97


def next_token(sequence) -> int:
    return (sum((i + 1) * t for i, t in enumerate(sequence)) + len(sequence)) % VOCAB + 1


def run(prompts, max_new, *, blocks, block_size=4, seqs=4, budget=16, max_len=64, arrivals=None):
    """Drive the batcher as the engine does: reserve each step's blocks in the pool (what
    ``make_batch`` does), feed back ``next_token`` of the sequence so far. Returns the outputs,
    the batcher, and the most blocks ever in use."""
    pool = BlockTables(
        num_blocks=blocks,
        block_size=block_size,
        num_seats=seqs,
        max_blocks_per_seq=-(-max_len // block_size),
    )
    b = ContinuousBatcher(
        max_num_seqs=seqs,
        token_budget=budget,
        max_model_len=max_len,
        num_cache_rows=seqs,
        kv_pool=pool,
    )
    seq = {}  # request -> tokens in its cache, as the model would see them
    arrivals = arrivals or [0] * len(prompts)
    step, added, peak = 0, 0, 0
    while added < len(prompts) or b.has_work():
        while added < len(prompts) and arrivals[added] <= step:
            b.add(added, prompts[added], max_new)
            added += 1
        batch = b.schedule()
        step += 1
        if batch is None:
            assert added < len(prompts) or not b.has_work(), "work left but nothing scheduled"
            continue
        tokens = []
        for rid, (row, start, toks), sample in zip(
            batch.request_ids, batch.reqs, batch.sample_rows
        ):
            pool.reserve(row, start, len(toks))  # raises if the batcher over-committed
            seq[rid] = seq.get(rid, [])[:start] + list(toks)
            tokens.append(next_token(seq[rid]) if sample >= 0 else None)
        peak = max(peak, blocks - pool.num_free())
        b.commit_tokens(batch, tokens)
    return [b.finished[i] for i in range(len(prompts))], b, pool, peak


def reference(prompt, max_new):
    out, s = [], list(prompt)
    for _ in range(max_new):
        out.append(next_token(s))
        s.append(out[-1])
    return out


def test_a_pool_of_one_sequence_serves_every_request_by_preempting_and_recomputing():
    prompts = [[1 + i] * (8 + 3 * i) for i in range(4)]
    out, b, pool, peak = run(prompts, 20, blocks=16, max_len=48)  # 16 blocks = one 64-token seq
    assert out == [reference(p, 20) for p in prompts]
    assert b.num_preemptions > 0 and peak <= 16
    assert pool.num_free() == 16  # every block came back


def test_with_room_for_every_seat_nothing_is_preempted():
    prompts = [[3] * 10 for _ in range(4)]
    out, b, _, _ = run(prompts, 12, blocks=4 * 16, max_len=64)
    assert out == [reference(p, 12) for p in prompts] and b.num_preemptions == 0


def test_admission_waits_for_blocks_in_arrival_order_and_a_decode_preempts_the_newest():
    pool = BlockTables(num_blocks=8, block_size=4, num_seats=4, max_blocks_per_seq=8)
    b = ContinuousBatcher(
        max_num_seqs=4,
        token_budget=64,
        max_model_len=32,
        num_cache_rows=4,
        kv_pool=pool,
        watermark=0.0,
    )
    b.add("a", [1] * 24, 4)  # 6 blocks
    b.add("b", [2] * 12, 4)  # 3 blocks: its first chunk is cut to the 2 blocks left
    s = b.schedule()
    assert s.request_ids == ("a", "b") and [len(t) for _, _, t in s.reqs] == [24, 8]
    for row, start, toks in s.reqs:
        pool.reserve(row, start, len(toks))
    b.commit_tokens(s, [5, None])
    b.add("c", [3] * 4, 2)
    # a's decode needs a 7th block and none is free: b, the newest, is preempted (its 2 blocks
    # and row go back), then readmitted first in line with what is left; c waits behind it
    s = b.schedule()
    assert b.num_preemptions == 1 and s.request_ids == ("a", "b")
    assert s.reqs == ((0, 24, (5,)), (2, 0, (2, 2, 2, 2)))


def test_an_aborted_or_finished_request_gives_its_blocks_back():
    pool = BlockTables(num_blocks=8, block_size=4, num_seats=2, max_blocks_per_seq=8)
    b = ContinuousBatcher(
        max_num_seqs=2,
        token_budget=32,
        max_model_len=32,
        num_cache_rows=2,
        kv_pool=pool,
        watermark=0.0,
    )
    b.add("a", [1] * 9, 1)
    b.add("b", [2] * 5, 8)
    s = b.schedule()
    for row, start, toks in s.reqs:
        pool.reserve(row, start, len(toks))
    assert pool.num_free() == 8 - 3 - 2
    b.commit_tokens(s, [7, 8])  # a finishes (max 1 token)
    assert pool.num_free() == 8 - 2
    b.abort("b")
    assert pool.num_free() == 8 and not b.has_work()


@settings(max_examples=150, deadline=None)
@example(  # a decode preempts itself after earlier picks took blocks: they still count
    lens=[18, 1], max_new=16, extra_blocks=0, budget=17, seqs=2, block_size=1, spacing=0
)
@given(
    lens=st.lists(st.integers(1, 30), min_size=1, max_size=7),
    max_new=st.integers(1, 16),
    extra_blocks=st.integers(0, 24),
    budget=st.integers(1, 24),
    seqs=st.integers(1, 4),
    block_size=st.sampled_from([1, 2, 4, 8]),
    spacing=st.integers(0, 3),
)
def test_every_request_finishes_with_its_reference_tokens_whatever_the_pool(
    lens, max_new, extra_blocks, budget, seqs, block_size, spacing
):
    max_len = 48
    one_seq = -(-max_len // block_size)
    prompts = [[(7 * i + j) % VOCAB + 1 for j in range(n)] for i, n in enumerate(lens)]
    out, b, pool, peak = run(
        prompts,
        max_new,
        blocks=one_seq + extra_blocks,
        block_size=block_size,
        seqs=seqs,
        budget=budget,
        max_len=max_len,
        arrivals=[i * spacing for i in range(len(prompts))],
    )
    assert out == [reference(p, max_new) for p in prompts]
    assert peak <= one_seq + extra_blocks and pool.num_free() == one_seq + extra_blocks


def test_a_request_longer_than_max_model_len_is_refused_at_add():
    pool = BlockTables(num_blocks=4, block_size=4, num_seats=1, max_blocks_per_seq=4)
    b = ContinuousBatcher(
        max_num_seqs=1, token_budget=8, max_model_len=16, num_cache_rows=1, kv_pool=pool
    )
    with pytest.raises(ValueError, match="exceed max_model_len 16"):
        b.add("x", [1] * 10, 7)


def test_the_real_scale_benchmark_runs_at_tiny_size_on_the_cpu(tmp_path):
    """bench/real_scale.py --shape tiny: every (max_model_len, context, batch) row has a step, a
    floor and a ratio (the bars are enforced on CUDA only)."""
    import real_scale

    out = tmp_path / "rs.md"
    argv = [
        "--device",
        "cpu",
        "--shape",
        "tiny",
        "--quick",
        "--batches",
        "1,2",
        "--contexts",
        "16,40",
        "--max-model-lens",
        "64,128",
        "--hf-batches",
        "",
        "--out",
        str(out),
    ]
    assert real_scale.main(argv) == 0
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| ") and "x |" in ln]
    assert len(rows) == 2 * 2 * 2, out.read_text()
    assert "step grows" in out.read_text()
    # the real plan's decode graphs: 256 seats, vLLM's sizes up to 256 (the CPU stand-in's capture)
    want = (
        "capture of the decode graphs of plan llama3-8b-h100 (FULL_DECODE_ONLY, max_model_len 64): "
    )
    assert want + "35 graphs in " in out.read_text()


def test_the_offline_throughput_benchmark_finishes_every_request_on_the_cpu(tmp_path):
    """bench/offline_throughput.py at tiny size: every request gets all its tokens through the
    engine loop (chunked prefill, FULL and piecewise replays, KV blocks on demand)."""
    import offline_throughput

    plan = tmp_path / "p.yaml"
    plan.write_text(
        "version: 1\nname: tiny-offline\n"
        "scheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}\n"
        "cudagraph: {mode: FULL_AND_PIECEWISE, attention_support: ALWAYS, splitting_ops: "
        "[attention], capture_sizes: [1, 2, 4, 8, 16, 32, 64]}\n"
    )
    out = tmp_path / "o.md"
    argv = [
        "--device",
        "cpu",
        "--shape",
        "tiny",
        "--requests",
        "12",
        "--max-len",
        "40",
        "--plan",
        str(plan),
        "--out",
        str(out),
    ]
    assert offline_throughput.main([*argv, "--loop", "engine"]) == 0  # the server's engine thread
    text = out.read_text()
    assert "every request finished with all its tokens: True" in text
    counts = re.findall(r"step intervals, (decode|mixed) steps \((\d+)\)", text)
    steps = int(re.search(r"over (\d+) steps", text).group(1))
    assert {k for k, _ in counts} == {"decode", "mixed"}
    assert sum(int(n) for _, n in counts) == steps - 1  # an interval between each two steps
    assert "'PIECEWISE'" in text and "'FULL'" in text and "eager steps {}" in text
    assert offline_throughput.main([*argv, "--loop", "plain"]) == 0
    text = out.read_text()
    assert "every request finished with all its tokens: True" in text
    assert "'PIECEWISE'" in text and "'FULL'" in text and "eager steps {}" in text
    # the breakdown by step kind covers every step and every token of the run, once
    steps = int(re.search(r"over (\d+) steps", text).group(1))
    kinds = re.findall(r"^\| ((?:decode|mixed)[^|]*) \| (\d+) \| (\d+) \|", text, re.M)
    assert sum(int(n) for _, n, _ in kinds) == steps and len({k for k, _, _ in kinds}) == len(kinds)
    assert {k.split(",")[0] for k, _, _ in kinds} == {"decode", "mixed"}
    assert all(k.endswith(("FULL", "PIECEWISE")) for k, _, _ in kinds)


def test_a_default_pool_leaves_a_steps_measured_reserve_free(monkeypatch):
    """size_blocks takes the step's reserve off the free memory before the default share (and
    before a memory fraction): the pool never counts on bytes a step needs."""
    import graphplan.models.paged_kv as paged_kv

    shape = paged_kv.KVCacheShape(layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
    per_block = shape.bytes_per_token * shape.block_size  # 2 KiB
    monkeypatch.setattr(paged_kv, "free_memory_bytes", lambda device: 1000 * per_block)
    size = dict(max_num_seqs=1024, max_model_len=64)  # every seat: 4096 blocks, more than fit
    assert paged_kv.size_blocks(shape, **size) == 900 - 1  # HEADROOM 10 %, less the pad block
    assert paged_kv.size_blocks(shape, **size, reserve_bytes=500 * per_block) == 450 - 1
    half = dict(size, memory_fraction=0.5)
    assert paged_kv.size_blocks(shape, **half, reserve_bytes=200 * per_block) == 400 - 1
    with pytest.raises(paged_kv.KVCacheSizeError, match="one sequence of max_model_len=64"):
        paged_kv.size_blocks(shape, **size, reserve_bytes=999 * per_block)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20)), min_size=1, max_size=30))
def test_a_tp_workers_pool_holds_exactly_rank_0s_rows_and_allocates_nothing(steps):
    """A follower takes rank 0's blocks (server/wire/ranks.py sends the new ones of each seat):
    whatever the steps and releases, its rows are rank 0's, its free ring is untouched, and a step
    past the blocks it was sent is refused, never allocated."""
    kw = dict(num_blocks=12, block_size=4, num_seats=4, max_blocks_per_seq=6)
    lead, follow = BlockTables(**kw, prefix_caching=True), BlockTables(**kw)
    ring, sent, pos = follow.free_blocks(), [0] * 4, [0] * 4
    for seat, n in steps:
        if pos[seat] + n > 24 or lead.num_free() < 6:  # full or out of blocks: the seat finishes
            lead.release(seat)
            follow.release(seat)
            sent[seat] = pos[seat] = 0
            continue
        lead.reserve(seat, pos[seat], n)
        held = int(lead.held[seat])
        follow.assign(seat, sent[seat], lead.table[seat, sent[seat] : held].tolist())
        follow.reserve(seat, pos[seat], n)  # covered: a check only
        sent[seat], pos[seat] = held, pos[seat] + n
        assert (follow.table == lead.table).all() and (follow.held == lead.held).all()
        assert follow.free_blocks() == ring
    seat = steps[0][0]
    with pytest.raises(KVCacheSizeError, match=f"seat {seat}: rank 0 sent no block"):
        follow.reserve(seat, int(follow.held[seat]) * 4, 1)


class _Sender:
    def __init__(self):
        self.released: list[int] = []

    def release(self, seat: int) -> None:
        self.released.append(seat)


def test_the_tp_pool_proxy_keeps_prefix_caching_and_tells_the_workers_of_releases():
    """Tensor parallelism hands the batcher a proxy of rank 0's pool (server/core/tp_serving.py).
    Python 3.12's protocol isinstance looks members up statically and missed the proxy's
    __getattr__, which turned prefix caching off under TP without a word (CI's 3.11 follows
    __getattr__). Each member must be found the static way, whatever the Python; and the batcher
    caches through the proxy: the second request starts past the first's two full blocks."""
    import inspect
    from types import SimpleNamespace

    from graphplan.models.protocol import BlockPool
    from graphplan.server.core.prefix_blocks import PrefixPool
    from graphplan.server.core.tp_serving import _ReleasingPool

    pool = BlockTables(num_blocks=16, block_size=4, num_seats=2, max_blocks_per_seq=8)
    ranks = SimpleNamespace(sender=_Sender(), sent={0: 2})
    proxy = _ReleasingPool(pool, ranks)
    for protocol in (BlockPool, PrefixPool):
        members = set(protocol.__annotations__) | {
            n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")
        }
        assert {"block_size", "num_free"} <= members or {"lookup", "register"} <= members
        for member in members:
            inspect.getattr_static(proxy, member)  # AttributeError: 3.12's isinstance is False
        assert isinstance(proxy, protocol)
    b = ContinuousBatcher(
        max_num_seqs=2, token_budget=64, max_model_len=32, num_cache_rows=2, kv_pool=proxy,
        prefix_caching=True,
    )  # fmt: skip
    assert b.prefix.pool is proxy
    prompt = list(range(1, 11))  # 10 tokens: two full blocks and a part
    b.add("a", prompt, max_new_tokens=1)
    step = b.schedule()
    for row, start, toks in step.reqs:
        pool.reserve(row, start, len(toks))
    b.commit(step, sampled=[7])
    assert ranks.sender.released == [0] and 0 not in ranks.sent
    b.add("b", prompt + [11], max_new_tokens=1)
    step = b.schedule()
    assert step.reqs[0][1] == 8  # admitted past the two cached blocks
    assert b.prefix.cached_tokens["b"] == 8
