"""Mixed-batch steps of the tiny Llama: eager vs piecewise graphs (split at run time around
attention) vs FULL graphs; and what capturing a FULL_AND_PIECEWISE plan costs (time, graphs, memory).

    python bench/piecewise_bench.py --out bench/results/piecewise-h100.txt   # GPU, bf16
    python bench/piecewise_bench.py --device cpu --quick                     # smoke run, tiny sizes
    python bench/piecewise_bench.py --model hf --out bench/results/piecewise-hf-h100.txt
    python bench/piecewise_bench.py --model hf --device cpu --quick          # smoke run

``--model hf``: the stock transformers LlamaForCausalLM of the HF issue (vocab 32000, hidden 1024,
intermediate 2816, 8 layers, 16 heads / 4 KV heads, bf16, random weights) behind graphplan's paged
adapter (models/hf): the same mixed steps, eager (the adapter's own eager path: prefill chunks
attend over their real lengths) vs PIECEWISE graphs around its attention, with the
FULL_AND_PIECEWISE capture cost of the vLLM-default plan. Same bar: piecewise >= 2x eager for mixed
steps of <= 256 tokens on CUDA.

Until issue 14 this bench also timed a torch.fx split beside the run-time split; that run
(bench/results/piecewise_bench.md, H100: run-time split step time +2.2% at worst on 16-256 tokens,
capture 16% faster) is why the run-time split is the only one now (docs/semantics.md §5.6).

A mixed step at T tokens is chunked prefill plus decodes in one batch: min(T // 4, 32) decodes with
context, the rest prefill chunks of up to 128 tokens each continuing a prompt. Every mode runs the
same batch on the same model; capture sizes equal the token counts, so nothing is padded. FULL
applies here because the tiny model's attention is capturable for any batch (ALWAYS). Bar (GPU):
piecewise >= 2x faster than eager for mixed steps of <= 256 tokens. Exit status 1 if it fails on
CUDA; on the CPU the verdicts are printed but not enforced.

GPU only: its results need a CUDA device; ``--device cpu`` is a smoke run that checks the program,
not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch

from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, make_batch, static_inputs
from graphplan.runtime import DispatchTable, GraphRunner

from timing import time_per_call
from tiny_shapes import BENCH

ROOT = Path(__file__).resolve().parents[1]

BAR, BAR_TOKENS = 2.0, 256
TABLES = ROOT / "bench" / "tables"
DEFAULT_TOKENS = [16, 64, 128, 256, 512]  # the sizes of bench/tables/mixed-*.json
MiB = 1 << 20


def load(name: str, overrides: dict | None) -> DispatchTable:
    """bench/tables/<name>.json (the device machine needs no compiler), or <name>.yaml compiled
    with overrides (quick runs and custom token counts)."""
    if overrides is None:
        return DispatchTable.load(TABLES / f"{name}.json")
    from graphplan.compiler import compile_plan

    return compile_plan(TABLES / f"{name}.yaml", overrides)


def mixed_reqs(tokens: int, max_chunk: int, context: int) -> list[tuple[int, int, list[int]]]:
    """(cache_row, start_pos, token_ids): decodes with `context` tokens behind them, then chunks."""
    decodes = max(1, min(tokens // 4, 32))
    reqs = [(r, context + r % 8, [1 + r]) for r in range(decodes)]
    left, row = tokens - decodes, decodes
    while left:
        n = min(left, max_chunk)
        reqs.append((row, context // 2, [7 + (i % 50) for i in range(n)]))
        left, row = left - n, row + 1
    return reqs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def header(device: torch.device, dtype: torch.dtype, model: str) -> list[str]:
    """The report's first lines: the command, date, device and torch, and the model."""
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or "cpu")
    )
    return [
        f"# piecewise_bench: python bench/piecewise_bench.py {' '.join(sys.argv[1:])}",
        f"# date {datetime.datetime.now().isoformat(timespec='seconds')}, device {name}, "
        f"torch {torch.__version__}, {dtype}",
        f"# model: {model}",
    ]


def capture_cost(runner: GraphRunner) -> str:
    """Capture a FULL_AND_PIECEWISE table's graphs, say what it took, and release them."""
    s = runner.capture()
    pw = s["piecewise"]
    line = (
        f"# FULL_AND_PIECEWISE capture, runtime split (vllm preset, max_num_seqs "
        f"{runner.table.max_num_seqs}): {s['graphs']} graphs ({pw['piece_graphs']} piece graphs "
        f"of {pw['pieces']} pieces, {pw['split_ops']} eager split ops per step) in "
        f"{s['seconds']:.2f} s; graph pool {s['bytes'] / MiB:.1f} MiB; static buffers "
        f"{(pw['static_bytes'] + runner.buffers.nbytes()) / MiB:.1f} MiB"
    )
    runner.release()
    return line


def verdict(tokens: int, speedup: float) -> str:
    """The bar for a mixed step: piecewise >= BAR x eager up to BAR_TOKENS tokens."""
    return "n/a" if tokens > BAR_TOKENS else "PASS" if speedup >= BAR else "FAIL"


def finish(lines: list[str], failed: bool, device: torch.device, out: Path | None) -> int:
    """Print (and with --out write) the report; exit status 1 if the bar failed on CUDA."""
    enforce = device.type == "cuda"
    lines.append(
        f"# bar: {'FAIL' if failed else 'PASS'}"
        + ("" if enforce else " (informational: the bar applies on CUDA)")
    )
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    return 1 if failed and enforce else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny model and sizes (a smoke run)")
    p.add_argument("--tokens", type=int, nargs="*", help="mixed-step token counts")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--out", type=Path, help="also write the report to this file")
    p.add_argument(
        "--model",
        choices=("tiny", "hf"),
        default="tiny",
        help="tiny: the tiny Llama (default); hf: a stock transformers Llama through models/hf",
    )
    a = p.parse_args(argv)
    if a.model == "hf":
        return hf_main(a)
    device = torch.device(a.device)
    if a.quick:
        cfg = TinyLlamaConfig(
            vocab_size=512,
            hidden=128,
            layers=2,
            heads=2,
            kv_heads=1,
            intermediate=256,
            max_model_len=128,
            num_cache_rows=64,
        )
        tokens, iters, max_chunk = a.tokens or [8, 16, 32], a.iters or 5, 16
    else:
        cfg = TinyLlamaConfig(**dict(BENCH, num_cache_rows=64))
        tokens, iters, max_chunk = a.tokens or DEFAULT_TOKENS, a.iters or 50, 128
    stock = tokens == DEFAULT_TOKENS and not a.quick
    mixed = (
        None
        if stock
        else {
            "cudagraph.capture_sizes": sorted(set(tokens)),
            "scheduler.max_num_batched_tokens": max(64, *tokens),
        }
    )
    fp = (
        None
        if not a.quick
        else {"scheduler.max_num_seqs": 16, "scheduler.max_num_batched_tokens": 32}
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = TinyLlama(cfg, seed=0, device=device, dtype=dtype)
    lines = header(
        device,
        dtype,
        f"layers {cfg.layers}, hidden {cfg.hidden}, heads {cfg.heads}/"
        f"{cfg.kv_heads}, intermediate {cfg.intermediate}, vocab {cfg.vocab_size}, "
        f"max_model_len {cfg.max_model_len}",
    )
    lines.append(
        capture_cost(
            GraphRunner(
                model,
                load("full-and-piecewise-51", fp),
                static_inputs(model),
                device=device,
                progress=False,
            )
        )
    )
    runners = {
        mode: GraphRunner(
            model, load(f"mixed-{mode}", mixed), static_inputs(model), device=device, progress=False
        )
        for mode in ("piecewise", "full")
    }
    for runner in runners.values():
        runner.capture()
    head = (
        f"{'tokens':>6} {'reqs':>4} {'eager ms':>9} {'pw ms':>9} {'FULL ms':>8} {'pw x':>7} "
        f"{'FULL x':>7} {'pw err':>8}  bar (piecewise >= {BAR:g}x eager, <= {BAR_TOKENS} tokens)"
    )
    lines += [head, "-" * len(head)]
    failed = False
    with torch.no_grad():
        for t in tokens:
            reqs = mixed_reqs(t, max_chunk, cfg.max_model_len // 4)
            batch = make_batch(model, reqs)
            r, q = len(reqs), max(len(x) for _, _, x in reqs)
            eager_fn = lambda: model(**batch)
            ms = {"eager": time_per_call(eager_fn, device, iters, 3) * 1e3}
            ref = eager_fn().clone()
            for mode, runner in runners.items():
                step = lambda runner=runner: runner.step(batch, num_reqs=r, max_query_len=q)
                ms[mode] = time_per_call(step, device, iters, 3) * 1e3
            err = rel_err(runners["piecewise"].step(batch, num_reqs=r, max_query_len=q), ref)
            ok = verdict(t, ms["eager"] / ms["piecewise"])
            failed |= ok == "FAIL"
            lines.append(
                f"{t:>6} {r:>4} {ms['eager']:>9.3f} {ms['piecewise']:>9.3f} "
                f"{ms['full']:>8.3f} {ms['eager'] / ms['piecewise']:>6.2f}x "
                f"{ms['eager'] / ms['full']:>6.2f}x {err:>8.1e}  {ok}"
            )
    stats = {m: r.stats() for m, r in runners.items()}
    assert all(s["eager_steps"] == {} for s in stats.values()), "a timed step ran eagerly"
    assert stats["piecewise"]["replays_by_mode"]["PIECEWISE"] > 0
    return finish(lines, failed, device, a.out)


def hf_main(a) -> int:
    """``--model hf``: a stock transformers Llama, eager vs PIECEWISE."""
    from transformers import LlamaConfig

    from graphplan.models.hf import PagedCausalLM

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if a.quick:
        size = dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        tokens, iters, max_chunk, max_len, seqs = a.tokens or [8, 16, 32], a.iters or 5, 16, 128, 16
    else:
        size = dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
        )
        tokens, iters, max_chunk = a.tokens or DEFAULT_TOKENS, a.iters or 50, 128
        max_len, seqs = 256, 256
    cfg = LlamaConfig(
        **size,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    stock = tokens == DEFAULT_TOKENS and not a.quick
    mixed = (
        None
        if stock
        else {
            "cudagraph.capture_sizes": sorted(set(tokens)),
            "scheduler.max_num_batched_tokens": max(64, *tokens),
        }
    )
    fp = (
        None
        if not a.quick
        else {"scheduler.max_num_seqs": seqs, "scheduler.max_num_batched_tokens": 32}
    )
    model = PagedCausalLM.load(
        cfg,
        max_num_seqs=seqs,
        max_model_len=max_len,
        dtype=dtype,
        device=device,
        seed=0,
        random_weights=True,
    )
    lines = header(
        device,
        dtype,
        f"transformers LlamaForCausalLM (models/hf paged adapter), "
        f"layers {cfg.num_hidden_layers}, hidden {cfg.hidden_size}, heads "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}, intermediate "
        f"{cfg.intermediate_size}, vocab {cfg.vocab_size}, max_model_len {max_len}, "
        "block_size 16",
    )
    lines.append(
        capture_cost(
            GraphRunner(
                model,
                load("full-and-piecewise-51", fp),
                model.static_inputs(),
                device=device,
                progress=False,
            )
        )
    )
    runner = GraphRunner(
        model, load("mixed-piecewise", mixed), model.static_inputs(), device=device, progress=False
    )
    runner.capture()
    head = (
        f"{'tokens':>6} {'reqs':>4} {'eager ms':>9} {'pw ms':>9} {'pw x':>7} {'pw err':>8}  "
        f"bar (piecewise >= {BAR:g}x eager, <= {BAR_TOKENS} tokens)"
    )
    lines += [head, "-" * len(head)]
    failed = False
    with torch.no_grad():
        for t in tokens:
            reqs = mixed_reqs(t, max_chunk, max_len // 4)
            batch = model.make_batch(reqs)
            r, q = len(reqs), max(len(x) for _, _, x in reqs)
            eager_fn = lambda: model(**batch)
            step = lambda: runner.step(batch, num_reqs=r, max_query_len=q)
            eager = time_per_call(eager_fn, device, iters, 3) * 1e3
            ref = eager_fn().clone()
            pw_ms = time_per_call(step, device, iters, 3) * 1e3
            err = rel_err(step(), ref)
            ok = verdict(t, eager / pw_ms)
            failed |= ok == "FAIL"
            lines.append(
                f"{t:>6} {r:>4} {eager:>9.3f} {pw_ms:>9.3f} {eager / pw_ms:>6.2f}x "
                f"{err:>8.1e}  {ok}"
            )
    st = runner.stats()
    assert st["eager_steps"] == {} and st["replays_by_mode"]["PIECEWISE"] > 0, st["eager_steps"]
    return finish(lines, failed, device, a.out)


if __name__ == "__main__":
    sys.exit(main())
