"""DP agreement (docs/semantics.md §7) and micro-batching on real torch.distributed Gloo groups.

Ranks are spawned processes on 127.0.0.1 (a free port per test); each writes what it saw to a JSON
file that the test then compares across ranks and against the pure functions.
"""

import datetime
import json
import os
import random
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphplan.compiler import compile_plan
from graphplan.compiler.errors import BatchError
from graphplan.compiler.records import RuntimeMode
from graphplan.runtime import GraphRunner, StaticInput
from graphplan.runtime.dp.agreement import (
    IDLE,
    DPCoordinator,
    DPError,
    DPTimeoutError,
    agree,
    contribution,
)
from graphplan.runtime.dp.runner import DPRunner, dummy_shape, pad_inputs

# -- the rules, in one process ---------------------------------------------------------------


def test_synced_mode_is_the_minimum_and_ranks_pad_to_the_largest_padded_size():
    d = agree([[5, 30], [8, 32], [0, 0], [2, 1]], 2)
    assert (d.mode, d.pad_to, d.ubatch) == (RuntimeMode.PIECEWISE, 32, False)


def test_synced_mode_none_without_ubatch_keeps_each_rank_at_its_own_size():
    d = agree([[5, 300], [8, 300], [0, 0], [2, 0]], 2)
    assert (d.mode, d.pad_to, d.dummy_tokens) == (RuntimeMode.NONE, None, 300)


def test_ubatch_needs_every_rank_and_pads_even_in_mode_none():
    assert not agree([[40, 40], [48, 40], [1, 0], [0, 0]], 2).ubatch
    d = agree([[40, 36], [40, 36], [1, 1], [0, 0]], 2)
    assert (d.ubatch, d.mode, d.pad_to) == (True, RuntimeMode.NONE, 40)


def test_an_idle_rank_is_neutral_for_the_mode_but_calls_off_ubatching():
    assert contribution(0) == IDLE == (0, 0, 0, 2)
    d = agree([[40, 0], [48, 0], [1, 0], [2, 2]], 2)
    assert (d.mode, d.pad_to, d.ubatch, d.ubatch_aborted) == (RuntimeMode.FULL, 48, False, False)
    assert d.dummy_tokens == 48 and not d.idle
    assert agree([[0, 0], [0, 0], [0, 0], [2, 2]], 2).idle


def _no_twins_plan():
    """SEMANTICS section 6's example: FULL_AND_PIECEWISE, sizes 16-128, DP 2, k=2, decode
    threshold 32, no plain twins (sizes >= 32 have only ubatched FULL decode graphs)."""
    return compile_plan(
        {
            "version": 1,
            "name": "no-twins",
            "scheduler": {"max_num_seqs": 128, "max_num_batched_tokens": 256},
            "cudagraph": {
                "mode": "FULL_AND_PIECEWISE",
                "attention_support": "ALWAYS",
                "splitting_ops": ["attention"],
                "capture_sizes": [16, 32, 64, 128],
            },
            "parallel": {
                "data_parallel_size": 2,
                "ubatch": {
                    "enabled": True,
                    "num_ubatches": 2,
                    "decode_token_threshold": 32,
                    "plain_twins": False,
                },
            },
        }
    )


def test_a_rank_wanting_to_ubatch_at_a_ubatched_graph_size_contributes_full_without_twins():
    table = _no_twins_plan()
    cols = [contribution(n, table.route(n, n, 1)) for n in (64, 48)]  # uniform decode, q = 1
    assert cols == [(64, 64, 1, 2), (48, 64, 1, 2)]
    d = agree(list(zip(*cols)), 2)
    assert (d.mode, d.ubatch, d.pad_to) == (RuntimeMode.FULL, True, 64)
    for n in (64, 48):  # every rank re-dispatches onto the ubatched FULL graph at 64 tokens
        route = table.route(n, n, 1, allow=d.mode, pad_to=d.pad_to, ubatched=d.ubatch)
        assert (route.mode, route.padded_tokens) == (RuntimeMode.FULL, 64)
        assert route.graph.num_ubatches == 2 and route.graph.num_tokens == 64


def test_an_aborted_ubatch_without_twins_falls_back_after_agreement():
    table = _no_twins_plan()
    cols = [contribution(n, table.route(n, n, 1)) for n in (64, 32)]
    d = agree(list(zip(*cols)), 2)  # (64 // 2) * 1 >= 32: the last ubatch would be empty
    assert (d.mode, d.ubatch, d.ubatch_aborted, d.pad_to) == (RuntimeMode.FULL, False, True, 64)
    route = table.route(32, 32, 1, allow=d.mode, pad_to=d.pad_to)
    assert (route.mode, route.padded_tokens) == (RuntimeMode.NONE, 64)  # no plain twin: eager at 64
    # below the threshold nothing changes: the plain route (a 16-token FULL decode graph)
    assert contribution(16, table.route(16, 16, 1)) == (16, 16, 0, 2)
    # a mixed batch has no ubatched graph: it keeps its PIECEWISE contribution
    assert contribution(64, table.route(64, 8, 8))[3] == 1


def test_dummy_batches_are_uniform_decode_when_they_can_be():
    assert dummy_shape(48, 2, 256) == (24, 2)
    assert dummy_shape(47, 2, 256) == (47, 1)  # odd: mixed, one token per request
    assert dummy_shape(600, 1, 256) == (256, 3)


def test_pad_inputs_uses_each_inputs_pad_value():
    specs = [
        StaticInput(name="ids", per="token", dtype=torch.int64, pad=7),
        StaticInput(name="qsl", per="req+1", dtype=torch.int32, pad="last"),
    ]
    batch = {"ids": torch.tensor([1, 2]), "qsl": torch.tensor([0, 2], dtype=torch.int32)}
    out = pad_inputs(specs, batch, 4, 3)
    assert out["ids"].tolist() == [1, 2, 7, 7] and out["qsl"].tolist() == [0, 2, 2, 2]


def test_a_dp_group_of_one_needs_no_torch_distributed():
    c = DPCoordinator()
    assert (c.size, c.rank) == (1, 0)
    c.check_fingerprint("sha256:x")
    assert c.sync(5, 8, 0, 2).pad_to == 8
    with pytest.raises(ValueError, match="exchange='ring': use one of auto, p2p, all_gather"):
        DPCoordinator(exchange="ring")


def test_an_exchange_is_started_once_and_finished_once():
    c = DPCoordinator()
    c.start(5, 8, 0, 2)
    with pytest.raises(DPError, match="still in flight: finish"):
        c.start(5, 8, 0, 2)
    assert c.finish().pad_to == 8 and c.step_no == 1
    with pytest.raises(DPError, match="finish\\(\\) without start\\(\\)"):
        c.finish()


def test_prepare_announces_the_next_batch_and_step_must_bring_that_batch():
    from graphplan.models.tiny_llama import static_inputs

    model, ref = _tiny()
    dp = DPRunner(
        GraphRunner(model, compile_plan(_plan(dp=2)), static_inputs(model), progress=False)
    )
    from graphplan.models.tiny_llama import make_batch

    batch = make_batch(model, [(0, 0, [5, 6, 7]), (1, 0, [9])])
    with pytest.raises(BatchError, match="max_num_batched_tokens"):
        dp.prepare(10_000, 2, 3)  # the table rejects it before anything is sent
    dp.prepare(4, 2, 3)
    with pytest.raises(BatchError, match="already called for the next step"):
        dp.prepare(4, 2, 3)
    with pytest.raises(
        BatchError,
        match=r"got a batch of shape 4 tokens, num_reqs=2, "
        r"max_query_len=2.*prepare\(\) announced 4 tokens, num_reqs=2, "
        r"max_query_len=3",
    ):
        dp.step(batch, 2, 2)
    with pytest.raises(BatchError, match="announced 4 tokens.*inputs=None if it had no tokens"):
        dp.step(None)
    out = dp.step(batch, 2, 3)  # the announced batch: the exchange is collected, then it runs
    torch.testing.assert_close(out, ref(**batch), rtol=1e-4, atol=1e-4)
    assert dp.counts["steps"] == 1 and dp.coord.step_no == 1
    dp.prepare()  # an idle step, announced
    assert dp.step(None) is None and dp.last_decision.idle


class CountingBackend:
    """A torch.compile backend that runs each graph as traced and counts the runs of compiled
    code: any call of the compiled model adds to ``runs``."""

    def __init__(self):
        self.runs = 0

    def __call__(self, gm, example_inputs):
        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


def test_dp_eager_steps_run_the_eager_model_not_the_compiled_one():
    """With compile on, DP's padded and micro-batched eager steps run what single-rank eager
    steps run (GraphRunner.eager_model, through run_eager), never the compiled model."""
    from graphplan.models.tiny_llama import make_batch, static_inputs

    model, ref = _tiny()
    backend = CountingBackend()
    runner = GraphRunner(
        model, compile_plan(_plan(dp=2)), static_inputs(model), progress=False, compile=backend
    )
    eager_calls = []
    runner.eager_model = lambda **kw: eager_calls.append(kw) or model(**kw)
    dp = DPRunner(runner)  # a DP group of one
    dp.capture(("PIECEWISE",))  # the plan is FULL: compiles, captures no graph
    assert backend.runs > 0  # the compile warm-up ran compiled code
    backend.runs = 0

    decode = make_batch(model, [(row, 0, [5 + row]) for row in range(3)])
    out = dp.step(decode, 3, 1)  # FULL graph at 4 tokens, not captured: eager at 4
    assert dp.last_decision.pad_to == 4 and not dp.last_decision.ubatch
    torch.testing.assert_close(out, ref(**decode), rtol=1e-4, atol=1e-4)
    assert backend.runs == 0  # no compiled code ran
    assert len(eager_calls) == 1 and eager_calls[0]["input_ids"].shape[0] == 4

    prefill = make_batch(model, [(3, 0, list(range(1, 14))), (4, 0, list(range(20, 33)))])
    out = dp.step(prefill, 2, 13)  # 26 tokens >= the prefill threshold: micro-batched, eager
    assert dp.last_decision.ubatch and dp.counts["ubatched_steps"] == 1
    torch.testing.assert_close(out, ref(**prefill), rtol=1e-4, atol=1e-4)
    assert len(eager_calls) == 3  # one call per micro-batch
    assert backend.runs == 0 and sum(runner.stats()["eager_steps"].values()) == 2


# -- spawned Gloo ranks -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, target, out_dir, args):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    result = target(rank, world, *args)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip process-group teardown: a rank of a broken group must not hang


def _spawn(target, world, tmp_path, *args):
    mp.spawn(
        _entry, args=(world, _free_port(), target, str(tmp_path), args), nprocs=world, join=True
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _suite(rank, world, parts):
    """Several workers in one spawn (each spawn costs seconds of process start-up)."""
    out = {}
    for name, *args in parts:  # a worker run twice is keyed name@its-last-argument the 2nd time
        out[f"{name}@{args[-1]}" if name in out else name] = globals()[name](rank, world, *args)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(
        _suite,
        2,
        tmp_path_factory.mktemp("two"),
        [
            ("_mismatch_worker",),
            ("_agreement_worker", "FULL_AND_PIECEWISE", 300),
            ("_agreement_worker", "FULL_AND_PIECEWISE", 100, "all_reduce"),
            ("_runner_worker", "FULL", 30),
            ("_comm_worker",),
        ],
    )


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _spawn(
        _suite,
        4,
        tmp_path_factory.mktemp("four"),
        [
            ("_agreement_worker", "FULL_AND_PIECEWISE", 300),
            ("_agreement_worker", "FULL_AND_PIECEWISE", 100, "all_gather"),
            ("_runner_worker", "FULL_DECODE_ONLY", 16),
        ],
    )


def _plan(mode="FULL", timeout=30, dp=2, **ub):
    return {
        "version": 1,
        "name": "dp-test",
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 64},
        "cudagraph": {
            "mode": mode,
            "attention_support": "ALWAYS",
            "capture_sizes": [1, 2, 4, 8, 16, 24, 32, 48],
        },
        "parallel": {
            "data_parallel_size": dp,
            "sync_timeout_s": timeout,
            "ubatch": {
                "enabled": True,
                "decode_token_threshold": 8,
                "prefill_token_threshold": 24,
                **ub,
            },
        },
    }


def _random_batch(rng: random.Random):
    """(kind, requests' token counts) near the thresholds (decode 8, prefill 24), above the
    largest capture size (48), or idle."""
    kind = rng.choice(["idle", "decode", "decode", "mixed", "mixed", "big"])
    if kind == "idle":
        return kind, []
    if kind == "big":
        return kind, [16, 16, 16, rng.randint(1, 16)]
    if kind == "decode":
        return kind, [1] * rng.choice([1, 3, 7, 8, 9, 12, 15, 16])
    lens = [rng.randint(1, 9) for _ in range(rng.randint(2, 6))]
    return kind, lens


def _agreement_worker(rank, world, mode, steps, exchange="auto"):
    table = compile_plan(_plan(mode, dp=world))
    coord = DPCoordinator.for_table(table)
    if exchange != "auto":
        coord = DPCoordinator(coord.group, timeout_s=30, exchange=exchange)
    assert coord.exchange == ("p2p" if exchange == "auto" else exchange)
    out = []
    for s in range(steps):  # every rank draws every rank's batch: all know the expected matrix
        rng = random.Random(1000 * s + 7)
        cols = []
        for _r in range(world):
            kind, lens = _random_batch(rng)
            n = sum(lens)
            route = table.route(n, len(lens), max(lens)) if n else None
            cols.append(contribution(n, route))
        if s % 2:  # started early, collected after other work (what DPRunner.prepare does)
            coord.start(*cols[rank])
            time.sleep(rng.random() * 1e-3)
            d = coord.finish()
        else:
            d = coord.sync(*cols[rank])
        expected = agree(list(zip(*cols)), 2)
        assert d == expected, (s, d, expected)
        out.append([int(d.mode), d.ubatch, d.pad_to, d.ubatch_aborted])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_reaches_the_decision_of_the_pure_function_over_random_steps(request, world):
    ranks = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")
    per_rank = [r["_agreement_worker"] for r in ranks]
    assert all(r == per_rank[0] for r in per_rank)
    other = "all_gather" if world == 4 else "all_reduce"  # the other exchanges agree the same
    assert all(r[f"_agreement_worker@{other}"] == per_rank[0][:100] for r in ranks)
    flags = {(m, u, a) for m, u, _, a in per_rank[0]}
    assert {True, False} <= {u for _, u, _ in flags} and any(a for *_, a in flags)
    assert {0, 1, 2} <= {m for m, _, _ in flags}  # NONE, PIECEWISE and FULL all occurred


def _tiny(device="cpu"):
    from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig

    cfg = TinyLlamaConfig(
        vocab_size=128,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=96,
        max_model_len=32,
        num_cache_rows=16,
    )
    return TinyLlama(cfg, seed=0, device=device), TinyLlama(cfg, seed=0, device=device)


def _runner_worker(rank, world, mode, steps):
    from graphplan.models.tiny_llama import make_batch, static_inputs

    model, ref = _tiny()
    table = compile_plan(_plan(mode, dp=world))
    dp = DPRunner(GraphRunner(model, table, static_inputs(model), progress=False))
    dp.capture(("FULL",))
    rng, pos = random.Random(rank * 31 + 5), [0] * 16
    log = []
    for s in range(steps):
        kind, lens = _random_batch(rng)
        if s % 3 == 1:  # announced ahead, as a scheduler running one step ahead does
            dp.prepare(sum(lens), len(lens), max(lens)) if lens else dp.prepare()
        if kind == "idle":
            assert dp.step(None) is None
            log.append([list(dp.last_decision.num_tokens), list(IDLE), None])
            continue
        reqs = []
        for row, q in enumerate(lens):
            if pos[row] + q > 31:
                pos[row] = 0
            reqs.append((row, pos[row], [rng.randrange(1, 128) for _ in range(q)]))
            pos[row] += q
        batch = make_batch(model, reqs)
        n = sum(lens)
        out = dp.step(batch, len(lens), max(lens)).clone()
        expected = ref(**{k: v.clone() for k, v in batch.items()})
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # ubatched == plain
        route = table.route(n, len(lens), max(lens))
        log.append(
            [
                list(dp.last_decision.num_tokens),
                list(contribution(n, route)),
                int(dp.last_decision.ubatch),
            ]
        )
    stats = dp.stats()
    return {
        "log": log,
        "dp": stats["dp"],
        "replays": stats["replays_by_mode"],
        "ubatched_replays": sum(g["replays"] for g in stats["graphs"] if g["num_ubatches"] > 1),
    }


@pytest.mark.parametrize("world", [2, 4])  # FULL with 2 ranks, FULL_DECODE_ONLY with 4
def test_dp_runner_ranks_agree_and_ubatched_outputs_equal_eager(request, world):
    ranks = [
        r["_runner_worker"]
        for r in request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")
    ]
    for s in range(len(ranks[0]["log"])):
        cols = [r["log"][s][1] for r in ranks]
        d = agree(list(zip(*cols)), 2)
        assert all(r["log"][s][0] == list(d.num_tokens) for r in ranks)
        assert all(r["log"][s][2] in (None, int(d.ubatch)) for r in ranks)
    assert all(r["dp"]["steps"] == len(r["log"]) for r in ranks)
    if world == 2:  # ubatched graph replays and eager micro-batches both happened
        assert sum(r["ubatched_replays"] for r in ranks) > 0
        assert sum(r["dp"]["ubatched_steps"] for r in ranks) > sum(
            r["ubatched_replays"] for r in ranks
        )
        assert sum(r["dp"]["dummy_steps"] for r in ranks) > 0


def _comm_worker(rank, world):
    from graphplan.models.comm_model import CommMLP, dense_reference, static_inputs

    dims = dict(vocab=64, hidden=32, intermediate=64, layers=3)
    model = CommMLP(**dims)
    plans = [
        _plan("FULL", dp=world, decode_token_threshold=16),
        {**_plan("FULL", dp=world), "parallel": {"data_parallel_size": world}},
    ]
    for p in plans:
        p["scheduler"]["max_num_seqs"] = 64
    on, off = (
        DPRunner(GraphRunner(model, compile_plan(p), static_inputs(), progress=False))
        for p in plans
    )
    on.capture(("FULL",))
    off.capture(("FULL",))
    rng = random.Random(3)
    ubatched = 0
    for step in range(16):
        n = rng.choice([5, 16, 17, 30, 40, 48])  # same n on every rank: collectives match
        same = step % 4 == 0  # identical tokens on every rank: tensor parallel == dense
        seed = step + (0 if same else 100 * rank)
        ids = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))
        a = on.step({"input_ids": ids}, n, 1).clone()
        ubatched += on.last_decision.ubatch
        b = off.step({"input_ids": ids}, n, 1).clone()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        if same:
            torch.testing.assert_close(a, dense_reference(ids, **dims), rtol=1e-4, atol=1e-4)
    return {"ubatched": ubatched}


def test_ubatched_comm_model_equals_plain_and_the_dense_model(two_ranks):
    ranks = [r["_comm_worker"] for r in two_ranks]
    assert ranks[0]["ubatched"] == ranks[1]["ubatched"] > 0


def _mismatch_worker(rank, world):
    from graphplan.models.tiny_llama import static_inputs

    model, _ = _tiny()
    plan = _plan(dp=world)
    plan["scheduler"]["max_num_seqs"] = 16 - rank  # rank 1 compiled another plan
    table = compile_plan(plan)
    t0 = time.monotonic()
    try:
        DPRunner(GraphRunner(model, table, static_inputs(model), progress=False))
    except DPError as e:
        return {
            "error": str(e),
            "seconds": time.monotonic() - t0,
            "fingerprint": table.content_fingerprint,
        }
    return {"error": None, "fingerprint": table.content_fingerprint}


def test_fingerprint_mismatch_fails_fast_on_every_rank_naming_both(two_ranks):
    ranks = [r["_mismatch_worker"] for r in two_ranks]
    fps = [r["fingerprint"] for r in ranks]
    for me, r in enumerate(ranks):
        assert r["error"] and "fingerprint mismatch" in r["error"], r
        mine, theirs = fps[me][:23], fps[1 - me][:23]
        assert f"rank {me} runs table {mine}..., rank {1 - me} runs {theirs}..." in r["error"]
        assert r["seconds"] < 10


def _stall_worker(rank, world, how):
    coord = DPCoordinator.for_table(compile_plan(_plan(timeout=1.0, dp=world)))
    for _ in range(3):
        coord.sync(8, 8, 1, 2)
    if rank == 1:
        if how == "dies":
            os._exit(0)
        time.sleep(3.0)  # stalls past the others' timeout, then leaves without stepping
        return {}
    t0 = time.monotonic()
    try:
        coord.sync(8, 8, 1, 2)
    except DPError as e:
        return {"error": str(e), "type": type(e).__name__, "seconds": time.monotonic() - t0}
    return {"error": None}


def test_a_stalled_rank_is_a_clear_timeout_error_not_a_hang(tmp_path):
    r0 = _spawn(_stall_worker, 2, tmp_path, "stalls")[0]
    assert r0["type"] == DPTimeoutError.__name__
    assert "within parallel.sync_timeout_s=1 s" in r0["error"] and "step 4" in r0["error"]
    assert 0.9 < r0["seconds"] < 5


def test_a_dead_rank_is_an_error_within_the_timeout(tmp_path):
    (tmp_path / "rank1.json").write_text("{}")  # rank 1 dies before writing its own
    r0 = _spawn(_stall_worker, 2, tmp_path, "dies")[0]
    assert r0["error"] and r0["seconds"] < 5
    assert "DP rank 0/2" in r0["error"]


def test_dp_generate_example_gives_each_rank_its_eager_tokens_in_whole_lines():
    """examples/dp_generate.py --dbo --check on 2 ranks: each rank's tokens equal a single-rank
    eager run, micro-batched steps happened, and every line is one rank's whole line (the ranks
    share stdout), never two run together."""
    import subprocess

    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "examples" / "dp_generate.py"),
            "--ranks",
            "2",
            "--device",
            "cpu",
            "--new-tokens",
            "3",
            "--dbo",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 4, out.stdout
    import re

    assert all(
        re.match(r"rank \d: ", ln) and len(re.findall(r"rank \d: ", ln)) == 1 for ln in lines
    ), out.stdout
    assert sum("check tokens == single-rank eager" in ln for ln in lines) == 2
    ubatched = [int(m) for m in re.findall(r"ubatched (\d+)", out.stdout)]
    assert len(ubatched) == 2 and min(ubatched) > 0, out.stdout
