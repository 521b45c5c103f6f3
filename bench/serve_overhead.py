"""Host overhead of a served decode step (issue 25): the step as clients of graphplan-serve see it
against the replay of the same decode graph, measured in one run, for one or more ways of serving
(``--variants``) side by side. GPU only: a result needs a CUDA device; ``--device cpu --shape
tiny`` checks the program.

    python bench/serve_overhead.py --random-weights --out bench/results/serve_overhead.md  # 8B, 64
    python bench/serve_overhead.py --random-weights --variants greedy,greedy+async,sampled+async
    python bench/serve_overhead.py --random-weights --device cpu --shape tiny --clients 4 \\
        --prompt-len 8 --max-tokens 24

A variant is ``greedy`` or ``sampled`` (temperature 0.8, top_p 0.95, seeded), then optionally
``+async`` (the server's ``--async-scheduling``), ``+fused`` (``--fused-sampler``) and ``+engine``
(no HTTP: the server's ``Engine`` in a child process, its tokens read from a queue as they come,
bench/engine_steps.py; what a served variant adds to its ``+engine`` twin is HTTP's share).

1. **Served step.** For each variant, a server (a subprocess, as bench/load_test.py starts it; the
   plan's seats set to ``--clients``) gets ``--clients`` streaming requests at once, each
   ``--prompt-len`` random prompt tokens and exactly ``--max-tokens`` output tokens
   (``ignore_eos``). Every step of the *steady window* (from the moment the last client has its
   first token, so no prompt is left to prefill, to the moment the first client has its last) is a
   decode step of all ``--clients`` requests, and each client receives one token per step: the
   gaps between a client's tokens inside the window are the served step's period, token to token,
   scheduling, batch build, replay, sampling, commit and the HTTP stream included.
2. **Replay.** After the last server has exited, the same model shape is built in this process and
   ``GraphRunner.step`` (copy in, replay of the FULL decode graph, slice out) followed by the LM head
   on its rows (the server's ``logits="rows"``) is timed at the same batch and the first variant's
   mean context, back to back (bench/real_scale.py's method).

3. **Sampler.** Then the variant's sampling step alone (``Sampler.sample`` of ``--clients`` rows
   with the variant's parameters, fused or not) is timed as a replayed CUDA graph
   (bench/sampling_bench.py's method): device time the server spends per step beside the replay,
   which is not the host's. Greedy rows take the argmax (tens of microseconds); sampled rows
   (top_p) sort and draw noise over the vocabulary (about a millisecond at 64 x 128256).

Host overhead = (median served step - replay - sampler) / median served step; the issue's bar is
<= 5 % at batch 64 on the 8B shape. The table also gives the older, stricter figure, (served step -
replay) / served step, which counts the sampler's kernels as overhead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from graphplan.server.core.sampling import Sampler
from graphplan.server.sampling_params import SamplingParams

import load_test
import real_scale
from llama_shapes import SHAPES
from sse_clients import metric, pct
from timing import graph_time_per_call, publish

BAR = 0.05


def parse_args(argv=None):
    p = load_test.parser(__doc__.split("\n\n")[0])
    p.set_defaults(clients=64, requests=1, disconnect=0.0)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--variants",
        default="greedy",
        help="comma-separated: greedy or sampled, each optionally +async, +fused and +engine "
        "(e.g. greedy,greedy+engine,greedy+async,sampled+async+fused)",
    )
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args(argv)
    if a.requests != 1 or a.long_prompt:
        p.error("serve_overhead sends one request per client and no long prompt")
    try:
        a.variants = [variant(v) for v in a.variants.split(",")]
    except ValueError as e:
        p.error(str(e))
    a.set = [f"scheduler.max_num_seqs={a.clients}", *a.set]
    return load_test.finish_args(a)


def variant(name: str) -> argparse.Namespace:
    """``greedy`` or ``sampled``, then any of ``+async``, ``+fused``, ``+engine``: the variant's
    switches."""
    kind, *extra = name.strip().split("+")
    if kind not in ("greedy", "sampled") or len(set(extra)) != len(extra):
        raise ValueError(
            f"--variants: {name!r} must be greedy or sampled, then +async, +fused, +engine"
        )
    if set(extra) - {"async", "fused", "engine"}:
        raise ValueError(f"--variants: {name!r}: the options are +async, +fused and +engine")
    return argparse.Namespace(
        name=name.strip(),
        sampled=kind == "sampled",
        async_scheduling="async" in extra,
        fused_sampler="fused" in extra,
        engine="engine" in extra,
    )


def sampler_step(a, v: argparse.Namespace) -> float:
    """Device seconds per sampling step of the variant's ``--clients`` rows, replayed as a CUDA
    graph, doing what the server's StepSampler does for them (its ``Work.of``): greedy rows
    without logprobs take the argmax; sampled rows (load_test's parameters: top_p, no penalties,
    no logprobs) the sampler with truncation, fused as the variant says."""
    device = torch.device(a.device)
    vocab = SHAPES[a.shape]["vocab_size"]
    logits = torch.randn(a.clients, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits = logits.to(device, torch.bfloat16)
    if not v.sampled:
        return graph_time_per_call(lambda: logits.argmax(dim=-1), device, a.iters)
    s = Sampler(a.clients, vocab, device=device, penalties=False, fused=v.fused_sampler,
                rng=random.Random(0))  # fmt: skip
    for slot in range(a.clients):
        s.set_row(slot, SamplingParams(**load_test.sampling_params(slot)), prompt_ids=[1])
    slots = s.load_slots(list(range(a.clients)))
    return graph_time_per_call(
        lambda: s.sample(logits, slots, logprobs=False, penalise=False), device, a.iters
    )


def workload(a, sampled: bool) -> list[list[dict]]:
    rng = random.Random(a.seed)
    vocab = SHAPES[a.shape]["vocab_size"]
    out = []
    for c in range(a.clients):
        prompt = [rng.randrange(1, vocab) for _ in range(a.prompt_len)]
        body = load_test.request_body(prompt, a.max_tokens, c if sampled else None)
        out.append([{"body": body, "disconnect_after": None, "kind": "steady"}])
    return out


def steady_gaps(results) -> tuple[list[float], float, int]:
    """The token gaps (s) inside the steady window, its mean context, and how many tokens each
    client had when the window opened."""
    opens = max(r.token_times[0] for r in results)
    closes = min(r.token_times[-1] for r in results)
    gaps, first_in = [], []
    for r in results:
        ts = r.token_times
        inside = [i for i, t in enumerate(ts) if opens <= t <= closes]
        first_in += inside[:1]
        gaps += [ts[i] - ts[i - 1] for i in inside if i > 0 and ts[i - 1] >= opens]
    steps = statistics.mean(first_in) if first_in else 0
    return gaps, steps, len(first_in)


def replay_step(a, batch: int, ctx: int) -> tuple[float, float]:
    """Seconds per ``GraphRunner.step`` of the decode graph at ``batch`` x ``ctx``, and the model's
    build time."""
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    ns = argparse.Namespace(
        shape=a.shape,
        batches=[batch],
        contexts=[ctx],
        block_size=16,
        kv_fraction=0.85,
        iters=a.iters,
        repeats=5,
        logits="rows",  # the server's: the step, then the LM head on its rows
    )
    hf, load_s = real_scale.build_model(ns, device)
    rows: list[dict] = []
    real_scale.graphplan_steps(hf, ns, device, a.max_model_len, rows)
    if "step" not in rows[0]:
        raise SystemExit(f"serve_overhead: the replay could not run: {rows[0]['note']}")
    return rows[0]["step"], load_s


def engine_only(a, v: argparse.Namespace, work: list[list[dict]]) -> dict | None:
    """bench/engine_steps.py in a child process: the run's record as load_test.serve gives it."""
    cfg = dict(
        shape=a.shape,
        device=a.device,
        max_model_len=a.max_model_len,
        plan=str(a.plan),
        set=a.set,
        async_scheduling=v.async_scheduling,
        fused_sampler=v.fused_sampler,
        startup_timeout=a.startup_timeout,
        bodies=[client[0]["body"] for client in work],
    )
    cmd = [sys.executable, str(Path(__file__).with_name("engine_steps.py"))]
    child = subprocess.run(
        cmd, input=json.dumps(cfg), capture_output=True, text=True, timeout=a.startup_timeout + 600
    )
    if child.returncode != 0:
        print(child.stdout[-2000:] + child.stderr[-4000:], file=sys.stderr)
        print(f"serve_overhead: {v.name}: the engine run failed", file=sys.stderr)
        return None
    out = json.loads(child.stdout.strip().splitlines()[-1])
    results = [argparse.Namespace(**r) for r in out["results"]]
    shown = [cmd[0], "bench/engine_steps.py", "(no HTTP)", *load_test.server_switches(v)]
    return dict(cmd=shown, results=results, startup=out["startup"], async_steps=out["async_steps"])


def served(a, v: argparse.Namespace) -> dict | None:
    """One variant's run: its steady-window token gaps and mean context, or None (said on
    stderr) when it failed."""
    work = workload(a, v.sampled)
    if v.engine:
        run = engine_only(a, v, work)
    else:
        run = load_test.serve(argparse.Namespace(**{**vars(a), **vars(v)}), work)
        if run is not None:
            run["async_steps"] = int(metric(run["after"], "graphplan_server_async_steps_total"))
    if run is None:
        return None
    results = run["results"]
    bad = [r for r in results if r.error or len(r.token_times) != a.max_tokens]
    if bad:
        print(f"serve_overhead: {v.name}: {len(bad)} requests failed: {bad[0]}", file=sys.stderr)
        return None
    gaps, tokens_before, clients_in = steady_gaps(results)
    if len(gaps) < 10:
        print(f"serve_overhead: {v.name}: the steady window is too short; raise --max-tokens",
              file=sys.stderr)  # fmt: skip
        return None
    ctx = a.prompt_len + int(tokens_before + (a.max_tokens - tokens_before) / 2)
    return dict(run, gaps=gaps, ctx=ctx, clients_in=clients_in)


def main(argv=None) -> int:
    a = parse_args(argv)
    runs = []
    for v in a.variants:
        run = served(a, v)
        if run is None:
            return 1
        runs.append((v, run))
    ctx = runs[0][1]["ctx"]
    replay, load_s = replay_step(a, a.clients, ctx)
    lines = [
        f"# serve_overhead ({a.shape}), {a.device_name}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"command: `python bench/serve_overhead.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        f"torch {torch.__version__}, python {platform.python_version()}; replay model built in "
        f"{load_s:.1f} s",
        "",
        f"- {a.clients} streaming clients, {a.prompt_len} prompt tokens, {a.max_tokens} output "
        f"tokens each (sampled: temperature 0.8, top_p 0.95, seeded)",
        f"- replay (GraphRunner.step of the decode graph, then the LM head on its rows, as the "
        f"server runs them; batch {a.clients}, context {ctx}): "
        f"{replay * 1e3:.2f} ms",
        f"- sampler: the variant's sampling step of {a.clients} rows, replayed as a CUDA graph "
        "(device time beside the replay)",
        "",
        "| variant | steady window | served step p10 / median / p90 | replay + sampler "
        "| host overhead | bar | served - replay | async steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for v, run in runs:
        gaps = run["gaps"]
        step = statistics.median(gaps)
        sampler = sampler_step(a, v)
        device = replay + sampler
        overhead = (step - device) / step
        ok &= overhead <= BAR
        lines.append(
            f"| {v.name} | {run['clients_in']} clients, {len(gaps)} gaps, context {run['ctx']} "
            f"| {pct(gaps, 10) * 1e3:.2f} / {step * 1e3:.2f} / {pct(gaps, 90) * 1e3:.2f} ms "
            f"| {replay * 1e3:.2f} + {sampler * 1e3:.2f} ms "
            f"| **{(step - device) * 1e3:.2f} ms = {overhead:.1%}** "
            f"| {'met' if overhead <= BAR else 'MISSED'} (<= {BAR:.0%}) "
            f"| {(step - replay) * 1e3:.2f} ms = {(step - replay) / step:.1%} "
            f"| {run['async_steps']} |"
        )
    lines.append("")
    for v, run in runs:
        lines.append(
            f"- {v.name}: server `{shlex.join(run['cmd'][1:])}`, start-up {run['startup']:.1f} s"
        )
    publish("\n".join(lines) + "\n", str(a.out) if a.out else None)
    return 0 if ok or a.device == "cpu" else 2


if __name__ == "__main__":
    sys.exit(main())
