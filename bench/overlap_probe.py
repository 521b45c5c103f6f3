"""Can a GEMM chain and an NCCL all-reduce run at once on this GPU? Measured inside CUDA graphs.

    python bench/overlap_probe.py --ranks 2 --out bench/results/overlap_probe.md

For each shape (tokens M, hidden H, intermediate I per rank) and each configuration (cuBLASLt SM
carveout for the matmuls, NCCL ``max_ctas`` for the communicator) it times three graphs of L layers:
the MLP alone (x@up -> SiLU -> @down -> +x), the all-reduce of an [M, H] tensor alone, and both on
two streams with no dependency between them. ``overlap`` = (mlp + comm - both) / min(mlp, comm):
1.0 is perfect concurrency, 0 is none (negative: running together costs more than in turn). This is
what DBO's two-ubatch schedule can gain at most; bench/dbo_bench.py measures the real schedule.

GPU only: its results need 2 or more CUDA GPUs (NCCL).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from ranks import spawn_ranks
from timing import graph_time_per_call, publish


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def _worker(rank: int, world: int, a, out_dir: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        init_method=a.init,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
        device_id=dev,
    )
    groups = {}
    for ctas in a.ctas:
        opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        if ctas:
            opts.config.max_ctas = ctas
            opts.config.min_ctas = min(ctas, 4)
        groups[ctas] = dist.new_group(list(range(world)), backend="nccl", pg_options=opts)
        warm = torch.ones(8, device=dev)
        dist.all_reduce(warm, group=groups[ctas])
    torch.backends.cuda.preferred_blas_library(a.blas)
    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
    dt, H, L = torch.bfloat16, a.hidden, a.layers
    side = torch.cuda.Stream(priority=-1)
    rows = []
    for M in a.tokens:
        xs = torch.randn(M, H, device=dev, dtype=dt)
        ys = torch.randn(M, H, device=dev, dtype=dt)
        comm = {}
        for ctas, g in groups.items():
            comm[ctas] = 1e6 * graph_time_per_call(
                lambda g=g: [dist.all_reduce(ys, group=g) for _ in range(L)], dev, a.reps
            )
        for inter in a.inter:
            up = torch.randn(H, inter, device=dev, dtype=dt) * H**-0.5
            down = torch.randn(inter, H, device=dev, dtype=dt) * inter**-0.5

            def mlp():
                x = xs
                for _ in range(L):
                    x = x + torch.nn.functional.silu(x @ up) @ down
                return x

            for sms in a.sms:
                if sms and carve is None:
                    continue
                if carve is not None:
                    carve(sms)
                comp = 1e6 * graph_time_per_call(mlp, dev, a.reps)
                for ctas, g in groups.items():

                    def both(g=g):
                        main = torch.cuda.current_stream()
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            for _ in range(L):
                                dist.all_reduce(ys, group=g)
                        mlp()
                        main.wait_stream(side)

                    t = 1e6 * graph_time_per_call(both, dev, a.reps)
                    rows.append(
                        {
                            "M": M,
                            "I": inter,
                            "sms": sms,
                            "ctas": ctas,
                            "mlp": comp,
                            "comm": comm[ctas],
                            "both": t,
                        }
                    )
                if carve is not None:
                    carve(0)
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {"rows": rows, "device": torch.cuda.get_device_name(dev), "carveout": carve is not None}
        )
    )
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=_ints, default=[256, 512, 1024, 2048], help="M per ubatch")
    p.add_argument("--inter", type=_ints, default=[1024, 2048, 4096], help="I per rank")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sms", type=_ints, default=[0, 16, 32], help="cuBLASLt SM carveouts")
    p.add_argument("--ctas", type=_ints, default=[0, 4, 8, 16], help="NCCL max_ctas (0: NCCL's)")
    p.add_argument("--blas", default="cublaslt", choices=("cublas", "cublaslt"))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if torch.cuda.device_count() < a.ranks:
        print(f"overlap_probe: needs {a.ranks} GPUs", file=sys.stderr)
        return 2
    ranks = spawn_ranks(_worker, a.ranks, a)
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"# GEMM chain vs NCCL all-reduce concurrency, {a.ranks} ranks, {ranks[0]['device']}",
        "",
        f"{now:%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {a.blas}, carveout switch "
        f"{'present' if ranks[0]['carveout'] else 'absent'}; hidden {a.hidden}, {a.layers} "
        f"layers per graph; `python bench/overlap_probe.py {' '.join(argv)}`",
        "",
        "| M | I | carveout SMs | NCCL max_ctas | mlp us | all-reduce us | both us | "
        "sum/both | overlap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(ranks[0]["rows"]):
        mlp, comm, both = (max(x["rows"][i][k] for x in ranks) for k in ("mlp", "comm", "both"))
        ov = (mlp + comm - both) / min(mlp, comm)
        lines.append(
            f"| {r['M']} | {r['I']} | {r['sms']} | {r['ctas'] or 'default'} | "
            f"{mlp:.0f} | {comm:.0f} | {both:.0f} | {(mlp + comm) / both:.2f} | "
            f"{ov:.2f} |"
        )
    publish("\n".join(lines), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
