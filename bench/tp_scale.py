"""Decode under tensor parallelism (issue 37): N ranks (one GPU each, NCCL), each building only its
shard of a Llama shape from the config (random weights drawn per rank), the decode graphs
(FULL) captured with the all-reduces inside, beside a TP floor measured in the same run. GPU only:
N GPUs of one host (multicast off, bench/ranks.py).

    python bench/tp_scale.py --tp 2 --shape 8b --tp1 --out tp2.md    # with TP=1 on rank 0's GPU
    python bench/tp_scale.py --tp 4 --shape 70b --out tp4.md
    python bench/tp_scale.py --tp 4 --shape 70b --layers 8            # a quick check

Per batch (context ``--context``, every request at it):
- **step**: ``GraphRunner.step`` of a FULL decode graph on every rank (rank 0's time reported;
  all ranks replay in lockstep);
- **floor**: per rank, real_scale's floor over the rank's shards (every GEMM as ``F.linear``, SDPA
  decode over the rank's KV heads, one CUDA graph), plus **comm**: the step's collectives of
  that size captured in one CUDA graph and replayed (2 all-reduces per layer and the embedding's,
  each ``[batch, hidden]``, and the LM head's all-gather of ``[batch, vocab/N]``); floor = the sum;
- **capture**: the time to capture every decode graph of ``--capture-plan`` (FULL_DECODE_ONLY).
With ``--tp1`` (8B), rank 0 then builds the whole model alone and times its batch-1 step: the
ratio TP step / TP=1 step (bar <= 0.62x). Bars: 70B TP=4 steps <= 1.15x the floor; capture <= 10 s.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from graphplan.models.hf.tp_symm import algo_from_env

from llama_shapes import SHAPES

ROOT = Path(__file__).resolve().parents[1]
FLOOR_BAR = 1.15
TP1_BAR = 0.62
CAPTURE_BAR = 10.0


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a decode step: ``count`` of them, ``elements`` each."""

    op: str
    count: int
    elements: int


def step_collectives(cfg: dict, tp: int, batch: int) -> list[Collective]:
    """The collectives of one decode step of ``batch`` tokens (models/hf/tp.py): after each
    o_proj and down_proj and after the vocabulary-parallel embedding an all-reduce of
    ``[batch, hidden]``; the LM head's all-gather of each rank's ``[batch, ceil(vocab / tp)]``."""
    if tp == 1:
        return []
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    rows = -(-cfg["vocab_size"] // tp)
    return [
        Collective("all_reduce", 2 * layers + 1, batch * hidden),
        Collective("all_gather", 1, batch * rows),
    ]


def verdict(value: float, bar: float) -> str:
    return f"<= {bar}x {'met' if value <= bar else 'MISSED'}"


def shape_of(a) -> dict:
    cfg = dict(SHAPES[a.shape])
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    return cfg


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="ranks (GPUs), one process each")
    p.add_argument("--shape", choices=("8b", "70b", "1b", "tiny"), default="8b")
    p.add_argument("--layers", type=int, help="fewer layers than the shape's (a quick check)")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--capture-plan",
        default=str(ROOT / "plans" / "llama3-8b-h100.yaml"),
        help="the plan whose decode graphs are captured and timed as FULL_DECODE_ONLY ('' skips)",
    )
    p.add_argument(
        "--allreduce",
        choices=("nccl", "symm"),
        default="nccl",
        help="the model's all-reduce: NCCL, or torch symmetric memory (one-shot up to 64 KiB, "
        "two-shot above; GRAPHPLAN_TP_SYMM_ALGO) for messages up to GRAPHPLAN_TP_SYMM_MAX_BYTES "
        "(models/hf/tp_symm.py); comm is timed both ways",
    )
    p.add_argument("--tp1", action="store_true", help="also TP=1 on rank 0's GPU (batch 1)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="also write the report here (markdown)")
    a = p.parse_args(argv)
    try:
        a.batches = sorted({int(x) for x in a.batches.split(",") if x})
    except ValueError:
        p.error(f"--batches {a.batches!r}: a comma-separated list of integers, e.g. 1,64")
    if not a.batches or min(a.batches) < 1:
        p.error("--batches: at least one batch, each >= 1")
    if a.tp < 1:
        p.error(f"--tp {a.tp}: at least 1")
    if a.layers is not None and a.layers < 1:
        p.error(f"--layers {a.layers}: at least 1")
    if a.context < 1 or a.context + 1 >= a.max_model_len:
        p.error(f"--context {a.context}: between 1 and --max-model-len - 2 ({a.max_model_len - 2})")
    from types import SimpleNamespace

    from graphplan.models.hf.errors import TensorParallelError
    from graphplan.models.hf.tp import check_split

    try:
        check_split(SimpleNamespace(**shape_of(a)), a.tp, f"--shape {a.shape}")
    except TensorParallelError as e:
        p.error(str(e))
    return a


def ms(x) -> str:
    return f"{x * 1e3:.3f}" if isinstance(x, float) else str(x)


def report(a, device_name: str, r0: dict) -> tuple[str, bool]:
    """The markdown report from rank 0's results, and whether every bar printed was met."""
    lines = [
        f"# tp_scale ({a.shape}, TP={a.tp}), {device_name}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"command: `python bench/tp_scale.py {shlex.join(sys.argv[1:])}`",
        f"layers {shape_of(a)['num_hidden_layers']}; rank model built in {r0['load_s']:.1f} s; "
        f"context {a.context}; the model's all-reduce: {a.allreduce}"
        f"{'' if r0.get('symm') or a.allreduce == 'nccl' else ' (unavailable: NCCL)'}"
        f"{f' ({algo_from_env()})' if r0.get('symm') else ''}; times are ms per step on "
        "rank 0; floor = GEMMs+SDPA + the lesser comm",
        "",
        "| batch | step | GEMMs+SDPA (rank) | comm NCCL | comm symm | floor | step/floor | bar "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for row in r0["rows"]:
        comms = [c for c in (row["comm"], row.get("comm_symm")) if isinstance(c, float)]
        floor = row["floor"] + min(comms) if isinstance(row["floor"], float) else None
        ratio = row["step"] / floor if floor else None
        bar = ""
        if ratio is not None and a.shape == "70b" and a.tp == 4:
            bar = verdict(ratio, FLOOR_BAR)
            ok &= ratio <= FLOOR_BAR
        lines.append(
            f"| {row['batch']} | {ms(row['step'])} | {ms(row['floor'])} | {ms(row['comm'])} | "
            f"{ms(row.get('comm_symm', '-'))} | "
            f"{ms(floor) if floor else '-'} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{bar} | {row['batch'] / row['step']:.0f} |"
        )
    cap = r0.get("capture")
    if cap:
        met = cap["seconds"] <= CAPTURE_BAR
        ok &= met
        lines.append(
            f"\ncapture of the decode graphs of plan {cap['plan']} (FULL_DECODE_ONLY): "
            f"{cap['graphs']} graphs in {cap['seconds']:.2f} s on rank 0 "
            f"(bar: <= {CAPTURE_BAR:.0f} s, {'met' if met else 'MISSED'})"
        )
    if "tp1_step" in r0:
        tp_b1 = next(r["step"] for r in r0["rows"] if r["batch"] == 1)
        ratio = tp_b1 / r0["tp1_step"]
        ok &= ratio <= TP1_BAR
        lines.append(
            f"\nbatch 1: TP={a.tp} step {ms(tp_b1)} ms / TP=1 step {ms(r0['tp1_step'])} ms "
            f"(same run, rank 0's GPU) = {ratio:.2f}x ({verdict(ratio, TP1_BAR)})"
        )
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from ranks import spawn_ranks
    from timing import publish

    if torch.cuda.device_count() < a.tp:
        print(f"tp_scale: --tp {a.tp} needs {a.tp} GPUs, {torch.cuda.device_count()} here")
        return 2
    if 1 not in a.batches and a.tp1:
        a.batches = [1, *a.batches]
    from tp_rank import rank_worker

    results = spawn_ranks(rank_worker, a.tp, a)
    text, ok = report(a, torch.cuda.get_device_name(0), results[0])
    publish(text, a.out)
    gc.collect()
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
