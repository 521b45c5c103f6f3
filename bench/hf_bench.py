"""A stock transformers LlamaForCausalLM served three ways in one process, on the same prompts:
graphplan (GraphRunner over models/hf's paged adapter: FULL graphs for uniform decode, continuous
batching with chunked prefill, plans/hf-decode.yaml) vs transformers' continuous batching
(``generate_batch``, its paged cache and warm-up graphs) vs plain padded ``generate``.

    python bench/hf_bench.py --out bench/results/hf_bench.md        # GPU: the issue's configuration
    python bench/hf_bench.py --device cpu --smoke                   # tiny sizes: checks the program

Model (issue 13): vocab 32000, hidden 1024, intermediate 2816, 8 layers, 16 heads / 4 KV heads,
bf16, random weights from a seed; 64 requests of ~128-token prompts (112..144), 64 new greedy
tokens each, no EOS. Prints generated tokens/s, time to first token and capture/warm-up time per
system, and graphplan's ratio to generate_batch (bar: >= 5x). Greedy agreement between the systems
is reported (bf16: near-tied argmaxes can differ between kernels, after which a request diverges).

GPU only: its results need a CUDA device; ``--device cpu`` is a smoke run that checks the program,
not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from graphplan.models.hf import PagedCausalLM
from graphplan.runtime import GraphRunner
from graphplan.server.core.batching import ContinuousBatcher

from hf_setup import (
    FULL_SIZE,
    SMOKE_SIZE,
    baseline_model,
    cli,
    prompts_for,
    setup,
    table_for,
)
from hf_setup import llama_config as llama_config  # re-exported: hf_bench's names stay importable
from timing import publish, sync

ROOT = Path(__file__).resolve().parents[1]

BAR = 5.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="default bfloat16 on CUDA, float32 on the CPU",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model and workload (CPU check)")
    p.add_argument("--requests", type=int, help="default 64 (smoke 8)")
    p.add_argument(
        "--prompt-len", type=int, help="mean prompt length, +-16 (default 128; smoke 16)"
    )
    p.add_argument("--new-tokens", type=int, help="default 64 (smoke 8)")
    p.add_argument(
        "--plan",
        default=str(ROOT / "plans" / "hf-decode.yaml"),
        help="plan (.yaml) or compiled table (.json) for graphplan",
    )
    p.add_argument(
        "--systems",
        default="graphplan,generate_batch,generate",
        help="comma-separated subset of graphplan,generate_batch,generate",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the markdown result here")
    a = p.parse_args(argv)
    a.requests = a.requests or (8 if a.smoke else 64)
    a.prompt_len = a.prompt_len or (16 if a.smoke else 128)
    a.new_tokens = a.new_tokens or (8 if a.smoke else 64)
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    return a


# ---- graphplan ----------------------------------------------------------------------------


def run_graphplan(model, runner, table, prompts, new_tokens, device) -> dict:
    """Every request arrives at t0; continuous batching until all are done."""
    batcher = ContinuousBatcher(
        max_num_seqs=table.max_num_seqs,
        token_budget=table.max_tokens,
        max_model_len=model.cfg.max_model_len,
        num_cache_rows=model.cfg.num_cache_rows,
        kv_pool=model.kv_pool,
    )
    for i, p in enumerate(prompts):
        batcher.add(i, p, max_new_tokens=new_tokens)
    first: dict[int, float] = {}
    steps = 0
    sync(device)
    t0 = time.perf_counter()
    while batcher.has_work():
        batch = batcher.schedule()
        logits = runner.step(model.make_batch(batch.reqs), batch.num_reqs, batch.max_query_len)
        now = time.perf_counter()
        for ev in batcher.commit(batch, logits):  # .tolist() inside: the step is done
            first.setdefault(ev.request_id, now - t0)
        steps += 1
    sync(device)
    wall = time.perf_counter() - t0
    out = [batcher.finished[i] for i in range(len(prompts))]
    return {"tokens": out, "wall": wall, "ttft": list(first.values()), "steps": steps}


def bench_graphplan(a, hf, table, prompts, device) -> dict:
    max_len = max(map(len, prompts)) + a.new_tokens
    model = PagedCausalLM(hf, max_num_seqs=table.max_num_seqs, max_model_len=max_len)
    runner = GraphRunner(model, table, model.static_inputs(), progress=False)
    cap = runner.capture()
    run_graphplan(model, runner, table, prompts[:4], min(4, a.new_tokens), device)  # warm-up
    before = runner.stats()
    r = run_graphplan(model, runner, table, prompts, a.new_tokens, device)
    after = runner.stats()
    r["capture_s"] = cap["seconds"]
    r["graphs"] = cap["graphs"]
    full = [s["replays_by_mode"].get("FULL", 0) for s in (before, after)]
    r["full_replays"] = full[1] - full[0]
    r["eager_steps"] = sum(after["eager_steps"].values()) - sum(before["eager_steps"].values())
    r["kv_blocks"] = model.cfg.num_blocks
    runner.release()  # graphs and cache go back before the baselines size their caches
    return r


# ---- transformers baselines ---------------------------------------------------------------


def greedy_config(new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )


def bench_generate_batch(a, m, prompts, device) -> dict:
    from transformers import ContinuousBatchingConfig

    cb = None
    if (
        device.type != "cuda"
    ):  # transformers sizes its cache from GPU memory: give it one on the CPU
        import transformers.generation.continuous_batching.cache as cache_mod

        cache_mod.get_device_and_memory_breakdown = lambda: (device, 4 << 30, 0, 0)
        cb = ContinuousBatchingConfig(
            num_blocks=4 * len(prompts), max_batch_tokens=256, block_size=16
        )
    m.generate_batch(
        inputs=prompts[:4], generation_config=greedy_config(4), continuous_batching_config=cb
    )  # warm-up, as graphplan's
    sync(device)
    t0 = time.perf_counter()
    res = m.generate_batch(
        inputs=prompts,
        generation_config=greedy_config(a.new_tokens),
        continuous_batching_config=cb,
        record_timestamps=True,
    )
    sync(device)
    wall = time.perf_counter() - t0
    outs = list(res.values())
    start = min(o.created_time for o in outs)  # requests are added after the warm-up/capture
    end = max(o.timestamps[-1] for o in outs if o.timestamps)
    return {
        "tokens": [o.generated_tokens for o in outs],
        "wall": end - start,
        "ttft": [o.timestamps[0] - o.created_time for o in outs if o.timestamps],
        "capture_s": wall - (end - start),
        "errors": sum(o.error is not None for o in outs),
    }


def bench_generate(a, m, prompts, device) -> dict:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    m.generate(ids[:4], attention_mask=mask[:4], generation_config=greedy_config(4))  # warm-up
    sync(device)
    t0 = time.perf_counter()
    m.generate(ids, attention_mask=mask, generation_config=greedy_config(1))
    sync(device)
    ttft = time.perf_counter() - t0  # one generated token: the padded batch's prefill
    t0 = time.perf_counter()
    out = m.generate(ids, attention_mask=mask, generation_config=greedy_config(a.new_tokens))
    sync(device)
    wall = time.perf_counter() - t0
    return {
        "tokens": out[:, width:].tolist(),
        "wall": wall,
        "ttft": [ttft] * len(prompts),
        "capture_s": 0.0,
    }


# ---- report -------------------------------------------------------------------------------


def agreement(x: list[list[int]], y: list[list[int]]) -> tuple[float, float]:
    """(share of identical tokens, share of identical requests)."""
    same = sum(p == q for a, b in zip(x, y) for p, q in zip(a, b))
    total = sum(len(a) for a in x)
    return same / max(total, 1), sum(a == b for a, b in zip(x, y)) / max(len(x), 1)


def main(argv=None) -> int:
    return cli(run, parse_args, argv)


def run(a) -> int:
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    t = time.perf_counter()
    device, cfg, hf = setup(a)
    params = sum(p.numel() for p in hf.parameters()) / 1e6
    print(
        f"model built in {time.perf_counter() - t:.1f} s: {params:.0f}M parameters, {a.dtype} "
        f"on {device}",
        flush=True,
    )
    table = table_for(a.plan)
    prompts = prompts_for(a, cfg.vocab_size)
    results, failed = {}, {}
    for name in systems:
        if name not in ("graphplan", "generate_batch", "generate"):
            raise SystemExit(f"unknown system {name!r}")
        print(f"running {name} ...", flush=True)
        try:
            if name == "graphplan":
                r = bench_graphplan(a, hf, table, prompts, device)
            else:
                m = baseline_model(hf, hf.dtype, device)
                fn = bench_generate_batch if name == "generate_batch" else bench_generate
                r = fn(a, m, prompts, device)
                del m
        except Exception as e:
            import traceback

            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r["generated"] = sum(len(t) for t in r["tokens"])
        r["tok_s"] = r["generated"] / r["wall"]
        results[name] = r
        print(f"  {name}: {r['generated']} tokens, {r['tok_s']:.0f} tokens/s", flush=True)
    lines = report(a, results, table, device)
    lines += [f"{name} FAILED: {why}" for name, why in failed.items()]
    publish("\n".join(lines), a.out)
    return 1 if failed else 0


def report(a, results: dict, table, device) -> list[str]:
    import transformers

    dev = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "CPU"
    )
    cmd = "python " + " ".join(shlex.quote(x) for x in sys.argv)
    size = SMOKE_SIZE if a.smoke else FULL_SIZE
    lines = [
        f"# Stock LlamaForCausalLM: graphplan vs transformers (issue 13) — {dev}, "
        f"{datetime.date.today().isoformat()}",
        "",
        f"- device: {dev}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        f"- command: `{cmd}`",
        f"- model: LlamaForCausalLM {size}, {a.dtype}, random weights (seed {a.seed})",
        f"- workload: {a.requests} requests, prompts {min(map(len, results_prompts(a)))}.."
        f"{max(map(len, results_prompts(a)))} tokens, {a.new_tokens} new greedy tokens each, "
        "all arriving at once",
        f"- graphplan plan: {table.settings.name} (max_num_seqs {table.max_num_seqs}, "
        f"max_num_batched_tokens {table.max_tokens}, {len(table.graphs)} FULL decode graphs)",
        "",
        "| system | generated tokens | tokens/s | TTFT p50 ms | TTFT max ms | "
        "capture / warm-up s | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['generated']} | {r['tok_s']:.0f} | "
            f"{statistics.median(r['ttft']) * 1e3:.1f} | {max(r['ttft']) * 1e3:.1f} | "
            f"{r['capture_s']:.2f} | {r['wall']:.2f} |"
        )
    lines.append("")
    gp = results.get("graphplan")
    if gp:
        lines.append(
            f"graphplan: {gp['graphs']} graphs captured in {gp['capture_s']:.2f} s; "
            f"{gp['steps']} steps ({gp['full_replays']} FULL replays, {gp['eager_steps']} "
            f"eager with prefill); KV cache {gp['kv_blocks']} blocks of 16"
        )
    for base in ("generate_batch", "generate"):
        if gp and base in results:
            ratio = gp["tok_s"] / results[base]["tok_s"]
            verdict = (
                f" — bar >= {BAR:.0f}x: {'PASS' if ratio >= BAR else 'FAIL'}"
                if base == "generate_batch"
                else ""
            )
            tok, req = agreement(gp["tokens"], results[base]["tokens"])
            lines.append(
                f"graphplan / {base}: tokens/s x{ratio:.2f}{verdict}; identical greedy "
                f"tokens {tok:.1%}, identical requests {req:.1%}"
            )
    if "generate_batch" in results and "generate" in results:
        tok, req = agreement(results["generate_batch"]["tokens"], results["generate"]["tokens"])
        lines.append(
            f"generate_batch vs generate: identical greedy tokens {tok:.1%}, identical "
            f"requests {req:.1%}"
        )
    if "generate" in results:
        lines.append("generate's TTFT is the time of a 1-token generate of the whole padded batch.")
    return lines


def results_prompts(a):
    return prompts_for(a, (SMOKE_SIZE if a.smoke else FULL_SIZE)["vocab_size"])


if __name__ == "__main__":
    sys.exit(main())
