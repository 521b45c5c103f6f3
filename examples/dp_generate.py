"""Greedy generation with the tiny Llama on several data-parallel ranks, each with its own requests.

    python examples/dp_generate.py --ranks 2 --check            # CPU: Gloo, graph stand-in
    python examples/dp_generate.py --ranks 2 --dbo --check      # micro-batch steps of 8+ tokens
    torchrun --nproc-per-node 2 examples/dp_generate.py --check  # one process per GPU

Every rank compiles the same plan (plans/tiny-llama.yaml with data_parallel_size = ranks), so the
start-up fingerprint check passes, builds the model and a DPRunner, and steps in lockstep: rank r
has its own prompts and token budget, and keeps stepping with no batch (a dummy batch of the agreed
size) once it is done, until every rank is. ``--check`` compares each rank's tokens with a
single-rank eager run of the same requests.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket
import sys
from pathlib import Path

import torch

from graphplan.models.tiny_llama import (
    TinyLlama,
    TinyLlamaConfig,
    reference_generate,
    static_inputs,
)
from graphplan.server.core.generation import dp_generate

ROOT = Path(__file__).resolve().parents[1]

PLAN = ROOT / "plans" / "tiny-llama.yaml"


def workload(rank: int, ranks: int, seed: int, new_tokens: int) -> tuple[list[list[int]], int]:
    """Rank r's prompts and token budget: different counts and lengths per rank; with 3+ ranks the
    last rank has no requests at all (it only runs dummy batches)."""
    if ranks >= 3 and rank == ranks - 1:
        return [], 0
    rng = random.Random(seed * 1000 + rank)
    prompts = [
        [rng.randrange(1, 2048) for _ in range(rng.randint(1, 20))] for _ in range(10 + 4 * rank)
    ]
    return prompts, new_tokens + 3 * rank


def build(ranks: int, device: str, dbo: bool, seed: int = 0, modes: tuple[str, ...] | None = None):
    from graphplan.compiler import compile_plan
    from graphplan.runtime import GraphRunner
    from graphplan.runtime.dp.runner import DPRunner

    overrides = {
        "parallel.data_parallel_size": ranks,
        "scheduler.max_num_seqs": 32,
        "scheduler.max_num_batched_tokens": 512,
    }
    if dbo:
        overrides.update(
            {
                "parallel.ubatch.enabled": True,
                "parallel.ubatch.decode_token_threshold": 8,
                "parallel.ubatch.prefill_token_threshold": 64,
            }
        )
    table = compile_plan(PLAN, overrides)
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
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = TinyLlama(cfg, seed=seed, device=device, dtype=dtype)
    runner = GraphRunner(model, table, static_inputs(model), device=device, progress=False)
    dp = DPRunner(runner)  # checks every rank's table fingerprint
    dp.capture(modes)
    return model, dp


def run_rank(rank: int, ranks: int, args) -> int:
    import torch.distributed as dist

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "gloo",
        init_method=args.init,
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=120),
    )
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    model, dp = build(ranks, device, args.dbo, args.seed)
    work = [workload(r, ranks, args.seed, args.new_tokens) for r in range(ranks)]
    prompts, budget = work[rank]
    out = dp_generate(model, dp, prompts, budget, steps=max(b for _, b in work))
    s = dp.stats()
    say(
        f"rank {rank}: {len(prompts)} prompts x {budget} tokens; steps {s['dp']['steps']}, "
        f"dummy {s['dp']['dummy_steps']}, ubatched {s['dp']['ubatched_steps']}, replays "
        f"{s['replays_by_mode']}, eager {s['eager_steps']}"
    )
    status = 0
    if args.check:
        model.kv_cache.zero_()
        eager = reference_generate(model, prompts, budget) if prompts else []
        ok = eager == out
        say(f"rank {rank}: check {'tokens == single-rank eager' if ok else 'MISMATCH'}")
        status = 0 if ok else 1
    dist.destroy_process_group()
    return status


def say(line: str) -> None:
    """One line in one write: the ranks share stdout, and print() writes the text and its newline
    separately, so two ranks' lines could run together."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def _spawned(rank: int, ranks: int, args) -> None:
    if run_rank(rank, ranks, args):
        raise SystemExit(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Tiny Llama on several DP ranks through DPRunner.")
    p.add_argument(
        "--ranks", type=int, default=2, help="processes to spawn (ignored under torchrun)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dbo", action="store_true", help="micro-batch steps of 8+ decode tokens")
    p.add_argument("--check", action="store_true", help="compare with single-rank eager")
    a = p.parse_args(argv)
    if "RANK" in os.environ:  # torchrun
        a.init = "env://"
        return run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        a.init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    import torch.multiprocessing as mp

    try:
        mp.spawn(_spawned, args=(a.ranks, a), nprocs=a.ranks, join=True)
    except mp.ProcessRaisedException as e:
        print(f"dp_generate: a rank failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"dp_generate: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
