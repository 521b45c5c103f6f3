"""DP agreement and DBO on 2 GPUs over NCCL: agreement, ubatched graph capture and replay == eager.

Needs >= 2 CUDA devices (skips cleanly otherwise). NVLink multicast stays off in every process.
"""

import datetime
import json
import os
import random
import socket
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 GPUs"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, target, out_dir, args):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
        device_id=torch.device("cuda", rank),
    )
    result = target(rank, world, *args)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no teardown: a timed-out NCCL collective never completes


def _spawn(target, tmp_path, *args, world=2):
    import torch.multiprocessing as mp

    from ranks import multicast_off

    multicast_off()
    mp.spawn(
        _entry, args=(world, _free_port(), target, str(tmp_path), args), nprocs=world, join=True
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _plan(dp=2, timeout=60, **ub):
    return {
        "version": 1,
        "name": "dp-gpu",
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 256},
        "cudagraph": {
            "mode": "FULL_DECODE_ONLY",
            "attention_support": "UNIFORM_BATCH",
            "splitting_ops": [],
            "capture_sizes": [8, 16, 32, 48, 64, 128, 256],
        },
        "parallel": {
            "data_parallel_size": dp,
            "backend": "nccl",
            "sync_timeout_s": timeout,
            "ubatch": {"enabled": True, "decode_token_threshold": 32, **ub},
        },
    }


def _agreement_worker(rank, world):
    from graphplan.compiler import compile_plan
    from graphplan.runtime.dp.agreement import DPCoordinator, agree, contribution

    table = compile_plan(_plan(world))
    coord = DPCoordinator.for_table(table)  # backend nccl: the tensor lives on the GPU
    assert coord.backend == "nccl" and coord.device.type == "cuda"
    coord.check_fingerprint(table.fingerprint)
    out = []
    for s in range(200):
        rng = random.Random(s)
        cols = []
        for _ in range(world):
            n = rng.choice([0, 1, 7, 31, 32, 33, 64, 100, 256])
            r = rng.choice([n, max(n // 4, 1)]) if n else 0
            cols.append(contribution(n, table.route(n, r, -(-n // r)) if n else None))
        if s % 2:  # started, then collected (the NCCL exchange queues; finish waits)
            coord.start(*cols[rank])
            d = coord.finish()
        else:
            d = coord.sync(*cols[rank])
        assert d == agree(list(zip(*cols)), 2), s
        out.append([int(d.mode), d.ubatch, d.pad_to])
    return out


def test_nccl_agreement_equals_the_pure_function_on_every_rank(tmp_path):
    ranks = _spawn(_agreement_worker, tmp_path)
    assert ranks[0] == ranks[1] and any(u for _, u, _ in ranks[0])


def _graph_worker(rank, world):
    from graphplan.compiler import compile_plan
    from graphplan.models.comm_model import CommMLP, static_inputs
    from graphplan.runtime import GraphRunner
    from graphplan.runtime.dp.runner import DPRunner

    model = CommMLP(
        vocab=1024, hidden=512, intermediate=2048, layers=4, device="cuda", dtype=torch.bfloat16
    )
    dp = DPRunner(GraphRunner(model, compile_plan(_plan(world)), static_inputs(), progress=False))
    summary = dp.capture(("FULL",))
    worst, ubatched = 0.0, 0
    for step, n in enumerate([8, 30, 32, 40, 64, 100, 128, 200, 256, 33]):
        if step % 2:  # announced ahead (DPRunner.prepare), then stepped
            dp.prepare(n, n, 1)
        ids = torch.randint(
            0,
            1024,
            (n,),
            device="cuda",
            generator=torch.Generator("cuda").manual_seed(100 * rank + step),
        )
        out = dp.step({"input_ids": ids}, n, 1).clone()
        ubatched += dp.last_decision.ubatch
        with torch.no_grad():
            ref = model(ids)  # eager, collectives inline: same order on both ranks
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
    s = dp.stats()
    ub_replays = sum(g["replays"] for g in s["graphs"] if g["num_ubatches"] > 1)
    return {
        "graphs": summary["graphs"],
        "ubatched": ubatched,
        "ubatched_replays": ub_replays,
        "eager": s["eager_steps"],
        "worst": worst,
    }


def test_ubatched_graphs_with_nccl_inside_capture_and_replay_equal_eager(tmp_path):
    ranks = _spawn(_graph_worker, tmp_path)
    for r in ranks:
        assert r["graphs"] == 12  # 7 plain + 5 ubatched (>= 32 tokens)
        assert r["ubatched"] == r["ubatched_replays"] > 0 and r["eager"] == {}, r


def _tiny_dp(world: int, device: str):
    """The tiny Llama under a DPRunner with DBO on (examples/dp_generate.py's set-up), FULL only."""
    from graphplan.compiler import compile_plan
    from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, static_inputs
    from graphplan.runtime import GraphRunner
    from graphplan.runtime.dp import DPRunner

    table = compile_plan(
        ROOT / "plans" / "tiny-llama.yaml",
        {
            "parallel.data_parallel_size": world,
            "scheduler.max_num_seqs": 32,
            "scheduler.max_num_batched_tokens": 512,
            "parallel.ubatch.enabled": True,
            "parallel.ubatch.decode_token_threshold": 8,
            "parallel.ubatch.prefill_token_threshold": 64,
        },
    )
    cfg = TinyLlamaConfig(
        layers=2,
        hidden=256,
        heads=4,
        kv_heads=1,
        intermediate=768,
        vocab_size=2048,
        max_model_len=128,
        num_cache_rows=table.max_num_seqs,
    )
    model = TinyLlama(cfg, seed=0, device=device, dtype=torch.bfloat16)
    dp = DPRunner(GraphRunner(model, table, static_inputs(model), device=device, progress=False))
    dp.capture(("FULL",))
    return model, dp


def _tiny_worker(rank, world):

    from graphplan.models.tiny_llama import make_batch

    model, dp = _tiny_dp(world, f"cuda:{rank}")
    worst, ubatched = 0.0, 0
    for step, n in enumerate([12, 20, 32, 17, 24]):
        batch = make_batch(
            model, [(row, 3 + row % 5, [1 + (row * 13 + step) % 2000]) for row in range(n)]
        )
        out = dp.step(batch, n, 1).clone()
        ubatched += dp.last_decision.ubatch
        with torch.no_grad():
            ref = model(**batch)
        torch.testing.assert_close(out, ref, rtol=5e-2, atol=5e-2)  # bf16, other GEMM shapes
        worst = max(worst, (out - ref).abs().max().item())
    return {"ubatched": ubatched, "worst": worst}


def test_tiny_llama_dbo_graph_replay_matches_eager_in_bf16(tmp_path):
    ranks = _spawn(_tiny_worker, tmp_path)
    assert all(r["ubatched"] > 0 for r in ranks)


def _stall_worker(rank, world):
    from graphplan.compiler import compile_plan
    from graphplan.runtime.dp.agreement import DPCoordinator, DPTimeoutError

    coord = DPCoordinator.for_table(compile_plan(_plan(world, timeout=2)))
    coord.sync(8, 8, 0, 2)
    if rank == 1:
        time.sleep(5)  # never steps again
        return {}
    t0 = time.monotonic()
    try:
        coord.sync(8, 8, 0, 2)
    except DPTimeoutError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None}


def test_a_stalled_rank_over_nccl_is_a_timeout_error(tmp_path):
    r0 = _spawn(_stall_worker, tmp_path)[0]
    assert r0["error"] and "sync_timeout_s=2 s" in r0["error"] and 1.9 < r0["seconds"] < 4
