"""A paged step's inputs (models/paged_batch.py over models/paged_kv.py's BlockTables, with
runtime/staging.py's buffers): for any sequence of steps, ``PagedBatchBuilder.build`` gives exactly
the tensors the per-request Python path before it gave (kept below as the reference: a deque of
free blocks, a list per seat, one tensor write per block), and the block tables hand out the same
blocks in the same order, at every step; staging buffers are allocated once and reused; a batch
stays valid after the next ones are built. On CUDA (``gpu``): pinned staging, no ``pin_memory()``
per step, and a staging buffer is never overwritten while its copy may still be in flight."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphplan.models.paged_batch import PagedBatchBuilder
from graphplan.models.paged_kv import BlockTables, KVCacheSizeError
from graphplan.runtime.staging import PinnedStaging

NAMES = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")


class ReferenceTables:
    """BlockTables as it was: a deque of free blocks, a list of blocks per seat."""

    def __init__(self, *, num_blocks, block_size, num_seats, max_blocks_per_seq):
        self.block_size, self.max_blocks, self.pad_block = (
            block_size,
            max_blocks_per_seq,
            num_blocks,
        )
        self.free = deque(range(num_blocks))
        self.seats: list[list[int]] = [[] for _ in range(num_seats)]

    def release(self, seat):
        self.free.extend(self.seats[seat])
        self.seats[seat] = []

    def reserve(self, seat, start, num_tokens):
        if start == 0:
            self.release(seat)
        blocks = self.seats[seat]
        want = -(-(start + num_tokens) // self.block_size)
        if want > self.max_blocks:
            raise KVCacheSizeError("exceed")
        while len(blocks) < want:
            if not self.free:
                raise KVCacheSizeError("no free KV-cache block left")
            blocks.append(self.free.popleft())

    def slots(self, seat, start, n):
        blocks, bs = self.seats[seat], self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    def row(self, seat):
        blocks = self.seats[seat]
        return blocks + [self.pad_block] * (self.max_blocks - len(blocks))


def reference_batch(tables: ReferenceTables, reqs) -> dict[str, torch.Tensor]:
    """PagedCausalLM.make_batch before the staging buffers, on the CPU."""
    ids, pos, slots, rows, seq_lens, qsl = [], [], [], [], [], [0]
    for seat, start, tokens in reqs:
        n = len(tokens)
        tables.reserve(seat, start, n)
        ids += tokens
        pos += range(start, start + n)
        slots += tables.slots(seat, start, n)
        rows.append(tables.row(seat))
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
    i64, i32 = torch.int64, torch.int32
    return dict(
        input_ids=torch.tensor(ids, dtype=i64),
        positions=torch.tensor(pos, dtype=i64),
        slot_mapping=torch.tensor(slots, dtype=i64),
        block_tables=torch.tensor(rows, dtype=i32).reshape(len(reqs), tables.max_blocks),
        seq_lens=torch.tensor(seq_lens, dtype=i32),
        query_start_loc=torch.tensor(qsl, dtype=i32),
    )


def pair(num_blocks=40, block_size=4, num_seats=6, max_blocks=12, max_tokens=8, device="cpu"):
    """A builder over new tables and the reference tables, both empty."""
    kw = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        num_seats=num_seats,
        max_blocks_per_seq=max_blocks,
    )
    tables = BlockTables(**kw)
    builder = PagedBatchBuilder(tables, max_tokens=max_tokens, max_reqs=num_seats, device=device)
    return builder, ReferenceTables(**kw)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert tuple(got) == NAMES
    for name in NAMES:
        g, w = got[name], want[name]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), name
        assert torch.equal(g.cpu(), w), name


def assert_same_tables(new: BlockTables, ref: ReferenceTables) -> None:
    """Every seat's row and count, and the free blocks in the order they are handed out."""
    assert new.num_free() == len(ref.free) and new.free_blocks() == list(ref.free)
    for seat in range(len(ref.seats)):
        assert new.row(seat) == ref.row(seat)
        assert int(new.held[seat]) == len(ref.seats[seat])


@st.composite
def schedules(draw):
    """Steps of requests over distinct seats: a new sequence (start 0), a chunk or a decode that
    continues a seat's sequence, in any order; now and then a seat released between steps."""
    block_size = draw(st.sampled_from([1, 3, 4, 16]))
    seats, max_blocks = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    num_blocks = draw(st.integers(0, seats * max_blocks + 3))
    cap = max_blocks * block_size
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        picked = draw(st.lists(st.integers(0, seats - 1), unique=True, max_size=seats))
        reqs = []
        for seat in picked:
            new = draw(st.booleans())
            n = draw(st.integers(1, min(cap, 20)))
            reqs.append((seat, new, n, draw(st.integers(0, 1000))))
        release = draw(st.lists(st.integers(0, seats - 1), max_size=2))
        steps.append((reqs, release))
    return dict(
        num_blocks=num_blocks, block_size=block_size, num_seats=seats, max_blocks=max_blocks
    ), steps


@settings(max_examples=200, deadline=None)
@given(case=schedules(), max_tokens=st.integers(1, 64))
def test_make_batch_equals_the_per_request_path_and_the_tables_equal_the_allocators_view(
    case, max_tokens
):
    kw, steps = case
    builder, ref = pair(**kw, max_tokens=max_tokens)
    length = [0] * kw["num_seats"]  # tokens in each seat's sequence
    for reqs, release in steps:
        batch = [
            (seat, 0 if new else length[seat], [(tok + i) % 500 for i in range(n)])
            for seat, new, n, tok in reqs
        ]
        try:
            want = reference_batch(ref, batch)
        except KVCacheSizeError as e:
            with pytest.raises(KVCacheSizeError, match=str(e)):
                builder.build(batch)
            assert_same_tables(builder.tables, ref)  # what was reserved before the error, too
            return
        assert_same(builder.build(batch), want)
        assert_same_tables(builder.tables, ref)
        for seat, start, toks in batch:
            length[seat] = start + len(toks)
        for seat in release:
            builder.tables.release(seat)
            ref.release(seat)
            length[seat] = 0
        assert_same_tables(builder.tables, ref)


def test_block_tables_hand_out_free_blocks_first_in_first_out_across_the_ring():
    t = BlockTables(num_blocks=5, block_size=2, num_seats=3, max_blocks_per_seq=4)
    ref = ReferenceTables(num_blocks=5, block_size=2, num_seats=3, max_blocks_per_seq=4)
    for tables in (t, ref):
        tables.reserve(0, 0, 6)  # blocks 0, 1, 2
        tables.reserve(1, 0, 4)  # 3, 4: none free
        tables.release(0)  # 0, 1, 2 go back
        tables.reserve(2, 0, 3)  # 0, 1
        tables.release(1)  # free: 2, 3, 4 (the ring wrapped)
        tables.release(2)  # free: 2, 3, 4, 0, 1
    assert t.free_blocks() == list(ref.free) == [2, 3, 4, 0, 1]
    t.reserve(0, 0, 8)
    ref.reserve(0, 0, 8)
    assert t.row(0) == [2, 3, 4, 0] and t.free_blocks() == [1]
    assert_same_tables(t, ref)


def test_a_reserve_past_the_free_blocks_takes_what_is_left_then_raises_as_before():
    t = BlockTables(num_blocks=3, block_size=2, num_seats=2, max_blocks_per_seq=4)
    ref = ReferenceTables(num_blocks=3, block_size=2, num_seats=2, max_blocks_per_seq=4)
    for tables in (t, ref):
        tables.reserve(0, 0, 2)
        with pytest.raises(KVCacheSizeError, match="no free KV-cache block left"):
            tables.reserve(1, 0, 8)
    assert t.row(1) == ref.row(1) == [1, 2, 3, 3] and t.num_free() == 0
    with pytest.raises(KVCacheSizeError, match="exceed the 8 a block table holds"):
        t.reserve(0, 2, 7)


def test_slots_past_a_seats_blocks_are_an_error_not_the_padding_block():
    t = BlockTables(num_blocks=4, block_size=4, num_seats=1, max_blocks_per_seq=4)
    t.reserve(0, 0, 3)
    assert t.slots(0, 0, 4) == [0, 1, 2, 3]
    with pytest.raises(IndexError, match="past its blocks"):
        t.slots(0, 2, 3)


def test_a_step_reserves_only_for_new_sequences_and_decodes_that_cross_a_block():
    builder, _ = pair(num_blocks=64, block_size=4, num_seats=4, max_blocks=16)
    builder.build([(s, 0, [1] * 5) for s in range(4)])  # 2 blocks each
    calls = []
    reserve = builder.tables.reserve
    builder.tables.reserve = lambda *a: calls.append(a) or reserve(*a)  # type: ignore[method-assign]
    builder.build([(0, 5, [2]), (1, 5, [2]), (2, 7, [2]), (3, 8, [2])])  # seat 3: a 3rd block
    assert calls == [(3, 8, 1)]


def test_staging_buffers_are_allocated_once_and_reused_every_step():
    builder, ref = pair(num_blocks=200, block_size=4, num_seats=6, max_blocks=12, max_tokens=16)
    ptrs = {(id(s), b.data_ptr()) for s in (builder.int64, builder.int32) for b in s._bufs}
    before = builder.allocations()
    lengths = [0] * 6
    for step in range(40):
        reqs = [(s, lengths[s], [step + s] * (1 if lengths[s] else 2)) for s in range(6)]
        assert_same(builder.build(reqs), reference_batch(ref, reqs))
        for s, start, toks in reqs:
            lengths[s] = start + len(toks)
    after = {(id(s), b.data_ptr()) for s in (builder.int64, builder.int32) for b in s._bufs}
    assert builder.allocations() == before == 4 and after == ptrs
    # a step past the capacity grows its turn's buffer once; the next such step reuses it
    big = [(0, 0, list(range(30)))]
    assert_same(builder.build(big), reference_batch(ref, big))
    assert builder.allocations() == 5
    big = [(1, 0, list(range(30)))]
    assert_same(builder.build(big), reference_batch(ref, big))
    assert builder.allocations() == 6  # the other turn
    for seat in (2, 0):
        big = [(seat, 0, list(range(30)))]
        assert_same(builder.build(big), reference_batch(ref, big))
    assert builder.allocations() == 6


def test_a_batch_stays_valid_after_later_batches_are_built():
    builder, ref = pair()
    first = builder.build([(0, 0, [1, 2, 3]), (1, 0, [4])])
    want = reference_batch(ref, [(0, 0, [1, 2, 3]), (1, 0, [4])])
    for step in range(3):
        reqs = [(0, 3 + step, [9]), (1, 1 + step, [8])]
        assert_same(builder.build(reqs), reference_batch(ref, reqs))
    assert_same(first, want)


def test_every_input_starts_16_byte_aligned():
    builder, _ = pair(block_size=3, max_blocks=5)
    batch = builder.build([(0, 0, [1, 2, 3]), (1, 0, [4]), (2, 0, [5, 6])])  # odd counts
    for name in NAMES:
        assert batch[name].data_ptr() % 16 == 0, name


def test_a_seat_out_of_range_is_an_error_before_anything_is_reserved():
    builder, _ = pair(num_seats=3)
    for seat in (-1, 3):
        with pytest.raises(IndexError, match="out of"):
            builder.build([(0, 0, [1]), (seat, 0, [2])])
        assert builder.tables.num_free() == 40


def test_an_empty_step_is_empty():
    builder, ref = pair()
    assert_same(builder.build([]), reference_batch(ref, []))


def test_paged_causal_lm_make_batch_is_the_builders():
    pytest.importorskip("transformers")
    from graphplan.models.hf import PagedCausalLM, load_model

    from hf_models import small_config

    hf = load_model(small_config("llama"), attn_implementation="eager", random_weights=True)
    model = PagedCausalLM(hf, max_num_seqs=3, max_model_len=32, block_size=4)
    ref = ReferenceTables(
        num_blocks=model.cfg.num_blocks, block_size=4, num_seats=3, max_blocks_per_seq=8
    )
    for reqs in ([(0, 0, [5, 6, 7]), (2, 0, [1])], [(2, 1, [3]), (0, 3, [4])]):
        assert_same(model.make_batch(reqs, non_blocking=True), reference_batch(ref, reqs))


# ---- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_staging_is_pinned_and_make_batch_pins_nothing_per_step(monkeypatch):
    builder, ref = pair(device="cuda")
    assert all(b.is_pinned() for s in (builder.int64, builder.int32) for b in s._bufs)

    def refuse(*a, **k):
        raise AssertionError("pin_memory() in a step")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    lengths = [0] * 6
    for step in range(8):
        reqs = [(s, lengths[s], [step] * (2 if step == 0 else 1)) for s in range(6)]
        batch = builder.build(reqs, non_blocking=step % 2 == 0)
        assert all(t.device.type == "cuda" for t in batch.values())
        assert_same(batch, reference_batch(ref, reqs))
        for s, start, toks in reqs:
            lengths[s] = start + len(toks)


@pytest.mark.gpu
def test_on_cuda_a_staging_buffer_is_not_overwritten_while_its_copy_waits_on_the_device():
    """The stream is held busy (``torch.cuda._sleep``), so every non-blocking copy waits behind it
    while the host builds the next batches: each batch still arrives as it was built."""
    builder, ref = pair(num_blocks=400, num_seats=6, max_blocks=40, device="cuda")
    lengths, got, want = [0] * 6, [], []
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the copies
    for step in range(6):
        reqs = [(s, lengths[s], [100 * step + s] * (3 if step == 0 else 1)) for s in range(6)]
        got.append(builder.build(reqs, non_blocking=True))
        want.append(reference_batch(ref, reqs))
        for s, start, toks in reqs:
            lengths[s] = start + len(toks)
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert_same(g, w)


@pytest.mark.gpu
def test_on_cuda_a_non_blocking_batch_does_not_wait_for_the_device():
    """Two batches built while the device sleeps return before it wakes: the second turn's buffer
    has no copy in flight, and the first's copy is not waited for."""
    import time

    s = PinnedStaging(torch.int64, 16, "cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t0 = time.perf_counter()
    for k in range(2):
        s.host(4)[:4] = k
        s.send(4, non_blocking=True)
    host = time.perf_counter() - t0
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy and host < 0.05
