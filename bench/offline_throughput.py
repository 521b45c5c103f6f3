"""Offline throughput at real scale: 1,000 requests with ShareGPT-like lengths, all submitted at
once to the engine loop (continuous batching with chunked prefill, KV blocks on demand) over a
Llama-3-8B-shaped model under graphplan's graphs. GPU only: a result needs a CUDA device; ``--device
cpu --shape tiny`` checks the program.

    python bench/offline_throughput.py --out bench/results/offline_throughput.md     # 8B, H100
    python bench/offline_throughput.py --device cpu --shape tiny --requests 16 --max-len 64

Lengths (fixed seed): prompts 4-1024 tokens and outputs 4-1024 tokens, each log-uniform (ShareGPT's
lengths are heavy-tailed toward short turns), EOS ignored, greedy. The plan is
``plans/llama3-8b-h100.yaml`` (256 seats, 8192 tokens a step, FULL graphs for decode and piecewise
graphs around attention for mixed steps) unless ``--plan`` names another. Prints output tokens/s,
total tokens/s, time to first token (mean, p50, p99), steps, preemptions and the KV pool, beside
``ANCHORS``: vLLM's published Llama-3-8B figures on one H100 (real ShareGPT prompts, so the
comparison is one of order, not of decimals) and the workload's own ceiling.
"""

from __future__ import annotations

import argparse
import datetime
import math
import random
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from graphplan.compiler import compile_plan
from graphplan.models.hf import PagedCausalLM
from graphplan.server.core.batching import ContinuousBatcher
from graphplan.server.core.model import parse_sets

from real_scale import SHAPES, build_model, captured_runner, kv_pool
from timing import publish, sync

ROOT = Path(__file__).resolve().parents[1]
# Published figures for this model and GPU, and the workload's ceiling (bench/serve_bench.py
# prints them too). The longest output of the default draw (1,000 requests, 4-1024 tokens, seed 0,
# Llama-3's 128,256 ids) is 1,016 tokens of 197,267: at least 1,016 sequential steps.
ANCHORS = (
    "vLLM PR #8125 (vllm-project/vllm): 8,475 output tok/s served, Llama-3-8B, one H100, "
    "1,000 ShareGPT requests at request rate inf",
    "vLLM PR #14036: 7,468 output tok/s offline",
    "this workload's ceiling: its longest output, 1,016 tokens, needs at least 1,016 sequential "
    "steps, so its 197,267 output tokens come at most 194 a step on average; at ~12 ms an 8B step "
    "of ~200 requests on an H100, 197,267 / (1,016 x 12 ms) = ~16k output tok/s, at any batch",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--plan", default=str(ROOT / "plans" / "llama3-8b-h100.yaml"))
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt and longest output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-fraction", type=float, default=0.85)
    p.add_argument(
        "--logits",
        choices=("rows", "all"),
        default="rows",
        help="rows (the server's): the LM head on the sampled rows only, outside the graphs; "
        "all: every token's logits inside the step",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="plan override")
    p.add_argument(
        "--loop",
        choices=("plain", "engine"),
        default="engine",
        help="engine (default): the server's engine thread (server/core/engine.py, async "
        "scheduling, the sampler's graphs), no HTTP: 9,174 vs 8,364 output tok/s on an H100; "
        "plain: a synchronous loop of batcher, runner and argmax, with the time by step kind",
    )
    p.add_argument("--out")
    a = p.parse_args(argv)
    a.quick, a.iters, a.repeats, a.block_size = False, 1, 1, 16
    if a.device == "cpu" and a.shape != "tiny":
        p.error("the CPU runs only --shape tiny")
    return a


def lengths(n: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    """Log-uniform integers in [lo, hi]."""
    return [int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))) for _ in range(n)]


def workload(a, vocab: int):
    rng = random.Random(a.seed)
    prompts = [
        [rng.randrange(1, vocab) for _ in range(n)]
        for n in lengths(a.requests, a.min_len, a.max_len, rng)
    ]
    return prompts, lengths(a.requests, a.min_len, a.max_len, rng)


def run(model, runner, table, prompts, outputs, device) -> dict:
    batcher = ContinuousBatcher(
        max_num_seqs=table.max_num_seqs,
        token_budget=table.max_tokens,
        max_model_len=model.cfg.max_model_len,
        num_cache_rows=model.cfg.num_cache_rows,
        kv_pool=model.kv_pool,
    )
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        batcher.add(i, p, max_new_tokens=n)
    first: dict[int, float] = {}
    kinds: dict[str, list] = {}  # step kind -> [seconds, steps, tokens]
    steps = 0
    sync(device)
    t0 = last = time.perf_counter()
    with torch.no_grad():
        while batcher.has_work():
            batch = batcher.schedule()
            out = runner.step(model.make_batch(batch.reqs), batch.num_reqs, batch.max_query_len)
            rows = torch.tensor(batch.sampling_rows, dtype=torch.int64).to(device)
            sampled = model.logits(out, rows).argmax(dim=-1) if len(rows) else []
            events = batcher.commit(batch, sampled=sampled)  # reads the tokens: the step is done
            now = time.perf_counter()
            for ev in events:
                first.setdefault(ev.request_id, now - t0)
            k = kinds.setdefault(step_kind(table, batch), [0.0, 0, 0])
            k[0], k[1], k[2] = k[0] + now - last, k[1] + 1, k[2] + batch.num_tokens
            last = now
            steps += 1
    sync(device)
    wall = time.perf_counter() - t0
    done = [len(batcher.finished[i]) for i in range(len(prompts))]
    return {
        "wall": wall,
        "ttft": sorted(first.values()),
        "steps": steps,
        "done": done,
        "preemptions": batcher.num_preemptions,
        "kinds": kinds,
    }


class Prebuilt:
    """A ServingSpec over a model already built (the engine loop serves the bench's model)."""

    name, compile = "bench", ""

    def __init__(self, model):
        self.model = model

    def limits(self) -> dict:
        return {
            "vocab_size": self.model.cfg.vocab_size,
            "max_model_len": self.model.cfg.max_model_len,
        }

    def stop_token_ids(self) -> tuple[int, ...]:
        return ()

    def check(self) -> None:
        pass

    def load_tokenizer(self) -> None:
        return None

    def chat_template(self) -> None:
        return None

    def build(self, table, device):
        return self.model


class Tally:
    """The engine's events, counted on its thread: each request's first token time, its tokens,
    and when the last request ends (no queue, no consumer thread taking the GIL per token)."""

    def __init__(self, n: int):
        self.t0 = 0.0
        self.first: dict[int, float] = {}
        self.tokens = [0] * n
        self.last = [0.0] * n
        self.gaps: list[float] = []  # every inter-token latency (s), as a client would see them
        self.left = n
        self.done = threading.Event()

    def put_many(self, items) -> None:
        now = time.perf_counter() - self.t0
        for tag, kind, _ in items:
            if kind == "token":
                if self.tokens[tag]:
                    self.gaps.append(now - self.last[tag])
                self.tokens[tag] += 1
                self.last[tag] = now
                self.first.setdefault(tag, now)
            elif kind in ("done", "error"):
                self.left -= 1
        if self.left == 0:
            self.done.set()


def run_engine(model, table, plan: str, prompts, outputs, device) -> dict:
    """The same workload through the server's Engine (its engine thread, async scheduling)."""
    from graphplan.server.core.engine import Engine
    from graphplan.server.requests import GREEDY, Request

    engine = Engine(
        table, plan, spec=Prebuilt(model), device=str(device), progress=False,
        max_waiting=len(prompts) + 1,
    )  # fmt: skip
    engine.start()
    assert engine.wait_ready(600), engine.error
    tally = Tally(len(prompts))
    # (delivered at, requests, longest query, tokens) a step
    steps_seen: list[tuple[float, int, int, int]] = []
    observe = engine.metrics.step

    def step(seconds: float, batch, decode_query_len: int) -> None:
        steps_seen.append(
            (time.perf_counter(), batch.num_reqs, batch.max_query_len, batch.num_tokens)
        )
        observe(seconds, batch, decode_query_len)

    engine.metrics.step = step  # type: ignore[method-assign]
    reqs = [Request(p, n, tally, GREEDY, tag=i) for i, (p, n) in enumerate(zip(prompts, outputs))]
    sync(device)
    tally.t0 = time.perf_counter()
    engine.enqueue(reqs)
    tally.done.wait()
    sync(device)
    wall = time.perf_counter() - tally.t0
    steps = int(engine.metrics.value("graphplan_server_steps_total", kind="decode"))
    steps += int(engine.metrics.value("graphplan_server_steps_total", kind="mixed"))
    preemptions = int(engine.metrics.value("graphplan_server_preemptions_total"))
    stats = engine.runner.stats()
    engine.stop(5)
    return {
        "wall": wall,
        "ttft": sorted(tally.first.values()),
        "steps": steps,
        "done": tally.tokens,
        "preemptions": preemptions,
        "kinds": {},
        "stats": stats,
        "itl": sorted(tally.gaps),
        "full_step": full_batch_step(steps_seen, table.max_num_seqs),
        "intervals": step_intervals(steps_seen),
    }


def full_batch_step(steps: list[tuple], seats: int) -> tuple[float, int] | None:
    """The engine's decode step at full batch: the median time between a decode-only step's tokens
    and the previous step's, over the steps with at least 90 % of the seats running (with async
    scheduling a step's own span overlaps its neighbours'; the interval is what it costs), and how
    many there were. Issue 34's ITL bar is 2x this."""
    full = sorted(
        t - prev[0]
        for prev, (t, n, q, _) in zip(steps, steps[1:])
        if q == 1 and prev[2] == 1 and n >= 0.9 * seats
    )
    return (full[len(full) // 2], len(full)) if full else None


def step_intervals(steps: list[tuple]) -> dict:
    """The engine loop's step intervals (a step's tokens delivered to the next step's: what an
    inter-token gap is made of), by kind: decode-only steps and steps with prefill chunks, each
    as (count, p50, p99, max) seconds, and the five longest with (requests, tokens, kind)."""
    kinds: dict[str, list[float]] = {"decode": [], "mixed": []}
    every = []
    for prev, (t, n, q, tok) in zip(steps, steps[1:]):
        kind = "decode" if q == 1 else "mixed"
        kinds[kind].append(t - prev[0])
        every.append((t - prev[0], n, tok, kind))
    out: dict = {}
    for kind, xs in kinds.items():
        xs.sort()
        if xs:
            out[kind] = (
                len(xs),
                xs[len(xs) // 2],
                xs[min(len(xs) - 1, int(0.99 * len(xs)))],
                xs[-1],
            )
    out["longest"] = sorted(every, reverse=True)[:5]
    return out


def step_kind(table, batch) -> str:
    """A step's kind for the time breakdown: decode (every request one token) by its request
    count, or mixed (prefill chunks in it); and how it runs (its graph's mode, or eager)."""
    route = table.route(batch.num_tokens, batch.num_reqs, batch.max_query_len)
    how = route.mode.name if route.graph_id >= 0 else "eager"
    if batch.max_query_len == 1:
        top = next(b for b in (8, 32, 64, 128, 256, 1 << 30) if batch.num_reqs <= b)
        return f"decode, {batch.num_reqs if top > 256 else f'<= {top}'} requests, {how}"
    return f"mixed, {how}"


def itl_lines(r: dict) -> list[str]:
    """The engine loop's inter-token latency beside its decode step at full batch."""
    if not r.get("itl"):
        return []
    itl = r["itl"]
    p = lambda f: itl[min(len(itl) - 1, int(f * len(itl)))] * 1e3
    line = f"- inter-token latency: p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms"
    if r.get("full_step"):
        step, n = r["full_step"]
        line += (
            f"; decode step at full batch (median of {n} decode-only steps with >= 90 % of the "
            f"seats) {step * 1e3:.1f} ms: ITL p99 / step {p(0.99) / (step * 1e3):.2f}"
        )
    lines = [line]
    iv = r.get("intervals") or {}
    for kind in ("decode", "mixed"):
        if kind in iv:
            n, p50, p99, top = iv[kind]
            lines.append(
                f"- step intervals, {kind} steps ({n}): p50 {p50 * 1e3:.1f} ms, p99 "
                f"{p99 * 1e3:.1f} ms, max {top * 1e3:.1f} ms"
            )
    if iv.get("longest"):
        lines.append(
            "- longest step intervals: "
            + "; ".join(
                f"{t * 1e3:.1f} ms ({kind}, {n} requests, {tok} tokens)"
                for t, n, tok, kind in iv["longest"]
            )
        )
    return lines


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    hf, load_s = build_model(a, device)
    table = compile_plan(a.plan, overrides=parse_sets(a.set) or None)
    max_len = 2 * a.max_len + 16
    pool = kv_pool(a, device, table.max_num_seqs * max_len)
    model = PagedCausalLM(
        hf, max_num_seqs=table.max_num_seqs, max_model_len=max_len, logits=a.logits, **pool
    )
    runner, capture_s = captured_runner(model, table, device)
    prompts, outputs = workload(a, hf.config.vocab_size)
    if a.loop == "engine":
        runner.release()  # the engine captures its own
        r = run_engine(model, table, a.plan, prompts, outputs, device)
    else:
        r = run(model, runner, table, prompts, outputs, device)
    ok = r["done"] == outputs  # every request finished with all its tokens
    out_tok, in_tok = sum(outputs), sum(map(len, prompts))
    ttft = r["ttft"]
    q = lambda f: ttft[min(len(ttft) - 1, int(f * len(ttft)))]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    stats = r.get("stats") or runner.stats()
    lines = [
        f"# offline_throughput ({a.shape}), {name}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"command: `python bench/offline_throughput.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        f"torch {torch.__version__}; plan {table.settings.name} ({len(table.graphs)} graphs, "
        f"captured in {capture_s:.1f} s); model built in {load_s:.1f} s; KV pool "
        f"{model.cfg.num_blocks} blocks ({model.cache.nbytes() / (1 << 30):.1f} GiB); logits "
        f"{model.logits_mode}",
        "",
        f"- requests: {a.requests} (prompts {a.min_len}-{a.max_len}, outputs {a.min_len}-"
        f"{a.max_len} tokens, log-uniform, seed {a.seed}); {in_tok} prompt and {out_tok} output "
        f"tokens; every request finished with all its tokens: {ok}",
        f"- wall {r['wall']:.1f} s over {r['steps']} steps; preemptions {r['preemptions']}; "
        f"replays {stats['replays_by_mode']}, eager steps {stats['eager_steps']}",
        f"- **output tokens/s {out_tok / r['wall']:.0f}**; total tokens/s "
        f"{(out_tok + in_tok) / r['wall']:.0f}",
        f"- time to first token: mean {statistics.mean(ttft):.2f} s, p50 {q(0.5):.2f} s, "
        f"p99 {q(0.99):.2f} s",
        *itl_lines(r),
        *(f"- anchor: {x}" for x in ANCHORS),
    ]
    lines += (
        []
        if not r["kinds"]
        else [
            "",
            "Where the wall time goes, by step kind (each step timed from the previous one's tokens read "
            "to its own: schedule, batch, step, LM head, argmax, commit):",
            "",
            "| step kind | steps | tokens | seconds | share of wall | ms per step |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    )
    for kind, (sec, n, tok) in sorted(r["kinds"].items(), key=lambda kv: -kv[1][0]):
        lines.append(
            f"| {kind} | {n} | {tok} | {sec:.2f} | {sec / r['wall']:.1%} | {sec / n * 1e3:.2f} |"
        )
    publish("\n".join(lines) + "\n", a.out)
    if a.loop == "plain":
        runner.release()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
