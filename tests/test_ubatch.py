"""Ubatch slicing (docs/semantics.md §8) as rules and properties, and the ubatch schedule on the CPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphplan.runtime import StaticInput
from graphplan.runtime.dp.agreement import agree
from graphplan.runtime.dp.ubatch import (
    Collective,
    UbatchSlice,
    drive,
    last_ubatch_empty,
    run_ubatches,
    slice_inputs,
    ubatch_slices,
)


def test_split_point_is_padded_tokens_floor_divided_by_the_ubatch_count():
    a, b = ubatch_slices([1] * 24, 32, 2, 32)
    assert (a.token_start, a.token_stop, a.padded_token_stop) == (0, 16, 16)
    assert (b.token_start, b.token_stop, b.padded_token_stop) == (16, 24, 32)
    assert (a.req_start, a.req_stop, b.req_start, b.req_stop, b.padded_req_stop) == (
        0,
        16,
        16,
        24,
        32,
    )


def test_a_request_crossing_the_split_belongs_to_both_ubatches():
    a, b = ubatch_slices([3, 10, 4, 7], 32, 2)  # request 1 holds tokens 3..12, request 2 13..16
    assert (a.req_start, a.req_stop) == (0, 3)
    assert (b.req_start, b.req_stop) == (2, 4)


def test_odd_split_with_two_token_decode_splits_a_request():
    a, b = ubatch_slices([2] * 17, 34, 2, 17)  # split at 17: request 8 holds tokens 16, 17
    assert (a.req_stop, b.req_start) == (9, 8)


def test_last_ubatch_empty_rule():
    assert last_ubatch_empty(32, 16, 2) and not last_ubatch_empty(32, 17, 2)
    assert last_ubatch_empty(33, 22, 3) and not last_ubatch_empty(33, 23, 3)
    with pytest.raises(ValueError, match="last ubatch empty"):
        ubatch_slices([1] * 16, 32, 2)


def test_agreement_aborts_ubatching_when_the_smallest_rank_leaves_the_last_ubatch_empty():
    # ranks: 40 tokens padded 48 (wants), 20 tokens padded 24 (wants) -> 48 // 2 = 24 >= 20: abort
    d = agree([[40, 20], [48, 24], [1, 1], [2, 2]], 2)
    assert (d.ubatch, d.ubatch_aborted, d.pad_to) == (False, True, 48)
    d = agree([[40, 30], [48, 32], [1, 1], [2, 2]], 2)
    assert (d.ubatch, d.ubatch_aborted, d.pad_to) == (True, False, 48)


@st.composite
def batches(draw):
    k = draw(st.integers(2, 4))
    lens = draw(st.lists(st.integers(1, 9), min_size=1, max_size=40))
    total = sum(lens)
    padded = draw(st.integers(total, total + 12))
    extra_reqs = draw(st.integers(0, 5))
    return lens, padded, k, len(lens) + extra_reqs


@settings(max_examples=400, deadline=None)
@given(batches())
def test_slices_partition_tokens_and_cover_every_request_they_touch(case):
    lens, padded, k, padded_reqs = case
    total, split = sum(lens), padded // k
    if split * (k - 1) >= total or split < 1:
        with pytest.raises(
            ValueError,
            match=r"cannot split \d+ tokens into \d+ ubatches"
            r"|do not fit \d+ ubatches .*\(last ubatch empty\?\)",
        ):
            ubatch_slices(lens, padded, k, padded_reqs)
        return
    sl = ubatch_slices(lens, padded, k, padded_reqs)
    assert len(sl) == k
    # tokens: contiguous, split at multiples of padded // k, last runs to the real count then pads
    assert [s.token_start for s in sl] == [i * split for i in range(k)]
    assert all(
        s.token_stop == s.padded_token_stop == (i + 1) * split for i, s in enumerate(sl[:-1])
    )
    assert sl[-1].token_stop == total and sl[-1].padded_token_stop == padded
    assert sum(s.num_tokens for s in sl) == padded
    assert all(s.token_stop > s.token_start for s in sl)  # no empty ubatch
    # requests: exactly those whose tokens meet the slice; neighbours share at most one request
    starts = [sum(lens[:j]) for j in range(len(lens))]
    for s in sl:
        touching = [
            j
            for j, (a, q) in enumerate(zip(starts, lens))
            if a < s.token_stop and a + q > s.token_start
        ]
        assert list(range(s.req_start, s.req_stop)) == touching
    for a, b in zip(sl, sl[1:]):
        assert b.req_start in (a.req_stop - 1, a.req_stop)
        crossing = b.req_start == a.req_stop - 1
        j = b.req_start
        assert crossing == (starts[j] < b.token_start < starts[j] + lens[j])
    assert all(s.padded_req_stop == s.req_stop for s in sl[:-1])
    assert sl[-1].padded_req_stop == padded_reqs and sl[0].req_start == 0
    # every real token of every request is in exactly one ubatch
    per_req = [0] * len(lens)
    for s in sl:
        for j in range(s.req_start, s.req_stop):
            lo, hi = max(starts[j], s.token_start), min(starts[j] + lens[j], s.token_stop)
            per_req[j] += hi - lo
    assert per_req == lens


SPECS = [
    StaticInput(name="ids", per="token", dtype=torch.int64),
    StaticInput(name="seq_lens", per="req", dtype=torch.int32),
    StaticInput(name="qsl", per="req+1", dtype=torch.int32, pad="last"),
]


@settings(max_examples=150, deadline=None)
@given(batches())
def test_sliced_offsets_give_each_ubatch_its_part_of_every_request(case):
    lens, padded, k, padded_reqs = case
    total = sum(lens)
    if padded // k < 1 or (padded // k) * (k - 1) >= total:
        return
    qsl = torch.tensor(
        [0] + [sum(lens[: j + 1]) for j in range(len(lens))] + [total] * (padded_reqs - len(lens)),
        dtype=torch.int32,
    )
    inputs = {
        "ids": torch.arange(padded),
        "seq_lens": torch.arange(padded_reqs, dtype=torch.int32),
        "qsl": qsl,
    }
    got = [0] * padded_reqs
    for s in ubatch_slices(lens, padded, k, padded_reqs):
        u = slice_inputs(SPECS, inputs, s)
        assert u["ids"].tolist() == list(range(s.token_start, s.padded_token_stop))
        assert u["seq_lens"].shape[0] == s.num_reqs and u["qsl"].shape[0] == s.num_reqs + 1
        assert u["qsl"][0] == 0 and int(u["qsl"][-1]) <= s.num_tokens
        for j, q in enumerate(u["qsl"].diff().tolist()):
            got[s.req_start + j] += q
    assert got == lens + [0] * (padded_reqs - len(lens))


class Staged(torch.nn.Module):
    """Two layers, a 'collective' (scale by 2, logged) after each: the log shows the schedule."""

    def __init__(self):
        super().__init__()
        self.log = []

    def comm(self, tag, y):
        self.log.append(tag)
        return y * 2

    def forward_stages(self, x):
        for layer in range(2):
            x = yield Collective(self.comm, (f"u{x.shape[0]}l{layer}", x + 1))
        return x

    def forward(self, x):
        return drive(self.forward_stages(x))


def test_schedule_interleaves_ubatches_stage_by_stage_and_matches_the_plain_forward():
    m = Staged()
    x = torch.arange(5.0)
    plain = m(x)
    m.log.clear()
    a, b = run_ubatches(m, [{"x": x[:3]}, {"x": x[3:]}])
    assert torch.equal(torch.cat([a, b]), plain)
    assert m.log == ["u3l0", "u2l0", "u3l1", "u2l1"]  # every rank issues collectives in this order


def test_a_model_without_stages_runs_each_ubatch_whole():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(6, 4)
    outs = run_ubatches(lambda inp: lin(inp), [{"inp": x[:4]}, {"inp": x[4:]}])
    torch.testing.assert_close(torch.cat(outs), lin(x))


def test_slice_dataclass_counts():
    s = UbatchSlice(
        token_start=4, token_stop=7, padded_token_stop=8, req_start=2, req_stop=5, padded_req_stop=6
    )
    assert (s.num_tokens, s.num_reqs) == (4, 4)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 4),
    st.lists(
        st.tuples(st.integers(0, 600), st.integers(0, 64), st.booleans(), st.integers(0, 2)),
        min_size=1,
        max_size=8,
    ),
)
def test_agreement_follows_the_rules_for_any_columns(k, cols):
    # a rank wants to micro-batch only at or above a threshold, and thresholds are >= k (plan rule)
    cols = [(n, n + extra, int(w and n >= k), m) if n else (0, 0, 0, 2) for n, extra, w, m in cols]
    d = agree(list(zip(*cols)), k)
    padded, unpadded = max(c[1] for c in cols), min(c[0] for c in cols)
    wanted = all(c[2] for c in cols)
    assert d.mode == min(c[3] for c in cols)
    assert d.ubatch_aborted == (wanted and last_ubatch_empty(padded, unpadded, k))
    assert d.ubatch == (wanted and not d.ubatch_aborted)
    assert d.pad_to == (padded if (d.mode != 0 or d.ubatch) and padded else None)
    if d.ubatch:  # then every rank can slice its batch: the last ubatch holds real tokens
        assert all(len(ubatch_slices([1] * c[0], padded, k)) == k for c in cols)


def test_sm_carveout_is_set_inside_and_restored_after_even_on_error():
    import torch

    from graphplan.runtime.dp.ubatch import sm_carveout

    get = torch._C._get_sm_carveout_experimental
    before = get()
    with sm_carveout(16):
        assert get() == 16
    assert get() == before
    with pytest.raises(RuntimeError, match="^boom$"), sm_carveout(8):
        raise RuntimeError("boom")
    assert get() == before
    with sm_carveout(None):
        assert get() == before
