"""Runtime benchmark (issue 3): the tiny Llama in bf16, uniform-decode steps.

Side by side in one run, per batch size: eager, a bare torch.cuda.CUDAGraph (copy inputs into its
static tensors + replay: what a careful engineer writes by hand), the graphplan runner, and
torch.compile(mode="reduce-overhead"); then capture time and graph memory for the vLLM-default decode
sizes (51 graphs) against the largest single graph and torch.compile's warm-up for the same sizes.

    python bench/runtime_bench.py --out bench/results/runtime_bench.md          # GPU
    python bench/runtime_bench.py --device cpu --quick                          # smoke run

GPU only: its results need a CUDA device; ``--device cpu`` is a smoke run that checks the program,
not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

from graphplan.compiler.table import DispatchTable
from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, make_batch, static_inputs
from graphplan.runtime import GraphRunner

from timing import publish, sync, time_per_call
from tiny_shapes import BENCH, QUICK

ROOT = Path(__file__).resolve().parents[1]

DECODE_TABLE = ROOT / "bench" / "tables" / "decode-51.json"  # vLLM default sizes, FULL decode
LARGEST_TABLE = ROOT / "bench" / "tables" / "decode-512-only.json"  # the largest graph alone


def decode_batch(model, n: int):
    return make_batch(model, [(row, 17 + row % 31, [1 + (row * 7) % 4000]) for row in range(n)])


def bare_graph(model, batch, device):
    """Hand-written baseline: static copies of the inputs, one graph, copy-in + replay."""
    static = {k: v.clone() for k, v in batch.items()}
    with torch.no_grad():
        for _ in range(2):
            model(**static)
        sync(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(**static)

    def step():
        for k, v in batch.items():
            static[k].copy_(v, non_blocking=True)
        g.replay()
        return out

    return g, step


def capture_stats(model, table_path, device) -> dict:
    runner = GraphRunner(model, table_path, static_inputs(model), device=device, progress=False)
    summary = runner.capture()
    runner.release()
    del runner
    torch.cuda.empty_cache()
    return summary


def compile_warmup(model, sizes, device, budget_s: float) -> tuple[float, int]:
    """Seconds torch.compile(mode='reduce-overhead') takes to be ready for every size."""
    import torch._dynamo as dynamo

    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, 1024)
    dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    t0, done = time.perf_counter(), 0
    with torch.no_grad():
        for s in sorted(sizes, reverse=True):
            b = decode_batch(model, s)
            for _ in range(3):  # cudagraph trees record on the 2nd-3rd call of a shape
                compiled(**b)
            sync(device)
            done += 1
            if time.perf_counter() - t0 > budget_s:
                break
    return time.perf_counter() - t0, done


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few iterations (smoke run)")
    p.add_argument("--batches", default="1,8,32,128,512")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--compile-budget", type=float, default=240.0)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    cfg = TinyLlamaConfig(**BENCH)
    batches = [int(b) for b in a.batches.split(",")]
    if a.quick:
        cfg = TinyLlamaConfig(**QUICK)
        batches, a.iters, a.repeats = [1, 8], 5, 2
    dtype = torch.bfloat16 if cuda else torch.float32
    model = TinyLlama(cfg, seed=0, device=device, dtype=dtype)
    table = DispatchTable.load(DECODE_TABLE)
    runner = GraphRunner(model, table, static_inputs(model), device=device, progress=False)
    runner.capture()

    rows = []
    for n in batches:
        batch = decode_batch(model, n)
        with torch.no_grad():
            t_eager = time_per_call(lambda: model(**batch), device, a.iters, a.repeats)
        t_runner = time_per_call(lambda: runner.step(batch, n, 1), device, a.iters, a.repeats)
        t_bare = t_replay = t_compile = float("nan")
        if cuda:
            g, bare = bare_graph(model, batch, device)
            t_bare = time_per_call(bare, device, a.iters, a.repeats)
            t_replay = time_per_call(g.replay, device, a.iters, a.repeats)
            del g, bare
        rows.append((n, t_eager, t_replay, t_bare, t_runner, t_compile))

    lines = [
        f"# runtime_bench — {datetime.date.today()}",
        f"device: {torch.cuda.get_device_name(device) if cuda else platform.processor() or 'cpu'}"
        f"; torch {torch.__version__}; model: tiny Llama bf16, {cfg.layers} layers, hidden "
        f"{cfg.hidden}, vocab {cfg.vocab_size}; uniform decode steps",
        f"command: python bench/runtime_bench.py {' '.join(sys.argv[1:])}",
        "",
        "| batch | eager us | replay() us | bare graph us | runner us | runner/bare | "
        "eager/runner |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ok = True
    for n, te, tr, tb, tn, _ in rows:
        ratio_bare, speedup = tn / tb if cuda else float("nan"), te / tn
        lines.append(
            f"| {n} | {te * 1e6:.1f} | {tr * 1e6:.1f} | {tb * 1e6:.1f} | {tn * 1e6:.1f} | "
            f"{ratio_bare:.3f} | {speedup:.2f} |"
        )
        if cuda:
            ok &= ratio_bare <= 1.05
            ok &= n > 64 or speedup >= 3
    runner.release()  # free its pool before the capture measurements below
    lines.append("")
    if cuda:
        single = capture_stats(model, LARGEST_TABLE, device)
        full = capture_stats(model, DECODE_TABLE, device)
        mem_ratio = full["bytes"] / max(single["bytes"], 1)
        lines += [
            f"capture: {full['graphs']} graphs in {full['seconds']:.3f} s, "
            f"{full['bytes'] / 2**20:.1f} MiB in the shared pool; largest graph alone "
            f"{single['bytes'] / 2**20:.1f} MiB; ratio {mem_ratio:.2f} (bar <= 1.2)",
            f"capture memory estimate from the two largest graphs: "
            f"{(full['estimate_bytes'] or 0) / 2**20:.1f} MiB "
            f"({(full['estimate_error'] or 0):+.1%} vs actual)",
        ]
        ok &= full["seconds"] <= 2.0 and mem_ratio <= 1.2
        if not a.no_compile:
            sizes = table.capture_sizes
            secs, done = compile_warmup(model, sizes, device, a.compile_budget)
            per = secs / done
            est = per * len(sizes)
            note = "" if done == len(sizes) else f" (stopped after {done} sizes; extrapolated)"
            lines.append(
                f"torch.compile reduce-overhead warm-up for {len(sizes)} sizes: "
                f"{est:.1f} s{note}; graphplan capture / compile = "
                f"{full['seconds'] / est:.4f} (bar <= 0.1)"
            )
            ok &= full["seconds"] <= est / 10
            # steady-state step of the compiled model at each batch, for the side-by-side table
            import torch._dynamo as dynamo

            compiled = torch.compile(model, mode="reduce-overhead")
            lines += ["", "| batch | torch.compile reduce-overhead us |", "|---:|---:|"]
            with torch.no_grad():
                for n in batches:
                    b = decode_batch(model, n)
                    t = time_per_call(lambda: compiled(**b), device, a.iters, a.repeats)
                    lines.append(f"| {n} | {t * 1e6:.1f} |")
            dynamo.reset()
    lines += [
        "",
        "bars (H100/H200): runner <= 1.05 x bare graph at every batch; runner >= 3 x "
        "eager at batch <= 64; 51-graph capture <= 2 s and <= 1/10 of torch.compile warm-up; "
        "shared-pool memory <= 1.2 x the largest graph",
        f"result: {'PASS' if ok else 'FAIL'}",
    ]
    publish("\n".join(lines), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
