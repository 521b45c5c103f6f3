"""The fused small ops at real scale (issue 25, item 3): kernels and time of one decode step and of
one decoder layer of a Llama-3-8B-shaped model (random bf16 weights built from its config, no
download), with ``fused_ops`` on and off on the same weights, against the floor that
bench/real_scale.py measures (its ``floor_step``: every linear layer as ``F.linear`` plus SDPA
decode, in one CUDA graph) and its GEMMs alone. GPU only: a result needs a CUDA device; ``--device
cpu --shape tiny`` checks the program: CPU ops stand in for kernels.

    python bench/fused_ops_bench.py --out bench/results/fused_ops_bench.md   # 8B, batch 1 and 64
    python bench/fused_ops_bench.py --shape 1b --batches 1                   # a quick run

Every request decodes one token at ``--context`` (1024) past its prompt. Times:
- **graph**: the model's forward (or one layer's) captured in a CUDA graph and replayed
  (``timing.graph_time_per_call``): the GPU time of its kernels, no launch overhead;
- **kernels** and their device time by kind, from a ``torch.profiler`` run of the same forward,
  eager: **GEMM** (cuBLAS/cuBLASLt kernels: gemm, gemv, nvjet, xmma, cutlass, splitK),
  **attention** (every kernel the attention function launches: the bench wraps it, with a device
  sync at each end, so its kernels are the ones that start inside its range; its own GEMMs
  count here, not under GEMM) and **other** (norms, rotary, activation, residual adds, copies,
  embedding). The profile's top kernels follow each table.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import platform
import re
import shlex
import sys

import torch
import torch.nn.functional as F

from graphplan.models.hf import ATTN_IMPLEMENTATION, PagedCausalLM
from graphplan.models.hf.attention import make_paged_batch

from real_scale import SHAPES, build_model, floor_step
from timing import graph_time_per_call, publish, sync

GEMM = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|splitk|cublas", re.IGNORECASE)
MARK = "fused_ops_bench.attention"
TOP = 12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1152)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="few iterations")
    p.add_argument("--out", help="also write the report here (markdown)")
    a = p.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",") if x]
    if a.quick:
        a.iters, a.repeats, a.profile_steps = 3, 2, 1
    if a.device == "cpu" and a.shape != "tiny":
        p.error("the CPU runs only --shape tiny (the 1B and 8B shapes are GPU sizes)")
    if a.context >= a.max_model_len:
        p.error(f"--context {a.context} must be below --max-model-len {a.max_model_len}")
    return a


# ---- profiles ---------------------------------------------------------------------------------
def _bracketed(fn, device):
    """The attention function, its kernels fenced by device syncs inside a profiler range."""
    from torch.profiler import record_function

    def attention(*args, **kwargs):
        sync(device)
        with record_function(MARK):
            out = fn(*args, **kwargs)
            sync(device)
        return out

    return attention


def profile(fn, device, steps: int) -> dict:
    """Kernels of one call of ``fn`` (averaged over ``steps`` calls), split by kind (module
    docstring): {'kinds': {kind: [count, us]}, 'top': [(name, count, us)]}. On the CPU, the
    top-level aten ops stand in for kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cuda = device.type == "cuda"
    registered = ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
    AttentionInterface.register(ATTN_IMPLEMENTATION, _bracketed(registered, device))
    try:
        with torch.no_grad():
            fn()
            sync(device)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch_profile(activities=activities) as prof:
                for _ in range(steps):
                    fn()
                sync(device)
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, registered)
    events = list(prof.events())
    ranges = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.name == MARK and e.device_type == DeviceType.CPU
    ]
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.name != MARK]
    else:
        kernels = [
            e
            for e in events
            if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        ]
    kinds = {k: [0.0, 0.0] for k in ("GEMM", "attention", "other")}
    top: dict = collections.defaultdict(lambda: [0.0, 0.0])
    for k in kernels:
        start, us = k.time_range.start, k.time_range.end - k.time_range.start
        if any(a <= start <= b for a, b in ranges):
            kind = "attention"
        else:
            kind = "GEMM" if GEMM.search(k.name) else "other"
        kinds[kind][0] += 1 / steps
        kinds[kind][1] += us / steps
        top[(kind, k.name[:80])][0] += 1 / steps
        top[(kind, k.name[:80])][1] += us / steps
    ranked = sorted(top.items(), key=lambda kv: -kv[1][1])[:TOP]
    return {"kinds": kinds, "top": [(f"{kind}: {n}", c, us) for (kind, n), (c, us) in ranked]}


# ---- what is timed -----------------------------------------------------------------------------
def gemm_floor(hf, a, device, batch: int) -> float:
    """real_scale.floor_step's GEMMs alone: every linear layer's weight as one F.linear."""
    dtype = next(hf.parameters()).dtype
    weights = [m.weight for m in hf.modules() if isinstance(m, torch.nn.Linear)]
    xs = {
        k: torch.randn(batch, k, device=device, dtype=dtype) for k in {w.shape[1] for w in weights}
    }

    def body():
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    with torch.no_grad():
        return graph_time_per_call(body, device, a.iters, a.repeats)


def layer_call(model: PagedCausalLM, batch: dict, fused: bool):
    """One decoder layer (the first) at this batch, as the step runs it: the step's paged
    metadata and rotary cos/sin made once, outside."""
    hf = model.hf
    meta = make_paged_batch(
        model.kv_cache,
        batch["positions"],
        batch["slot_mapping"],
        batch["block_tables"],
        batch["seq_lens"],
        batch["query_start_loc"],
    )
    with torch.no_grad():
        h = F.embedding(batch["input_ids"], hf.model.embed_tokens.weight)
    if fused:
        assert model.fused is not None
        fused_model, layer = model.fused, model.fused.layers[0]
        residual = h.clone()
        return lambda: fused_model.layer_forward(
            layer, h, residual, fused_model.step_inputs(batch["positions"], meta)
        )
    positions = batch["positions"][None]
    with torch.no_grad():
        rope = hf.model.rotary_emb(h[None], positions)
    first = hf.model.layers[0]
    return lambda: first(
        h[None], position_embeddings=rope, position_ids=positions, use_cache=False, graphplan=meta
    )


def measure(model, a, device, batch: dict, fused: bool) -> dict:
    model.fused_ops = fused
    step = lambda: model(**batch)
    layer = layer_call(model, batch, fused)
    with torch.no_grad():
        out = {
            "step": graph_time_per_call(step, device, a.iters, a.repeats),
            "layer": graph_time_per_call(layer, device, a.iters, a.repeats),
        }
    out["step_profile"] = profile(step, device, a.profile_steps)
    out["layer_profile"] = profile(layer, device, a.profile_steps)
    return out


# ---- report ------------------------------------------------------------------------------------
def _kinds(p: dict) -> str:
    k = p["kinds"]
    total = sum(c for c, _ in k.values()), sum(us for _, us in k.values())
    cells = [f"{total[0]:.0f}", f"{total[1] / 1e3:.2f}"]
    for kind in ("GEMM", "attention", "other"):
        cells.append(f"{k[kind][0]:.0f} / {k[kind][1] / 1e3:.2f}")
    return " | ".join(cells)


def report(a, device, rows: list[dict], load_s: float) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cfg = SHAPES[a.shape]
    when = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"# fused_ops_bench ({a.shape}), {name}, {when:%Y-%m-%d %H:%M} UTC",
        f"command: `python bench/fused_ops_bench.py {shlex.join(sys.argv[1:])}`",
        f"torch {torch.__version__}, triton {triton_version}; model built in {load_s:.1f} s; "
        f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}; context {a.context}, "
        f"max_model_len {a.max_model_len}. Times in ms; kernels as count / device ms (profile)",
        "",
        "## Whole step",
        "",
        "| batch | variant | graph ms | / floor | / GEMM floor | kernels | kernel ms | GEMM | attention | other |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        floor, gfloor = r["floor"], r["gemm_floor"]
        for variant in ("fused", "unfused"):
            m = r[variant]
            ratio = f"{m['step'] / floor:.2f}x" if isinstance(floor, float) else "-"
            lines.append(
                f"| {r['batch']} | {variant} | {m['step'] * 1e3:.2f} | {ratio} | "
                f"{m['step'] / gfloor:.2f}x | {_kinds(m['step_profile'])} |"
            )
        shown = f"{floor * 1e3:.2f}" if isinstance(floor, float) else str(floor)
        lines.append(f"| {r['batch']} | floor: GEMMs + SDPA | {shown} | | | | | | | |")
        lines.append(f"| {r['batch']} | GEMM floor | {gfloor * 1e3:.2f} | | | | | | | |")
    lines += [
        "",
        "## One decoder layer (the first)",
        "",
        "| batch | variant | graph ms | kernels | kernel ms | GEMM | attention | other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for variant in ("fused", "unfused"):
            m = r[variant]
            lines.append(
                f"| {r['batch']} | {variant} | {m['layer'] * 1e3:.3f} | "
                f"{_kinds(m['layer_profile'])} |"
            )
    for r in rows:
        for variant in ("fused", "unfused"):
            lines += ["", f"Top kernels of a step, batch {r['batch']}, {variant} (per step):", ""]
            for n, c, us in r[variant]["step_profile"]["top"]:
                lines.append(f"    {c:6.1f} x {us:9.1f} us  {n}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    hf, load_s = build_model(a, device)
    top = max(a.batches)
    model = PagedCausalLM(
        hf,
        max_num_seqs=top,
        max_model_len=a.max_model_len,
        block_size=a.block_size,
        kv_cache_tokens=top * (a.context + 2 * a.block_size),
        fused_ops=True,
    )
    if model.fused is None:
        print(f"fused_ops does not apply: {model.fused_reason}", file=sys.stderr)
        return 2
    rows = []
    for b in a.batches:
        batch = model.make_batch([(seat, a.context, [1 + seat]) for seat in range(b)])
        row = {"batch": b, "floor": floor_step(hf, a, device, b, a.context)}
        row["gemm_floor"] = gemm_floor(hf, a, device, b)
        for fused in (True, False):
            row["fused" if fused else "unfused"] = measure(model, a, device, batch, fused)
        rows.append(row)
        for seat in range(b):
            model.release(seat)
    publish(report(a, device, rows, load_s), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
