"""server/core/prompt_logprobs.py on its own: which logits rows give which prompt positions, whatever
the chunking, the batch around a request and its preemptions (hypothesis), and the values: the
log_softmax of those rows, exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphplan.server.core import prompt_logprobs
from graphplan.server.core.batching import StepBatch
from graphplan.server.requests import QueueSink, Request


def request(prompt: list[int], k: int | None = 2) -> Request:
    return Request(prompt, 4, QueueSink(), prompt_logprobs=k)


def batch(parts: list[tuple[Request | str, int, int]]) -> StepBatch:
    """``(request, start, n)`` per request: ``n`` tokens from position ``start`` (a str: another
    request, of n tokens, that asks for nothing)."""
    reqs, ids, rows, total = [], [], [], 0
    for i, (r, start, n) in enumerate(parts):
        toks = tuple(r.prompt[start : start + n]) if isinstance(r, Request) else (0,) * n
        toks = toks + (0,) * (n - len(toks))  # past the prompt: generated tokens
        reqs.append((i, start, toks))
        ids.append(r)
        total += n
        rows.append(total - 1)
    return StepBatch(
        reqs=tuple(reqs),
        request_ids=tuple(ids),
        sample_rows=tuple(rows),
        num_tokens=total,
        max_query_len=max(n for _, _, n in parts),
    )


def test_a_chunk_gives_the_positions_its_rows_predict_inside_the_prompt():
    r = request(list(range(10, 20)))  # 10 prompt tokens
    b = batch([("other", 0, 3), (r, 0, 4)])
    assert prompt_logprobs.spans(b) == [prompt_logprobs.Span(r, 3, 1, 4)]  # rows 3..6: 1..4
    r.prompt_logprobs_sent = 5
    b = batch([(r, 4, 8)])  # the rest of the prompt and 2 generated tokens: rows 0..5 predict 5..9
    assert prompt_logprobs.spans(b) == [prompt_logprobs.Span(r, 0, 5, 5)]
    r.prompt_logprobs_sent = 10
    assert prompt_logprobs.spans(batch([(r, 0, 12)])) == []  # recomputed after a preemption
    assert prompt_logprobs.spans(batch([(request([5]), 0, 1)])) == []  # one token: nothing
    assert prompt_logprobs.spans(batch([(request([5, 6], None), 0, 2)])) == []  # not asked


@settings(max_examples=200, deadline=None)
@given(
    prompt_len=st.integers(1, 40),
    generated=st.integers(0, 6),
    steps=st.lists(st.tuples(st.integers(1, 16), st.integers(0, 5), st.booleans()), max_size=40),
)
def test_every_prompt_position_is_given_once_in_order_from_its_row(prompt_len, generated, steps):
    r = request(list(range(100, 100 + prompt_len)))
    total, computed, given_positions = prompt_len + generated, 0, []
    for n, before, preempt in steps + [(total, 0, False)] * 3:
        if preempt:
            computed = 0
        n = min(n, total - computed)
        if n == 0:
            continue
        b = batch([("other", 0, before), (r, computed, n)] if before else [(r, computed, n)])
        for s in prompt_logprobs.spans(b):
            for j in range(s.count):
                position, row = s.first + j, s.row + j
                assert row - before == position - 1 - computed  # the row of the token before
                given_positions.append(position)
            r.prompt_logprobs_sent = s.first + s.count  # what Pending.read marks
        computed += n
    assert given_positions == list(range(1, prompt_len))


@pytest.mark.parametrize("k", [0, 3])
def test_the_values_are_the_log_softmax_of_the_rows_with_the_top_k(k):
    torch.manual_seed(0)
    a, c = request([3, 1, 4, 1, 5, 9, 2, 6], k), request([2, 7, 1, 8], max(k - 1, 0))
    b = batch([(a, 0, 5), ("other", 0, 2), (c, 0, 4)])
    logits = torch.randn(b.num_tokens + 3, 16, dtype=torch.bfloat16)  # + a graph's padding rows
    pending = prompt_logprobs.launch(b, logits)
    assert pending is not None
    out = pending.read()
    lp = torch.log_softmax(logits.float(), dim=-1)
    for r, first_row in ((a, 0), (c, 7)):
        entries = out[r]
        assert [e.token for e in entries] == r.prompt[1 : 1 + len(entries)]
        for j, e in enumerate(entries):
            row = lp[first_row + j]
            assert e.logprob == row[r.prompt[j + 1]].item()
            want = row.topk(r.prompt_logprobs or 0)
            assert [t for t, _ in e.top] == want.indices.tolist()
            assert [v for _, v in e.top] == want.values.tolist()
    assert len(out[a]) == 5 and len(out[c]) == 3  # rows 0..4 predict 1..5; c's whole prompt
    assert (a.prompt_logprobs_sent, c.prompt_logprobs_sent) == (6, 4)
    assert prompt_logprobs.launch(b, logits) is None  # all sent
