"""Probe for the compiled path (issue 15): where the runner's compile time goes, and which kernels a
step of the runner over the compiled model launches compared with torch.compile reduce-overhead.

    python bench/compiled_probe.py --out-dir $OUT          # GPU; writes probe_*.txt
    python bench/compiled_probe.py --variant whole        # one compile variant, in this process

Each compile variant runs in its own process with fresh inductor/Triton caches.

GPU only: its results need a CUDA device.
"""

from __future__ import annotations

import argparse
import collections
import os
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
from graphplan.runtime.compiled.model import _shape_config

from timing import fresh_compile_caches, sync, time_per_call
from tiny_shapes import BENCH

ROOT = Path(__file__).resolve().parents[1]

CFG = TinyLlamaConfig(**BENCH)
DEV = torch.device("cuda")


def kernels(fn, steps=20):
    """{kernel name: (calls per step, device us per step)} over ``steps`` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(DEV)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        sync(DEV)
    out = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:90]][0] += 1
            out[e.name[:90]][1] += (
                e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            )
    return {k: (v[0] / steps, v[1] / steps) for k, v in out.items()}


def show(title, ks):
    lines = [
        f"== {title}: {sum(c for c, _ in ks.values()):.1f} kernels/step, "
        f"{sum(t for _, t in ks.values()):.1f} device us/step"
    ]
    for k, (c, t) in sorted(ks.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {c:6.1f} x {t:8.1f} us  {k}")
    return lines


def compile_breakdown() -> list[str]:
    from torch._dynamo.utils import compile_times

    try:
        return [str(compile_times(repr="str", aggregate=True))]
    except TypeError:
        return [str(compile_times(repr="str"))]


def step_probe(args) -> list[str]:
    """Runner (compiled, inductor) vs reduce-overhead: step times and kernel lists."""
    model = TinyLlama(CFG, seed=0, device=DEV, dtype=torch.bfloat16)
    torch.compile(lambda x: x.sin() + 1)(torch.ones(8, device=DEV))
    table = DispatchTable.load(DECODE_TABLE)
    sizes = [512, 256, 128, 32, 8, 1]
    only = {g.id for g in table.graphs if g.key.num_tokens in sizes}
    t0 = time.perf_counter()
    compiled = CompiledModel(model, "inductor")
    runner = GraphRunner(
        model, table, static_inputs(model), device=DEV, progress=False, compile=compiled
    )
    runner.capture(only=only)
    lines = [
        f"runner compile {compiled.seconds:.2f} s; warm-up+capture(6) "
        f"{time.perf_counter() - t0:.2f} s"
    ] + compile_breakdown()
    res = {}
    for n in (1, 128):
        b = decode_batch(model, n)
        res[n] = {
            "runner": (
                time_per_call(lambda: runner.step(b, n, 1), DEV, 100, 7),
                kernels(lambda: runner.step(b, n, 1)),
            )
        }
    runner.release()
    torch._dynamo.reset()
    import torch._dynamo as dynamo

    dynamo.config.recompile_limit = 64
    ro = torch.compile(model, mode="reduce-overhead")
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in sizes:
            b = decode_batch(model, s)
            for _ in range(3):
                ro(**b)
        sync(DEV)
    lines.append(f"reduce-overhead warm-up ({len(sizes)} sizes) {time.perf_counter() - t0:.2f} s")
    lines += compile_breakdown()
    with torch.no_grad():
        for n in (1, 128):
            b = decode_batch(model, n)
            res[n]["ro"] = (time_per_call(lambda: ro(**b), DEV, 100, 7), kernels(lambda: ro(**b)))
    for n, r in res.items():
        lines.append(
            f"\n##### batch {n}: runner {r['runner'][0] * 1e6:.1f} us, reduce-overhead "
            f"{r['ro'][0] * 1e6:.1f} us"
        )
        lines += show("runner", r["runner"][1]) + show("reduce-overhead", r["ro"][1])
    return lines


class Region(torch.nn.Module):
    """A decoder layer compiled alone (regional compilation), dim 0 of its token inputs dynamic."""

    def __init__(self, inner, fn):
        super().__init__()
        self.inner, self.fn = inner, fn

    def forward(self, x, cos, sin, kv, slots, pos):
        for t in (x, cos, sin, slots, pos):
            torch._dynamo.mark_dynamic(t, 0)
        with _shape_config(), torch.no_grad():
            return self.fn(x, cos, sin, kv, slots, pos)


def variant(name: str) -> list[str]:
    model = TinyLlama(CFG, seed=0, device=DEV, dtype=torch.bfloat16)
    torch.compile(lambda x: x.sin() + 1)(torch.ones(8, device=DEV))
    table = DispatchTable.load(DECODE_TABLE)
    sizes = [512, 128, 32, 1]
    only = {g.id for g in table.graphs if g.key.num_tokens in sizes}
    count = [0]
    inductor = torch._dynamo.lookup_backend("inductor")

    def backend(gm, ex, **kw):
        count[0] += 1
        return inductor(gm, ex, **kw)

    t0 = time.perf_counter()
    kw = {}
    if name == "layers":  # each decoder layer compiled alone, by torch.compile
        layers = model.layers
        for i, layer in enumerate(layers):
            layers[i] = Region(layer, torch.compile(layer, backend=backend))
        with torch.no_grad():
            b = decode_batch(model, 512)
            model(**b)
    elif name in ("full", "nomerge", "whole"):
        kw["compile"] = CompiledModel(
            model, "inductor", merge=name != "nomerge", regional=name != "whole"
        )
    elif name.startswith("opt:"):  # opt:k=v;k=v (inductor config patches)
        kw["compile"] = CompiledModel(model, "inductor", options=parse_options(name[4:]))
    compile_s = time.perf_counter() - t0
    runner = GraphRunner(model, table, static_inputs(model), device=DEV, progress=False, **kw)
    runner.capture(only=only)
    total = time.perf_counter() - t0
    compiled = kw.get("compile")
    if compiled is not None:  # inductor calls: one per region compiled, else one per graph
        count[0] = compiled.region_compiles or compiled.compiles
        compile_s = compiled.seconds
    steps = []
    for n in (1, 32, 128):
        b = decode_batch(model, n)
        steps.append(f"{n}:{time_per_call(lambda: runner.step(b, n, 1), DEV, 100, 7) * 1e6:.1f}us")
    b1 = decode_batch(model, 1)
    ks = kernels(lambda: runner.step(b1, 1, 1))
    return (
        [
            f"variant {name}: compile {compile_s:.2f} s (backend calls {count[0]}), to captured "
            f"{total:.2f} s; steps {' '.join(steps)}; batch 1: "
            f"{sum(c for c, _ in ks.values()):.0f} kernels, "
            f"{sum(t for _, t in ks.values()):.1f} device us"
        ]
        + compile_breakdown()
        + show("runner at batch 1", ks)
    )


def parse_options(text: str) -> dict:
    out = {}
    for kv in filter(None, text.split(";")):
        k, v = kv.split("=", 1)
        out[k] = {"True": True, "False": False}.get(v, int(v) if v.isdigit() else v)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variant")
    p.add_argument("--out-dir", default=".")
    p.add_argument(
        "--variants",
        default="full,opt:triton.autotune_pointwise=False,full,opt:triton.autotune_pointwise=False",
        help="comma-separated: full (CompiledModel's defaults), nomerge (without "
        "merged projections), whole (the whole graph compiled, not its "
        "repeated layers once), layers (each decoder layer compiled alone by "
        "torch.compile), opt:k=v;k=v (inductor config patches)",
    )
    p.add_argument("--no-steps", action="store_true")
    a = p.parse_args()
    fresh_compile_caches(keep_set=False)
    if a.variant:
        print("\n".join(variant(a.variant)), flush=True)
        return 0
    out = Path(a.out_dir)
    for i, v in enumerate(a.variants.split(",")):
        env = dict(os.environ)
        for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # empty caches per variant
            env[var] = tempfile.mkdtemp(prefix=f"gp-{var.lower()}-")
        r = subprocess.run(
            [sys.executable, __file__, "--variant", v],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        (out / f"probe_variant_{i}_{v.split(':')[0]}.txt").write_text(r.stdout + r.stderr[-4000:])
        print(r.stdout[:600], r.stderr[-1500:] if r.returncode else "", flush=True)
    if a.no_steps:
        return 0
    text = "\n".join(step_probe(a))
    (out / "probe_steps.txt").write_text(text)
    print(text[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
