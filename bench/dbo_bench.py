"""DBO (two-batch overlap) on vs off for the comm-heavy model, on 2 GPUs over NCCL.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python bench/dbo_bench.py --ranks 2 --out bench/results/dbo_bench.md        # GPUs
    python bench/dbo_bench.py --device cpu --quick                                   # smoke run

Each rank runs models/comm_model.py (a tensor-parallel-style MLP stack, one all-reduce per layer
over NCCL) through a DPRunner: the DP agreement every step (CPU Gloo group, as a server would), then
a graph replay. "off" compiles the plan with ubatching disabled (plain FULL decode graphs); "on"
enables it (ubatched graphs at and above the decode threshold; the plain twins below it). The model's
intermediate size is sized to the link once, before anything is timed: the smallest candidate whose
per-layer compute at the threshold takes at least the all-reduce's time (``--intermediate`` fixes
it), so the benchmark measures overlap rather than a model that is all compute or all comm.

Modes: ``graph`` (captured graphs; NCCL inside CUDA graphs) and ``eager`` (the same schedule, no
graphs; Python launch overhead included). Step time is the mean over timed steps (median of
repeats). Bar: "on" >= 1.15x faster than "off" at every batch at/above the threshold (graph mode; the
eager mode's bar is reported too and used when graph capture fails).

GPU only: its results need 2 or more CUDA GPUs (NCCL); ``--device cpu`` is a smoke run that checks
the program, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch

from ranks import spawn_ranks
from timing import graph_time_per_call, publish, time_per_call

ROOT = Path(__file__).resolve().parents[1]

BAR = 1.15


def _plan(world: int, sizes: list[int], threshold: int, ubatch: bool) -> dict:
    top = max(sizes)
    return {
        "version": 1,
        "name": f"dbo-bench-{'on' if ubatch else 'off'}",
        "scheduler": {"max_num_seqs": top, "max_num_batched_tokens": top},
        "cudagraph": {
            "mode": "FULL_DECODE_ONLY",
            "attention_support": "UNIFORM_BATCH",
            "splitting_ops": [],
            "capture_sizes": sizes,
        },
        "parallel": {
            "data_parallel_size": world,
            "backend": "gloo",
            "sync_timeout_s": 120,
            "ubatch": {
                "enabled": ubatch,
                "num_ubatches": 2,
                "decode_token_threshold": threshold,
                "prefill_token_threshold": max(threshold, 2),
            },
        },
    }


def _calibrate(a, device, dtype, group) -> tuple[int, list]:
    """The intermediate size (per rank) whose layer compute at the threshold is closest to the
    all-reduce's time (DBO hides at most the shorter of the two: it has most to hide when they
    are equal), both timed as CUDA graphs (GPU time: eager timing of a 20 us kernel measures
    its launch)."""
    import torch.distributed as dist

    t, h = a.threshold, a.hidden
    x = torch.randn(t, h, device=device, dtype=dtype)
    y = torch.randn(t, h, device=device, dtype=dtype)
    comm = graph_time_per_call(lambda: dist.all_reduce(y, group=group), device, a.iters)
    rows = []
    for inter in a.candidates:
        up = torch.randn(h, inter, device=device, dtype=dtype) * h**-0.5
        down = torch.randn(inter, h, device=device, dtype=dtype) * inter**-0.5
        comp = graph_time_per_call(
            lambda: x + torch.nn.functional.silu(x @ up) @ down, device, a.iters
        )
        rows.append((inter, comp, comm))
    pick = min(rows, key=lambda r: abs(math.log(r[1] / r[2])))[0]
    vote = torch.tensor([pick], device=device)  # every rank must build the same model
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return int(vote.item()), rows


def _nccl_group(world: int, *, high_priority: bool, max_ctas: int = 0):
    """A NCCL communicator over all ranks; ``max_ctas`` caps the SMs its kernels take (Megatron's
    per-communicator ``max_ctas`` for TP comm overlap)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    if max_ctas:
        opts.config.max_ctas = max_ctas
        opts.config.min_ctas = min(max_ctas, 4)
    return dist.new_group(list(range(world)), backend="nccl", pg_options=opts)


def _worker(rank: int, world: int, a, out_dir: str) -> None:
    import torch.distributed as dist

    from graphplan.compiler import compile_plan
    from graphplan.models.comm_model import CommMLP, static_inputs
    from graphplan.runtime import CaptureError, GraphRunner
    from graphplan.runtime.dp.agreement import DPCoordinator
    from graphplan.runtime.dp.runner import DPRunner

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            init_method=a.init,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=180),
            device_id=device,
        )
        dtype = torch.bfloat16
    else:
        torch.set_num_threads(1)
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group(
            "gloo",
            init_method=a.init,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
    groups = {"off": dist.group.WORLD, "on": dist.group.WORLD}
    if cuda and a.comm_sms:  # the carveout applies to cuBLASLt: use it for both on and off
        torch.backends.cuda.preferred_blas_library("cublaslt")
    if cuda:
        # the model's all-reduces on a high-priority NCCL stream: their kernels are scheduled
        # ahead of the other ubatch's queued GEMM blocks, which is what lets them overlap; "on"
        # may cap the SMs its communicator takes, "off" keeps NCCL's own choice (its best)
        high = a.comm_priority == "high"
        groups["off"] = _nccl_group(world, high_priority=high)
        groups["on"] = (
            _nccl_group(world, high_priority=high, max_ctas=a.comm_ctas)
            if a.comm_ctas
            else groups["off"]
        )
    inter, calib = (
        (a.intermediate, []) if a.intermediate else _calibrate(a, device, dtype, groups["off"])
    )

    def model(group):
        return CommMLP(
            vocab=1024,
            hidden=a.hidden,
            intermediate=inter * world,
            layers=a.layers,
            group=group,
            device=device,
            dtype=dtype,
        )

    models = {"off": model(groups["off"])}  # a second model only for a second communicator
    models["on"] = models["off"] if groups["on"] is groups["off"] else model(groups["on"])
    coord = DPCoordinator(dist.group.WORLD, backend="gloo", timeout_s=120)
    runners, capture_error = {}, None
    for name, ub in (("off", False), ("on", True)):
        # "on" micro-batches from the smallest size up, so the table shows where DBO starts to
        # pay; the bar applies from --threshold (what a plan for this model would set)
        table = compile_plan(_plan(world, a.sizes, min(a.sizes) if ub else a.threshold, ub))
        runners[name] = DPRunner(
            GraphRunner(models[name], table, static_inputs(), device=device, progress=False),
            coord,
            comm_sms=a.comm_sms or None,
        )
    results = []
    for mode in a.modes:
        if mode == "graph":
            try:
                for r in runners.values():
                    r.capture(("FULL",))
            except CaptureError as e:
                capture_error = str(e)
            ok = torch.tensor([capture_error is None], dtype=torch.int32)  # CPU: over Gloo
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not ok.item():  # every rank skips graph mode if any rank could not capture
                capture_error = capture_error or "another rank's capture failed"
                for r in runners.values():
                    r.runner.release()
                continue
        else:
            for r in runners.values():
                r.runner.release()
        for t in a.sizes:
            ids = torch.randint(
                0,
                1024,
                (t,),
                device=device,
                generator=torch.Generator(device=device).manual_seed(rank + t),
            )
            batch = {"input_ids": ids}
            row = {"mode": mode, "tokens": t}
            for name, r in runners.items():
                row[name] = time_per_call(lambda: r.step(batch, t, 1), device, a.iters, a.repeats)
                row[f"{name}_ubatched"] = bool(r.last_decision.ubatch)
            results.append(row)
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "results": results,
                "intermediate": inter,
                "calibration": calib,
                "capture_error": capture_error,
                "device": torch.cuda.get_device_name(device)
                if cuda
                else platform.processor() or "cpu",
            }
        )
    )
    for r in runners.values():  # graphs hold the NCCL communicator: drop them before destroying it
        r.runner.release()
    torch.cuda.synchronize() if cuda else None
    dist.barrier()
    dist.destroy_process_group()


def _report(a, ranks: list[dict]) -> tuple[str, bool]:
    r0 = ranks[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"# DBO on vs off: comm-heavy MLP, {a.ranks} ranks, {a.device}",
        "",
        f"{now:%Y-%m-%d %H:%M} UTC, {r0['device']}, torch {torch.__version__}; "
        f"`python bench/dbo_bench.py {' '.join(a.argv)}`",
        "",
        f"model: hidden {a.hidden}, {a.layers} layers, intermediate {r0['intermediate']} per "
        f"rank, {'bf16' if a.device == 'cuda' else 'fp32'}; 'on' micro-batches every size, "
        f"the bar applies from {a.threshold} tokens; NCCL peer-to-peer {a.nccl_p2p}; model "
        f"NCCL stream priority {a.comm_priority}; 'on': ubatch matmul SM carveout "
        f"{a.comm_sms}, NCCL max_ctas {a.comm_ctas or 'default'}; DP agreement over a CPU "
        "Gloo group every step",
    ]
    if r0["calibration"]:
        lines += [
            "",
            "calibration at the threshold (per layer): "
            + ", ".join(
                f"I={i}: compute {c * 1e6:.1f} us vs all-reduce {m * 1e6:.1f} us"
                for i, c, m in r0["calibration"]
            ),
        ]
    if r0["capture_error"]:
        lines += ["", f"graph capture FAILED, graph rows missing: {r0['capture_error']}"]
    lines += [
        "",
        "| mode | tokens | off us/step | on us/step | on ubatched | speedup | bar |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts: dict[str, list[bool]] = {}
    for i, row in enumerate(r0["results"]):
        off = max(r["results"][i]["off"] for r in ranks)  # the slowest rank sets the step
        on = max(r["results"][i]["on"] for r in ranks)
        speed = off / on
        gated = row["tokens"] >= a.threshold
        ok = speed >= BAR
        if gated:
            verdicts.setdefault(row["mode"], []).append(ok)
        mark = ("PASS" if ok else "FAIL") if gated else "-"
        lines.append(
            f"| {row['mode']} | {row['tokens']} | {off * 1e6:.1f} | {on * 1e6:.1f} | "
            f"{row['on_ubatched']} | {speed:.2f}x | {mark} |"
        )
    mode = "graph" if verdicts.get("graph") else "eager"
    passed = bool(verdicts.get(mode)) and all(verdicts[mode])
    lines += [
        "",
        f"Bar: DBO >= {BAR}x faster at every batch >= {a.threshold} tokens ({mode} mode): "
        f"{'PASS' if passed else 'FAIL'}"
        + (
            ""
            if a.device == "cuda"
            else " (CPU smoke run: no overlap exists on a CPU; the bar is for 2 GPUs)"
        ),
    ]
    speed = {}  # tokens -> speedup, in the verdict's mode
    for i, row in enumerate(r0["results"]):
        if row["mode"] == mode:
            speed[row["tokens"]] = max(r["results"][i]["off"] for r in ranks) / max(
                r["results"][i]["on"] for r in ranks
            )
    for goal, what in ((1.0, "break-even"), (BAR, f"{BAR}x")):
        ok = [t for t in speed if all(v >= goal for u, v in speed.items() if u >= t)]
        lines.append(
            f"DBO {what} from: "
            + (
                f"{min(ok)} tokens (set parallel.ubatch."
                f"decode_token_threshold: {min(ok)} for this model on this machine)"
                if ok
                else "no measured size"
            )
        )
    for m, v in verdicts.items():
        if m != mode:
            lines.append(f"{m} mode: {'PASS' if all(v) else 'FAIL'} ({sum(v)}/{len(v)} sizes)")
    return "\n".join(lines), passed


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[64, 128, 256, 512, 1024, 2048, 4096],
    )
    p.add_argument("--threshold", type=int, default=512, help="ubatch.decode_token_threshold")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=0, help="per rank; 0 = size it to the link")
    p.add_argument(
        "--candidates",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[512, 1024, 1536, 2048, 3072, 4096, 6144, 8192],
    )
    p.add_argument("--modes", type=lambda s: s.split(","), default=["graph", "eager"])
    p.add_argument(
        "--comm-priority",
        choices=("high", "normal"),
        default="high",
        help="stream priority of the model's NCCL collectives",
    )
    p.add_argument(
        "--comm-sms",
        type=int,
        default=0,
        help="SMs that ubatched matmuls leave to NCCL (cuBLASLt carveout; 0 = off)",
    )
    p.add_argument(
        "--comm-ctas",
        type=int,
        default=0,
        help="NCCL max_ctas of the \"on\" model's communicator (0 = NCCL's choice)",
    )
    p.add_argument(
        "--nccl-p2p",
        choices=("on", "off"),
        default="on",
        help="off: NCCL without NVLink peer-to-peer (PCIe + host memory), a slower "
        "link like the inter-node ones DBO is built for",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--out", help="also write the table (markdown) here")
    a = p.parse_args(argv)
    a.argv = argv
    if a.quick:
        a.sizes, a.threshold, a.hidden, a.layers = [8, 16, 32], 16, 64, 3
        a.candidates, a.iters, a.repeats = [64, 128], 3, 2
    if a.device == "cuda" and torch.cuda.device_count() < a.ranks:
        print(
            f"dbo_bench: needs {a.ranks} GPUs, found {torch.cuda.device_count()}", file=sys.stderr
        )
        return 2
    if a.nccl_p2p == "off":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # the spawned ranks inherit it
    ranks = spawn_ranks(_worker, a.ranks, a)
    text, passed = _report(a, ranks)
    publish(text, a.out)
    return 0 if passed or a.device != "cuda" else 1


if __name__ == "__main__":
    sys.exit(main())
