"""server/core/batching.py: the continuous batcher's scheduling rules (pure Python, exact expectations)."""

import pytest
import torch

from graphplan.server.core.batching import ContinuousBatcher, TokenEvent


def batcher(budget=8, seqs=4, rows=4, max_len=64):
    return ContinuousBatcher(
        max_num_seqs=seqs, token_budget=budget, max_model_len=max_len, num_cache_rows=rows
    )


def test_prompts_are_chunked_within_the_budget_and_sample_only_when_the_prompt_is_done():
    b = batcher(budget=8)
    b.add("a", list(range(1, 11)), max_new_tokens=3)  # 10 prompt tokens
    b.add("b", [7, 8, 9], max_new_tokens=2)
    s1 = b.schedule()
    assert s1.reqs == ((0, 0, tuple(range(1, 9))),) and s1.sample_rows == (-1,)  # b waits
    assert b.commit_tokens(s1, [None]) == []
    s2 = b.schedule()
    assert s2.reqs == ((0, 8, (9, 10)), (1, 0, (7, 8, 9)))
    assert s2.sample_rows == (1, 4) and (s2.num_tokens, s2.max_query_len, s2.num_reqs) == (5, 3, 2)
    assert b.commit_tokens(s2, [50, 60]) == [
        TokenEvent(request_id="a", token=50, finished=False),
        TokenEvent(request_id="b", token=60, finished=False),
    ]
    s3 = b.schedule()  # both decode: a uniform batch
    assert s3.reqs == ((0, 10, (50,)), (1, 3, (60,))) and s3.max_query_len == 1
    assert [e.finished for e in b.commit_tokens(s3, [51, 61])] == [False, True]
    assert b.finished == {"b": [60, 61]}
    s4 = b.schedule()
    assert s4.reqs == ((0, 11, (51,)),)
    b.commit_tokens(s4, [52])
    assert b.finished["a"] == [50, 51, 52] and not b.has_work() and b.schedule() is None


def test_decodes_go_first_and_a_new_prompt_gets_the_rest_of_the_budget():
    b = batcher(budget=6)
    b.add(0, [1, 2], max_new_tokens=4)
    b.commit_tokens(b.schedule(), [9])
    b.add(1, list(range(20, 30)), max_new_tokens=1)
    s = b.schedule()
    assert s.reqs == ((0, 2, (9,)), (1, 0, (20, 21, 22, 23, 24))) and s.sample_rows == (0, -1)
    assert s.num_tokens == 6


def test_requests_wait_for_a_free_cache_row_and_max_num_seqs_and_rows_are_reused():
    b = batcher(budget=32, seqs=2, rows=3)
    for i in range(3):
        b.add(i, [i + 1], max_new_tokens=1)
    s = b.schedule()
    assert [r[0] for r in s.reqs] == [0, 1] and s.request_ids == (0, 1)  # max_num_seqs 2
    b.commit_tokens(s, [5, 6])  # both finish, rows 0 and 1 are free again
    s = b.schedule()
    assert s.request_ids == (2,) and s.reqs[0][0] == 2
    b.add(3, [4], max_new_tokens=1)
    b.commit_tokens(s, [7])
    assert b.schedule().reqs[0][0] == 0  # the oldest freed row


def test_commit_takes_the_argmax_of_each_sampling_row():
    b = batcher(budget=8)
    b.add("x", [1, 2, 3], max_new_tokens=2)
    b.add("y", [4], max_new_tokens=2)
    s = b.schedule()
    logits = torch.zeros(4, 10)
    logits[2, 7] = 1.0  # x's last prompt token
    logits[3, 3] = 1.0  # y's
    logits[0, 9] = 5.0  # not a sampling row
    assert [(e.request_id, e.token) for e in b.commit(s, logits)] == [("x", 7), ("y", 3)]


def test_commit_takes_a_samplers_tokens_in_sampling_row_order_and_ignores_padding():
    b = batcher(budget=8)
    b.add("x", [1, 2, 3], max_new_tokens=2)
    b.add("y", [4], max_new_tokens=2)
    b.add("z", list(range(10)), max_new_tokens=2)  # its first chunk samples nothing
    s = b.schedule()
    assert s.sampling_rows == (2, 3) and s.sampling_cache_rows == (0, 1)
    events = b.commit(s, sampled=torch.tensor([7, 3, 99, 99]))  # two rows of graph padding
    assert [(e.request_id, e.token) for e in events] == [("x", 7), ("y", 3)]
    s = b.schedule()
    assert s.sampling_cache_rows == (0, 1, 2) and s.sampling_rows == (0, 1, 7)
    with pytest.raises(ValueError, match="2 sampled tokens for 3 sampling requests"):
        b.commit(s, sampled=[1, 2])
    with pytest.raises(ValueError, match="either the step's logits or the sampled token ids"):
        b.commit(s, torch.zeros(7, 10), sampled=[1, 2, 3])


def test_a_stop_token_finishes_early_and_abort_frees_the_row():
    b = batcher(budget=8, rows=1)
    b.add("s", [1], max_new_tokens=5, stop_token_ids=[0])
    assert b.commit_tokens(b.schedule(), [0]) == [
        TokenEvent(request_id="s", token=0, finished=True)
    ]
    b.add("t", [1, 2], max_new_tokens=5)
    b.add("u", [3], max_new_tokens=5)
    s = b.schedule()
    assert s.request_ids == ("t",)  # one cache row
    b.abort("t")
    assert b.commit_tokens(s, [8]) == []  # its step's result is dropped
    assert b.schedule().request_ids == ("u",)


def test_bad_requests_are_refused_with_the_reason():
    b = batcher(max_len=16)
    b.add("a", [1], max_new_tokens=1)
    with pytest.raises(ValueError, match="'a' is already in use"):
        b.add("a", [1], max_new_tokens=1)
    with pytest.raises(ValueError, match="10 prompt \\+ 7 new tokens exceed max_model_len 16"):
        b.add("b", [1] * 10, max_new_tokens=7)
    with pytest.raises(ValueError, match="non-empty prompt"):
        b.add("c", [], max_new_tokens=1)
