"""Capture-time benchmark (issue 15): GraphRunner vs a hand-written capture loop, same run.

The hand-written loop is what a careful engineer writes: one eager warm-up at the largest size,
then ``torch.cuda.graph`` for every size, largest first, into one shared pool, reading static
input buffers and writing static outputs. The runner captures the same 51 FULL decode graphs
(the vLLM-default sizes, bench/tables/decode-51.json) and still reports graph memory. Runs
alternate (loop, runner, loop, runner, ...) and the medians are compared. Bar: runner <= 1.5x.

    python bench/capture_bench.py --out bench/results/capture_bench.md        # GPU
    python bench/capture_bench.py --device cpu --quick                        # smoke run

GPU only: its results need a CUDA device; ``--device cpu`` is a smoke run that checks the program,
not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

from graphplan.compiler.table import DispatchTable
from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, static_inputs
from graphplan.runtime import GraphRunner

from timing import sync
from tiny_shapes import BENCH, QUICK

ROOT = Path(__file__).resolve().parents[1]

DECODE_TABLE = ROOT / "bench" / "tables" / "decode-51.json"
BAR = 1.5


def hand_loop(model, sizes: list[int], device) -> tuple[float, list]:
    """Seconds to capture every size by hand (static buffers from the runner's own specs)."""
    sync(device)
    t0 = time.perf_counter()
    top = max(sizes)
    inputs = {
        s.name: torch.full((s.rows(top, top), *s.trailing), s.fill, dtype=s.dtype, device=device)
        for s in static_inputs(model)
    }
    specs = {s.name: s for s in static_inputs(model)}
    graphs = []
    with torch.no_grad():
        out = model(**inputs)  # one warm-up at the largest size
        statics = torch.empty_like(out)
        if device.type == "cuda":
            sync(device)
            pool = torch.cuda.graph_pool_handle()
            for n in sorted(sizes, reverse=True):
                views = {k: v[: specs[k].rows(n, n)] for k, v in inputs.items()}
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    statics[:n].copy_(model(**views))
                graphs.append(g)
        else:  # the CPU stand-in's equivalent: one call per size
            for n in sorted(sizes, reverse=True):
                statics[:n].copy_(model(**{k: v[: specs[k].rows(n, n)] for k, v in inputs.items()}))
    sync(device)
    return time.perf_counter() - t0, graphs


def runner_capture(model, table, device) -> tuple[float, dict]:
    sync(device)
    t0 = time.perf_counter()
    runner = GraphRunner(model, table, static_inputs(model), device=device, progress=False)
    summary = runner.capture()
    sync(device)
    seconds = time.perf_counter() - t0
    runner.release()
    return seconds, summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny model (smoke run)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    cfg = TinyLlamaConfig(**dict(BENCH, vocab_size=32000))
    if a.quick:
        cfg = TinyLlamaConfig(**QUICK)
        a.repeats = 2
    model = TinyLlama(cfg, seed=0, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    table = DispatchTable.load(DECODE_TABLE)
    sizes = [g.key.num_tokens for g in table.graphs]
    loop_s, runner_s, summary = [], [], {}
    for _ in range(a.repeats):
        s, graphs = hand_loop(model, sizes, device)
        loop_s.append(s)
        del graphs
        if cuda:
            torch.cuda.empty_cache()
        s, summary = runner_capture(model, table, device)
        runner_s.append(s)
    lo, ru = statistics.median(loop_s), statistics.median(runner_s)
    ratio = ru / lo
    mib = summary["bytes"] / 2**20
    est = summary["estimate_bytes"]
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    lines = [
        f"# capture_bench — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"device: {name}; torch {torch.__version__}; model: tiny Llama "
        f"{'bf16' if cuda else 'fp32'}, {cfg.layers} layers, hidden {cfg.hidden}; "
        f"{len(sizes)} FULL decode graphs (vLLM default sizes)",
        f"command: python bench/capture_bench.py {' '.join(sys.argv[1:] if argv is None else argv)}",
        "",
        "| capture | median s | runs |",
        "|---|---:|---|",
        f"| hand-written loop (1 warm-up, torch.cuda.graph into one pool) | {lo:.3f} | "
        f"{', '.join(f'{x:.3f}' for x in loop_s)} |",
        f"| GraphRunner.capture() | {ru:.3f} | {', '.join(f'{x:.3f}' for x in runner_s)} |",
        "",
        f"runner / hand loop: **{ratio:.2f}x** (bar <= {BAR}x): {'PASS' if ratio <= BAR else 'FAIL'}",
        f"runner's reported graph memory: {mib:.1f} MiB"
        + (
            f"; estimate from the two largest graphs {est / 2**20:.1f} MiB "
            f"({summary['estimate_error']:+.1%})"
            if est
            else ""
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
