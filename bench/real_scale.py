"""Decode at real scale: a Llama-3-8B-shaped (or 1B) transformers model under graphplan's FULL
decode graphs, against the floor measured in the same process. GPU only: a result needs a CUDA
device; ``--device cpu`` with ``--shape tiny`` checks the program.

    python bench/real_scale.py --out bench/results/real_scale.md            # 8B, the issue's grid
    python bench/real_scale.py --shape 1b --batches 1,8 --contexts 1024     # a quick run
    python bench/real_scale.py --device cpu --shape tiny --quick            # CPU smoke run

The model is ``LlamaForCausalLM`` built from its config (random bf16 weights, no download). For each
max_model_len, context and batch it prints:
- **step**: ``GraphRunner.step`` (copy in, replay, slice out) of a FULL decode graph, every request
  at ``context`` tokens (their blocks are reserved; the KV contents do not change the time);
- **floor**: every linear layer of the model as ``F.linear`` on ``batch`` rows plus, per layer,
  ``F.scaled_dot_product_attention(enable_gqa=True)`` of one query over contiguous K/V of
  ``context`` tokens, all captured in one CUDA graph. K/V buffers are distinct per layer, except
  when one layer's K/V is over 256 MiB (five times the H100's L2): then two buffers alternate,
  which reads the same bytes from HBM and keeps the floor within memory;
- the ratio step / floor, tokens/s (batch / step), capture time of the bench's decode graphs
  (its batches), and the KV pool (blocks, GiB);
- **capture**: once, at the first max_model_len, the time to capture every decode graph of a real
  plan (``--capture-plan``, plans/llama3-8b-h100.yaml: 256 seats, vLLM's capture sizes) as
  FULL_DECODE_ONLY, first, so it includes the first compile of the attention kernels unless
  Triton's on-disk cache already holds them (a fresh ``TRITON_CACHE_DIR`` gives a cold start);
- with ``--compile``, the same runner over the inductor-compiled model (rows "compiled");
- **hf**: transformers' own decode step with a static cache under
  ``torch.compile(mode="reduce-overhead")`` at the same batch (``--hf-batches``; context 1024 only,
  its compile takes a minute per batch).
A configuration that does not fit (the KV pool or the floor's K/V) is reported, not skipped
silently. Bars (issue 25, H100): batch 1 ctx 1024 <= 1.10x, batch 64 ctx 1024 <= 1.15x at both
max_model_len, batch 64 ctx 8192 <= 1.25x, the plan's decode graphs captured in <= 5 s.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from decode_baselines import GiB, floor_step, hf_compiled_step

from graphplan.compiler import GraphplanError, compile_plan
from graphplan.models.hf import ATTN_IMPLEMENTATION, KVCacheSizeError, PagedCausalLM, load_model
from graphplan.runtime import GraphRunner

from llama_shapes import SHAPES
from timing import publish, sync, time_per_call

ROOT = Path(__file__).resolve().parents[1]
BARS = {(1, 1024): 1.10, (64, 1024): 1.15, (64, 8192): 1.25}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--max-model-lens", default="4096,32768")
    p.add_argument("--hf-batches", default="1,8", help="'' skips transformers' baseline")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-fraction",
        type=float,
        default=0.85,
        help="CUDA: the KV pool's share of the memory free after the weights",
    )
    p.add_argument(
        "--compile", action="store_true", help="also GraphRunner(compile=True): inductor"
    )
    p.add_argument(
        "--logits",
        choices=("all", "rows"),
        default="all",
        help="rows (the server's): each step returns hidden states and the LM head runs after "
        "it on the batch's rows, timed with the step",
    )
    p.add_argument(
        "--capture-plan",
        default=str(ROOT / "plans" / "llama3-8b-h100.yaml"),
        help="the plan whose decode graphs are captured and timed, as FULL_DECODE_ONLY at the "
        "first max_model_len ('' skips)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hf-only", type=int, help=argparse.SUPPRESS)  # the baseline's child
    p.add_argument("--quick", action="store_true", help="few iterations; tiny sizes on the CPU")
    p.add_argument("--out", help="also write the report here (markdown)")
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    a.batches, a.contexts, a.max_model_lens = (
        ints(a.batches),
        ints(a.contexts),
        ints(a.max_model_lens),
    )
    a.hf_batches = ints(a.hf_batches)
    if a.quick:
        a.iters, a.repeats = 3, 2
    if a.device == "cpu" and a.shape != "tiny":
        p.error("the CPU runs only --shape tiny (the 1B and 8B shapes are GPU sizes)")
    return a


def build_model(a, device):
    from transformers import LlamaConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = LlamaConfig(**SHAPES[a.shape])
    t0 = time.perf_counter()
    hf = load_model(
        cfg,
        dtype=dtype,
        device=device,
        seed=0,
        attn_implementation=ATTN_IMPLEMENTATION,
        random_weights=True,
    )
    return hf, time.perf_counter() - t0


def decode_plan(batches: list[int], max_len: int) -> dict:
    top = max(batches)
    return {
        "version": 1,
        "name": f"real-scale-{max_len}",
        "scheduler": {"max_num_seqs": top, "max_num_batched_tokens": max(top, 2048)},
        "cudagraph": {
            "mode": "FULL_DECODE_ONLY",
            "attention_support": "ALWAYS",
            "capture_sizes": sorted(batches),
        },
    }


def kv_pool(a, device, cpu_tokens: int) -> dict:
    """PagedCausalLM's pool argument: on CUDA the pool a server would have (most of what the
    weights leave, ``a.kv_fraction``); on the CPU ``cpu_tokens`` tokens."""
    if device.type == "cuda":
        return {"kv_memory_fraction": a.kv_fraction}
    return {"kv_cache_tokens": cpu_tokens}


def captured_runner(model, table, device, compile: bool = False) -> tuple[GraphRunner, float]:
    """A runner over ``model`` with every graph of ``table`` captured, and the capture's seconds."""
    runner = GraphRunner(
        model, table, model.static_inputs(), device=device, progress=False, compile=compile
    )
    sync(device)
    t0 = time.perf_counter()
    runner.capture()
    sync(device)
    return runner, time.perf_counter() - t0


def graphplan_steps(hf, a, device, max_len: int, rows: list[dict], compile=False) -> None:
    """Every (context, batch) of one max_model_len through one runner (one capture; with
    ``compile``, of the inductor-compiled model: its rows say "compiled")."""
    top = max(a.batches)
    pool = kv_pool(a, device, max(top * (max(a.contexts) + a.block_size), max_len))
    try:
        model = PagedCausalLM(
            hf,
            max_num_seqs=top,
            max_model_len=max_len,
            block_size=a.block_size,
            logits=getattr(a, "logits", "all"),
            **pool,
        )
    except GraphplanError as e:
        rows.append({"max_len": max_len, "note": f"KV pool refused: {e}"})
        return
    table = compile_plan(decode_plan(a.batches, max_len))
    runner, capture_s = captured_runner(model, table, device, compile)
    pool_gib = model.cache.nbytes() / GiB
    for ctx in a.contexts:
        if ctx >= max_len:
            continue
        for b in a.batches:
            try:
                batch = model.make_batch([(seat, ctx, [1 + seat]) for seat in range(b)])
            except KVCacheSizeError:
                need = b * (ctx + 1) * model.cache.shape.bytes_per_token / GiB
                note = f"context {ctx} x batch {b} ({need:.1f} GiB of KV) does not fit the pool"
                rows.append({"max_len": max_len, "note": note})
                continue
            every = torch.arange(b, device=device)

            def step(batch=batch, b=b, every=every):
                out = runner.step(batch, b, 1)  # "rows": the server's head after the step
                return model.logits(out, every) if model.logits_mode == "rows" else out

            with torch.no_grad():
                t = time_per_call(step, device, a.iters, a.repeats)
            rows.append(
                {
                    "max_len": max_len,
                    "ctx": ctx,
                    "batch": b,
                    "step": t,
                    "capture_s": capture_s,
                    "blocks": model.cfg.num_blocks,
                    "pool_gib": pool_gib,
                    **({"label": f"{max_len} compiled"} if compile else {}),
                }
            )
    runner.release()  # its graphs; the model's pool goes when the caller collects


def ms(x) -> str:
    return f"{x * 1e3:.2f}" if isinstance(x, float) else "-"


CAPTURE_BAR = 5.0


def plan_capture(hf, a, device, max_len: int) -> dict:
    """Seconds to capture every decode graph of ``--capture-plan`` (its cudagraph mode set to
    FULL_DECODE_ONLY, its seats and sizes as written) over this model: the issue's <= 5 s bar."""
    from graphplan.compiler.cli.inputs import parse_overrides

    table = compile_plan(a.capture_plan, parse_overrides(["cudagraph.mode=FULL_DECODE_ONLY"]))
    seats = table.max_num_seqs
    model = PagedCausalLM(
        hf,
        max_num_seqs=seats,
        max_model_len=max_len,
        block_size=a.block_size,
        logits=a.logits,
        **kv_pool(a, device, seats * a.block_size + max_len),
    )
    runner, seconds = captured_runner(model, table, device)
    runner.release()
    return {"plan": table.settings.name, "graphs": len(table.graphs), "seconds": seconds}


def report(a, device, load_s, rows, floors, hfs, capture=None) -> tuple[str, bool]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    lines = [
        f"# real_scale ({a.shape}), {name}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"command: `python bench/real_scale.py {shlex.join(sys.argv[1:])}`",
        f"torch {torch.__version__}; model built in {load_s:.1f} s; times are ms per step",
        "",
        "| max_model_len | context | batch | step | floor | step/floor | bar | tokens/s | hf static+compile | capture s | KV blocks | KV GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['max_len']} | | | {r['note']} | | | | | | | | |")
            ok = False
            continue
        f = floors.get((r["batch"], r["ctx"]))
        ratio = r["step"] / f if isinstance(f, float) else None
        bar = BARS.get((r["batch"], r["ctx"]))
        verdict = "" if bar is None or ratio is None else ("met" if ratio <= bar else "MISSED")
        ok &= verdict != "MISSED"
        h = hfs.get((r["batch"], r["ctx"]))
        lines.append(
            f"| {r.get('label', r['max_len'])} | {r['ctx']} | {r['batch']} | {ms(r['step'])} | "
            f"{ms(f) if isinstance(f, float) else f or '-'} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {f'<= {bar}x {verdict}' if bar else ''} | "
            f"{r['batch'] / r['step']:.0f} | {ms(h) if isinstance(h, float) else h or '-'} | "
            f"{r['capture_s']:.2f} | {r['blocks']} | {r['pool_gib']:.2f} |"
        )
    by_len = {}
    for r in rows:
        if "step" in r and r["batch"] == max(a.batches) and "label" not in r:
            by_len.setdefault(r["ctx"], {})[r["max_len"]] = r["step"]
    for ctx, steps in sorted(by_len.items()):
        if len(steps) > 1:
            growth = max(steps.values()) / min(steps.values()) - 1
            ok &= growth <= 0.05
            lines.append(
                f"\nbatch {max(a.batches)}, context {ctx}: step grows {growth:+.1%} from "
                f"max_model_len {min(steps)} to {max(steps)} (bar: within 5%)"
            )
    if capture is not None:
        met = capture["seconds"] <= CAPTURE_BAR
        ok &= met
        lines.append(
            f"\ncapture of the decode graphs of plan {capture['plan']} (FULL_DECODE_ONLY, "
            f"max_model_len {a.max_model_lens[0]}): {capture['graphs']} graphs in "
            f"{capture['seconds']:.2f} s (bar: <= {CAPTURE_BAR:.0f} s, {'met' if met else 'MISSED'})"
        )
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    hf, load_s = build_model(a, device)
    rows, floors, hfs = [], {}, {}
    if a.hf_only is not None:
        a.max_model_lens, a.contexts = [], []
    capture = None
    if a.capture_plan and a.max_model_lens:  # first: its capture compiles the attention kernels
        capture = plan_capture(hf, a, device, a.max_model_lens[0])
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    variants = (False, True) if a.compile else (False,)  # plain, then the compiled model
    for max_len in a.max_model_lens:
        for compile in variants:
            graphplan_steps(hf, a, device, max_len, rows, compile)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for ctx in a.contexts:
        for b in a.batches:
            floors[(b, ctx)] = floor_step(hf, a, device, b, ctx)
    if a.hf_only is not None:  # the child of hf_baselines: one number on stdout
        print(f"HF_STEP {hf_compiled_step(hf, a, device, a.hf_only, 1024)}")
        return 0
    text, ok = report(a, device, load_s, rows, floors, hfs, capture)
    publish(text, a.out)  # graphplan and the floor, whatever the baseline does next
    if a.hf_batches and 1024 in a.contexts:
        del hf
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hfs = hf_baselines(a)
        text, ok = report(a, device, load_s, rows, floors, hfs, capture)
        publish(text, a.out)
    return 0 if ok or device.type != "cuda" else 2


def hf_baselines(a) -> dict:
    """transformers' compiled static-cache step per batch, each in a child process: a failure
    there (a device-side assert poisons its CUDA context) costs only its own number."""
    import subprocess

    out = {}
    for b in a.hf_batches:
        argv = [
            sys.executable,
            __file__,
            "--device",
            a.device,
            "--shape",
            a.shape,
            "--batches",
            str(b),
            "--contexts",
            "1024",
            "--max-model-lens",
            "",
            "--hf-only",
            str(b),
            "--iters",
            str(a.iters),
            "--repeats",
            str(a.repeats),
        ]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=400)
        if a.out:  # the child's log beside the report: a failed baseline says why in full
            Path(f"{a.out}.hf{b}.log").write_text(run.stdout + run.stderr)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("HF_STEP ")), None)
        if line is None:
            err = (run.stderr.strip().splitlines() or ["no output"])[-1]
            out[(b, 1024)] = f"failed: {err[:100]}"
        else:
            value = line.split(" ", 1)[1]
            out[(b, 1024)] = float(value) if value[0].isdigit() else value
    return out


if __name__ == "__main__":
    sys.exit(main())
