"""Compiled-path benchmark (issue 15): the runner over the model compiled once with a dynamic token
dimension (GraphRunner(compile=...)) against torch.compile(mode="reduce-overhead"), side by side in
one run, on the tiny Llama in bf16 with the 51 vLLM-default decode sizes (bench/tables/decode-51.json).

Per batch: step time of the runner over the compiled model, of reduce-overhead, and of the runner
over the plain model (context); then the total warm-up of each for the 51 sizes (the runner: one
compile + capture; reduce-overhead: its compiles + one cudagraph-tree recording per size), and the
largest |output - eager| of each, relative to the largest |eager| logit. Both stay alive to the
end (the runner's compiled code is its own function's, reduce-overhead's the model's forward).

Step times are interleaved: per batch, --repeats rounds each time the runner and reduce-overhead
back to back (the order alternating); the median of each side is reported.

Warm-ups (the bar) are cold: each side's runs in fresh processes with empty inductor and Triton
caches, --warmup-repeats per side, the order alternating, median; each process builds the model
and compiles a trivial function first, so that neither side pays the compiler's own start-up. The
warm-ups in this process (the runner first, then reduce-overhead, which may reuse the kernels the
runner compiled) are reported as context.

    python bench/compiled_bench.py --out bench/results/compiled_bench.md      # GPU
    python bench/compiled_bench.py --device cpu --quick                       # smoke run

GPU only: its results need a CUDA device; ``--device cpu`` is a smoke run that checks the program,
not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from runtime_bench import DECODE_TABLE, decode_batch

from graphplan.compiler.table import DispatchTable
from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, static_inputs
from graphplan.runtime import CompiledModel, GraphRunner

from timing import fresh_compile_caches, publish, sync, time_per_call
from tiny_shapes import BENCH, QUICK

ROOT = Path(__file__).resolve().parents[1]

TOLERANCE = 3e-2
"""Bar on max |output - eager| / max |eager| in bf16 (tests/test_compiled_gpu.py uses the same)."""


def rel_diff(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def runner_warmup(model, table, device, backend, options, only, a):
    """Seconds from nothing to every graph captured: one compile, then the capture."""
    sync(device)
    t0 = time.perf_counter()
    compiled = CompiledModel(
        model, backend, options=options, merge=not a.no_merge, regional=not a.no_regional
    )
    runner = GraphRunner(
        model, table, static_inputs(model), device=device, progress=False, compile=compiled
    )
    runner.capture(only=only)
    sync(device)
    return runner, time.perf_counter() - t0


def baseline_warmup(model, sizes, device, mode, backend, options, budget_s):
    """torch.compile ready for every size: three calls per size, largest first (cudagraph trees
    record on the 2nd-3rd call of a shape). Returns (compiled, seconds, sizes done)."""
    import torch._dynamo as dynamo

    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, 1024)
    compiled = (
        torch.compile(model, mode=mode)
        if mode
        else torch.compile(model, backend=backend, options=options)
    )
    sync(device)
    t0, done = time.perf_counter(), 0
    with torch.no_grad():
        for s in sorted(sizes, reverse=True):
            b = decode_batch(model, s)
            for _ in range(3):
                compiled(**b)
            sync(device)
            done += 1
            if time.perf_counter() - t0 > budget_s:
                break
    return compiled, time.perf_counter() - t0, done


def cold_warmups(a, argv_base: list[str]) -> dict:
    """Each side's warm-up in fresh processes with empty inductor/Triton caches (each process
    builds the model and compiles a trivial function first), --warmup-repeats times, the order
    alternating; median seconds per side, and our compile's stats."""
    out = {"ours": [], "ro": []}
    for i in range(a.warmup_repeats):
        for side in ("ours", "ro") if i % 2 == 0 else ("ro", "ours"):
            env = dict(os.environ)
            for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
                env[var] = tempfile.mkdtemp(prefix=f"gp-{var.lower()}-")
            r = subprocess.run(
                [sys.executable, __file__, *argv_base, "--warmup-only", side],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            if r.returncode:
                raise SystemExit(f"warm-up process ({side}) failed:\n{r.stderr[-3000:]}")
            out[side].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"  cold warm-up {side}: {out[side][-1]['seconds']:.2f} s", flush=True)
    return out


def warmup_only(a, model, table, device, backend, options, only, sizes) -> int:
    """One side's warm-up, timed, as the last line of stdout (JSON): ``cold_warmups``' child."""
    if a.warmup_only == "ours":
        runner, seconds = runner_warmup(model, table, device, backend, options, only, a)
        s = runner.stats()
        rec = {
            **s["compile"],
            "seconds": seconds,
            "seconds_compile": s["compile"]["seconds"],
            "capture_s": s["capture"]["seconds"],
            "graphs": s["capture"]["graphs"],
        }
    else:
        mode = "reduce-overhead" if device.type == "cuda" else None
        _, seconds, done = baseline_warmup(model, sizes, device, mode, backend, options, a.budget)
        rec = {"seconds": seconds / done * len(sizes), "sizes_done": done}
    print(json.dumps(rec))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny model, sizes <= 8 (smoke run)")
    p.add_argument("--batches", default="1,8,32,128,256")
    p.add_argument(
        "--backend",
        help="the runner's compile backend (default: inductor on a GPU, "
        "eager, dynamo alone, on the CPU)",
    )
    p.add_argument("--iters", type=int, default=100)
    p.add_argument(
        "--repeats", type=int, default=11, help="interleaved timing rounds per batch (median)"
    )
    p.add_argument(
        "--options",
        default="",
        help="inductor config patches for the runner's compile, k=v,k=v "
        "(e.g. triton.autotune_pointwise=False)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=300.0,
        help="seconds reduce-overhead's warm-up may take before it is extrapolated",
    )
    p.add_argument(
        "--warmup-repeats",
        type=int,
        default=2,
        help="cold warm-ups per side, each in a fresh process (median)",
    )
    p.add_argument(
        "--no-merge",
        action="store_true",
        help="compile without merged projections (CompiledModel(merge=False))",
    )
    p.add_argument(
        "--no-regional",
        action="store_true",
        help="compile the whole graph, not its repeated layers once "
        "(CompiledModel(regional=False))",
    )
    p.add_argument("--warmup-only", choices=("ours", "ro"), help=argparse.SUPPRESS)
    p.add_argument("--out")
    a = p.parse_args(argv)
    fresh_compile_caches(keep_set=True)
    argv_base = list(sys.argv[1:] if argv is None else argv)
    if "--out" in argv_base:  # the children write nothing
        del argv_base[argv_base.index("--out") : argv_base.index("--out") + 2]
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    backend = a.backend or ("inductor" if cuda else "eager")
    options = {"cpp.vec_isa_ok": False} if backend == "inductor" and not cuda else None
    if a.options:
        options = dict(options or {})
        for kv in a.options.split(","):
            k, v = kv.split("=", 1)
            options[k] = {"True": True, "False": False}.get(v, int(v) if v.isdigit() else v)
    cfg = TinyLlamaConfig(**BENCH)
    batches = [int(b) for b in a.batches.split(",")]
    table = DispatchTable.load(DECODE_TABLE)
    only = None
    if a.quick:
        cfg = TinyLlamaConfig(**dict(QUICK, num_cache_rows=16))
        batches, a.iters, a.repeats = [1, 8], 5, 2
        only = {g.id for g in table.graphs if g.key.num_tokens <= 8}
    sizes = [g.key.num_tokens for g in table.graphs if only is None or g.id in only]
    dtype = torch.bfloat16 if cuda else torch.float32
    model = TinyLlama(cfg, seed=0, device=device, dtype=dtype)
    eager = {}
    with torch.no_grad():
        for n in batches:
            eager[n] = model(**decode_batch(model, n)).float().clone()
        torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.ones(8, device=device))

    if a.warmup_only:
        return warmup_only(a, model, table, device, backend, options, only, sizes)

    # the runner over the plain model (context for the step table)
    plain = GraphRunner(model, table, static_inputs(model), device=device, progress=False)
    plain.capture(only=only)
    t_plain = {}
    for n in batches:
        batch = decode_batch(model, n)
        t_plain[n] = time_per_call(lambda: plain.step(batch, n, 1), device, a.iters, a.repeats)
    plain.release()
    plain = None  # its graphs are freed before the compiled side captures

    # the runner over the compiled model
    runner, warm_ours = runner_warmup(model, table, device, backend, options, only, a)
    cap = runner.stats()["capture"]
    d_ours = {}
    for n in batches:
        d_ours[n] = rel_diff(runner.step(decode_batch(model, n), n, 1), eager[n])
    # (no dynamo reset: the runner's compiled code is its own function's, reduce-overhead's is
    # the model's forward; each checks only its own guards)

    # torch.compile(mode="reduce-overhead") for the same sizes
    mode = "reduce-overhead" if cuda else None
    label = "reduce-overhead" if cuda else f"torch.compile({backend})"
    ro, warm_ro, done = baseline_warmup(model, sizes, device, mode, backend, options, a.budget)
    if done < len(sizes):
        warm_ro = warm_ro / done * len(sizes)
    d_ro = {}
    with torch.no_grad():
        for n in batches:
            d_ro[n] = rel_diff(ro(**decode_batch(model, n)), eager[n])

    # step times, interleaved: each repeat times the runner and reduce-overhead back to back, the
    # order alternating, so that drift in clocks falls on both alike
    t_ours, t_ro = {}, {}
    for n in batches:
        batch = decode_batch(model, n)
        sides = {"ours": lambda: runner.step(batch, n, 1), "ro": lambda: ro(**batch)}
        samples = {"ours": [], "ro": []}
        with torch.no_grad():
            for r in range(a.repeats):
                for side in ("ours", "ro") if r % 2 == 0 else ("ro", "ours"):
                    samples[side].append(time_per_call(sides[side], device, a.iters, 1))
        t_ours[n], t_ro[n] = statistics.median(samples["ours"]), statistics.median(samples["ro"])
    comp = runner.stats()["compile"]  # after the steps: recompiles during them count too
    runner.release()
    runner = None  # its graphs are freed before the cold warm-ups

    cold = cold_warmups(a, argv_base)
    cold_ours = statistics.median(r["seconds"] for r in cold["ours"])
    cold_ro = statistics.median(r["seconds"] for r in cold["ro"])

    ok = comp["recompiles"] == 0 and all(r["recompiles"] == 0 for r in cold["ours"])
    lines = [
        f"# compiled_bench — {datetime.date.today()}",
        f"device: {torch.cuda.get_device_name(device) if cuda else platform.processor() or 'cpu'}"
        f"; torch {torch.__version__}; model: tiny Llama {str(dtype).split('.')[-1]}, "
        f"{cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab_size}; uniform decode "
        f"steps; runner compile backend: {backend}",
        f"command: python bench/compiled_bench.py {' '.join(sys.argv[1:])}",
        "",
        f"| batch | runner (plain) us | runner (compiled) us | {label} us | compiled/{label} "
        f"| max rel diff vs eager: compiled | {label} |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in batches:
        ratio = t_ours[n] / t_ro[n]
        ok &= ratio <= 1.0 and d_ours[n] <= TOLERANCE
        lines.append(
            f"| {n} | {t_plain[n] * 1e6:.1f} | {t_ours[n] * 1e6:.1f} | "
            f"{t_ro[n] * 1e6:.1f} | {ratio:.3f} | {d_ours[n]:.2e} | {d_ro[n]:.2e} |"
        )
    note = "" if done == len(sizes) else f" (stopped after {done} sizes; extrapolated)"
    warm_ratio = cold_ours / cold_ro
    ok &= warm_ratio <= 1 / 3
    ours_runs = ", ".join(
        f"{r['seconds']:.1f} s (compile {r['seconds_compile']:.1f} s, capture "
        f"{r['capture_s']:.2f} s)"
        for r in cold["ours"]
    )
    ro_runs = ", ".join(f"{r['seconds']:.1f} s" for r in cold["ro"])
    lines += [
        "",
        f"warm-up for {len(sizes)} sizes, cold (each in a fresh process with empty "
        f"inductor/Triton caches, {a.warmup_repeats} per side, alternating; median): runner "
        f"(compiled) {cold_ours:.1f} s [{ours_runs}]; {label} {cold_ro:.1f} s "
        f"[{ro_runs}]; ratio "
        f"{warm_ratio:.3f}",
        f"in this process (context: the runner first, then {label}, which may reuse the "
        f"kernels the runner compiled): runner (compiled) {warm_ours:.1f} s (compile "
        f"{comp['seconds']:.1f} s, {comp['compiles']} compilation(s), {comp['recompiles']} "
        f"recompiles, {comp['merged_linears']} linear groups merged, "
        f"{comp['regions']} regions of which {comp['region_compiles']} compiled; capture of {cap['graphs']} graphs {cap['seconds']:.2f} s); {label} "
        f"{warm_ro:.1f} s{note}",
        "",
        f"bars (GPU): runner (compiled) <= 1.0 x {label} at every batch; warm-up <= 1/3 "
        f"of {label}'s; max |compiled - eager| <= {TOLERANCE} x max |eager|; zero "
        "recompiles",
        f"result: {('PASS' if ok else 'FAIL') if cuda else 'smoke run (the bars apply on a GPU)'}",
    ]
    publish("\n".join(lines), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
