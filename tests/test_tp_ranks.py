"""The step protocol between tensor-parallel ranks (server/wire/ranks.py): rank 0 schedules
through the batcher and sends each step and seat release; rank 1 follows. Two Gloo ranks give
the greedy tokens of one rank (TP=1); a rank holding another table stops with an error naming
both fingerprints."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from test_dp import _spawn
from test_tp import load, save

from graphplan.compiler import compile_plan
from graphplan.models.hf.tp import TPGroup
from graphplan.runtime import GraphRunner
from graphplan.server.core.batching import ContinuousBatcher
from graphplan.server.wire.ranks import (
    RankProtocolError,
    StepSender,
    decode_step,
    encode_step,
    follow,
)

from hf_models import plan, serve_greedy, tokens

PROMPTS = [tokens(n, seed=50 + n, vocab=127) for n in (7, 3, 11)]


def _greedy(model, runner, send=None) -> list[list[int]]:
    batcher = ContinuousBatcher(max_num_seqs=4, token_budget=8, max_model_len=32, num_cache_rows=4)
    if send is not None:  # rank 0: every step and release goes to the other ranks first
        release = model.release
        batcher_schedule = batcher.schedule

        def schedule():
            batch = batcher_schedule()
            if batch is not None:
                send.step(batch.reqs, batch.num_reqs, batch.max_query_len)
            return batch

        batcher.schedule = schedule

        def rel(seat):
            send.release(seat)
            release(seat)

        model.release = rel
    serve_greedy(model, runner, batcher, PROMPTS, 6)
    for seat in range(4):
        model.release(seat)
    return [batcher.finished[i] for i in range(3)]


def _runner(model):
    runner = GraphRunner(model, compile_plan(plan()), model.static_inputs(), progress=False)
    runner.capture()
    return runner


def _ranks_worker(rank, world, path):
    model = load(path, None, TPGroup(rank, world, dist.group.WORLD))
    runner = _runner(model)
    fp = runner.table.fingerprint
    if rank == 0:
        send = StepSender()
        send.hello(fp)
        out = _greedy(model, runner, send)
        send.stop()
        send.hello("another-table")  # the second session: rank 1 must refuse it
        return {"tokens": out}
    steps = follow(model, runner, fp)
    try:
        follow(model, runner, fp)
    except RankProtocolError as exc:
        return {"steps": steps, "error": str(exc)}
    return {"steps": steps, "error": None}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(save(tmp_path_factory.mktemp("m"), "llama", vocab=127, kv_heads=1))


def test_rank_zero_schedules_and_a_follower_gives_the_greedy_tokens_of_one_rank(path, tmp_path):
    model = load(path, None)
    want = _greedy(model, _runner(model))
    r0, r1 = _spawn(_ranks_worker, 2, tmp_path, path)
    assert r0["tokens"] == want and all(len(t) == 6 for t in want)
    assert r1["steps"] > 3
    assert "rank 0 serves table 'another-table'" in r1["error"]
    assert "start every rank from the same plan and model" in r1["error"]


def test_a_step_message_round_trips():
    reqs = [(2, 5, [1]), (0, 0, [7, 8, 9]), (3, 1, [])]
    assert decode_step(encode_step(reqs, 2, 3)) == (reqs, 2, 3, None)
    blocks = [(1, [4]), (0, [0, 9]), (2, [])]  # from index 1, a fresh row, nothing new
    assert decode_step(encode_step(reqs, 2, 3, blocks)) == (reqs, 2, 3, blocks)


def _orphan_worker(rank, world):
    """Rank 0 says hello and exits; rank 1, following, must fail soon, not hang."""
    import time

    send = StepSender()
    if rank == 0:
        send.hello("t")
        return {}
    t0 = time.monotonic()
    try:
        follow(None, None, "t")
    except RuntimeError as exc:  # Gloo: the peer closed its connection
        return {"error": type(exc).__name__, "seconds": time.monotonic() - t0}
    return {"error": None}


def test_a_follower_whose_rank_zero_dies_fails_within_seconds(tmp_path):
    _, r1 = _spawn(_orphan_worker, 2, tmp_path)
    assert r1["error"] is not None and r1["seconds"] < 30
