"""NCCL all-reduce against torch's symmetric-memory all-reduces (one-shot, two-shot) for the
decode-sized bf16 messages of a tensor-parallel step (a [tokens, hidden] activation: 8 KiB to
8 MiB), each captured ``--calls`` times in one CUDA graph and timed by replay. GPU only:
``--ranks`` GPUs of one host (NVLink multicast off: bench/gpu_session.sh sets NCCL_NVLS_ENABLE=0
and TORCH_SYMM_MEM_DISABLE_MULTICAST=1). Prints one row per size with the fastest method; the
per-size choice of models/hf/tp_symm.py follows it (bench/results/allreduce_bench.md).

    python bench/allreduce_bench.py --ranks 2 --out allreduce_tp2.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch

SIZES_KIB = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
METHODS = ("nccl", "symm_one_shot", "symm_two_shot")


def _op(method: str, x, group):
    import torch.distributed as dist

    if method == "nccl":
        return lambda: dist.all_reduce(x, group=group)
    name = group.group_name
    if method == "symm_one_shot":
        return lambda: x.copy_(torch.ops.symm_mem.one_shot_all_reduce(x, "sum", name))
    return lambda: torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", name)


def _graph_us(fn, calls: int, iters: int) -> float:
    """Microseconds per call: ``calls`` calls captured in one graph, replayed ``iters`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (iters * calls)


def _rank(rank: int, world: int, port: int, a, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
        device_id=torch.device("cuda", rank),
    )
    group = dist.group.WORLD
    rows = []
    for kib in a.sizes:
        n = kib * 1024 // 2
        row: dict = {"kib": kib}
        for method in METHODS:
            try:
                if method == "nccl":
                    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
                else:
                    import torch.distributed._symmetric_memory as symm_mem

                    x = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
                    symm_mem.rendezvous(x, group.group_name)
                    x.fill_(1)
                us = _graph_us(_op(method, x, group), a.calls, a.iters)
                t = torch.tensor([us], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank is the step's
                row[method] = round(t.item(), 2)
            except Exception as e:  # a method this build or topology lacks: say so, go on
                row[method] = f"n/a ({type(e).__name__})"
        rows.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    os._exit(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default=",".join(map(str, SIZES_KIB)), help="KiB, comma-separated")
    p.add_argument("--calls", type=int, default=20, help="all-reduces captured per graph")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", help="markdown table to write")
    a = p.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",") if s]
    if torch.cuda.device_count() < a.ranks:
        print(f"needs {a.ranks} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = Path(tempfile.mkdtemp()) / "rows.json"
    mp.spawn(_rank, args=(a.ranks, port, a, str(res)), nprocs=a.ranks, join=True)
    rows = json.loads(res.read_text())
    lines = [
        f"# all-reduce in CUDA graphs, bf16, {a.ranks} x {torch.cuda.get_device_name(0)}, "
        f"torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
        "",
        "| KiB | " + " | ".join(f"{m} us" for m in METHODS) + " | fastest |",
        "|---:|" + "---:|" * len(METHODS) + "---|",
    ]
    for r in rows:
        timed = {m: r[m] for m in METHODS if isinstance(r[m], (int, float))}
        best = min(timed, key=timed.__getitem__) if timed else "-"
        lines.append(f"| {r['kib']} | " + " | ".join(str(r[m]) for m in METHODS) + f" | {best} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
