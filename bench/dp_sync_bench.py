"""DP agreement overhead per step on a CPU (Gloo) group: the all-reduce of the [4, dp_size] tensor,
the agreement and the re-dispatch, against a bare Gloo all-reduce of the same tensor.

    python bench/dp_sync_bench.py [--ranks 2] [--steps 5000] [--out bench/results/dp_sync.md]

Bar: the median DP step overhead (sync + re-route) <= 100 us. Means are printed too: on a shared
or oversubscribed machine they carry the scheduler's outliers (a rank descheduled mid-step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BAR_US = 100.0


def _stats(ts: list[float]) -> dict:
    ts = sorted(ts)
    n = len(ts)
    return {"mean": sum(ts) / n * 1e6, "p50": ts[n // 2] * 1e6, "p90": ts[int(n * 0.9)] * 1e6,
            "p99": ts[min(n - 1, int(n * 0.99))] * 1e6}


def _worker(rank: int, world: int, port: int, steps: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from compiler import compile_plan
    from runtime.dp import DPCoordinator, contribution
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    table = compile_plan(ROOT / "plans" / "deepseek-v3-dp8-dbo.yaml",
                         {"parallel.data_parallel_size": world, "parallel.backend": "gloo"})
    coord = DPCoordinator.for_table(table)
    coord.check_fingerprint(table.fingerprint)
    rng = random.Random(rank)
    batches = []  # (n, reqs, max_query_len): decode and mixed steps of every size class
    for _ in range(steps):
        if rng.random() < 0.7:
            r = rng.randint(1, 256)
            batches.append((2 * r, r, 2))
        else:
            r = rng.randint(1, 64)
            batches.append((r + rng.randint(0, 4000), r, None))
    raw = torch.zeros(4, world, dtype=torch.int32)
    pg = coord.group
    timings = {"gloo_allreduce": [], "dp_sync": [], "re_route": [], "dp_step_overhead": []}
    for phase in ("warm", "timed"):
        dist.barrier()
        for n, r, mql in batches if phase == "timed" else batches[:500]:
            t0 = time.perf_counter()
            pg.allreduce([raw]).wait()
            t1 = time.perf_counter()
            route = table.route(n, r, mql)
            t2 = time.perf_counter()
            d = coord.sync(*contribution(n, route))
            t3 = time.perf_counter()
            table.route(n, r, mql, allow=d.mode, pad_to=d.pad_to, ubatched=d.ubatch)
            t4 = time.perf_counter()
            if phase == "timed":
                timings["gloo_allreduce"].append(t1 - t0)
                timings["dp_sync"].append(t3 - t2)
                timings["re_route"].append(t4 - t3)
                timings["dp_step_overhead"].append(t4 - t2)
    # graphplan's own work per step without the collective: pack, agree, route, re-route
    solo = DPCoordinator.__new__(DPCoordinator)  # the same coordinator as a DP group of one
    solo.__dict__.update(coord.__dict__, size=1, rank=0)
    logic = []
    for n, r, mql in batches:
        t0 = time.perf_counter()
        route = table.route(n, r, mql)
        d = solo.sync(*contribution(n, route))
        table.route(n, r, mql, allow=d.mode, pad_to=d.pad_to, ubatched=d.ubatch)
        logic.append(time.perf_counter() - t0)
    timings["dp_logic_no_comm"] = logic
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({k: _stats(v) for k, v in timings.items()}))
    dist.barrier()
    os._exit(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--out", help="also write the table (markdown) here")
    a = p.parse_args(argv)
    import tempfile

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(a.ranks, port, a.steps, tmp), nprocs=a.ranks, join=True)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(a.ranks)]
    lines = [f"# DP agreement overhead, CPU Gloo, {a.ranks} ranks, {a.steps} steps",
             "", f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
             f"`python bench/dp_sync_bench.py --ranks {a.ranks} --steps {a.steps}`", "",
             "| rank | what | mean us | p50 us | p90 us | p99 us |", "|---|---|---|---|---|---|"]
    for r, st in enumerate(per_rank):
        for what, v in st.items():
            lines.append(f"| {r} | {what} | {v['mean']:.1f} | {v['p50']:.1f} | {v['p90']:.1f} | "
                         f"{v['p99']:.1f} |")
    worst = max(st["dp_step_overhead"]["p50"] for st in per_rank)
    base = max(st["gloo_allreduce"]["p50"] for st in per_rank)
    mean = max(st["dp_step_overhead"]["mean"] for st in per_rank)
    verdict = "PASS" if worst <= BAR_US else "FAIL"
    lines += ["", f"DP step overhead (sync + re-route), median over steps, worst rank: {worst:.1f} us "
              f"(mean {mean:.1f} us); bare Gloo all-reduce median {base:.1f} us "
              f"(ratio {worst / base:.2f}x; graphplan's own part {worst - base:.1f} us). "
              f"Bar <= {BAR_US:.0f} us: {verdict}"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
