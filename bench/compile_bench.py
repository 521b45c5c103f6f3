"""Benchmark the compiler: in-process compile, ``plan compile`` wall clock, ``route()`` per call.

    python bench/compile_bench.py [--record bench/results/compile_bench.md]
    python bench/compile_bench.py --route-only     # bar 3 alone, in seconds (after a router change)

Bars (issue 2), on the largest shipped plan (plans/large-65k-lora8-dp8.yaml: 65536 tokens, LoRA 8,
DP 8 + DBO) and the vLLM-default plan (plans/llama3-8b-h100.yaml):
1. in-process ``compile_plan`` median <= 50 ms. *warm*: median of 30 calls in one process after
   one call; *cold*: the first call in a fresh process whose imports are already done (what it
   pays on top of imports: schema file, validator, first-use caches), median of 7 processes;
2. ``plan compile PLAN -o table.json`` wall clock as a subprocess (the installed console script,
   else ``python -m graphplan.compiler.cli``) median of 10 <= 0.5 s; ``python -m graphplan.compiler.cli`` is reported
   beside it;
3. ``route()`` median per call <= 1 us over a realistic mix of 20000 batches (60 % uniform decode,
   40 % mixed; LoRA counts drawn when the plan has LoRA; on a DP plan every step is a route plus
   the DP re-dispatch with allow=/pad_to=/ubatched=, as runtime/dp does), median of 15 loops,
   loop overhead included. The baseline, measured in the same run, is the same loop calling a
   no-op function with the same arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from graphplan.compiler import compile_plan

from machine import machine

ROOT = Path(__file__).resolve().parents[1]

PLANS = [ROOT / "plans" / "large-65k-lora8-dp8.yaml", ROOT / "plans" / "llama3-8b-h100.yaml"]
COMPILE_BAR_MS, CLI_BAR_S, ROUTE_BAR_NS = 50.0, 0.5, 1000.0

_COLD = """
import json, sys, time
import graphplan.compiler.load, graphplan.compiler.resolve, jsonschema, yaml
from graphplan.compiler import compile_plan
t0 = time.perf_counter()
compile_plan(sys.argv[1])
print(json.dumps(time.perf_counter() - t0))
"""


def compile_warm(plan: Path, n: int = 30) -> float:
    compile_plan(plan)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        compile_plan(plan)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compile_cold(plan: Path, n: int = 7) -> float:
    times = []
    for _ in range(n):
        out = subprocess.run(
            [sys.executable, "-c", _COLD, str(plan)],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        times.append(json.loads(out.stdout))
    return statistics.median(times)


def plan_script() -> list[str] | None:
    """The installed ``plan`` console script next to this interpreter (not a pyenv shim)."""
    script = Path(sys.executable).parent / "plan"
    return [str(script)] if script.exists() else None


def cli_wall(cmd: list[str], plan: Path, n: int = 10) -> float:
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "table.json"
        for _ in range(n + 1):
            t0 = time.perf_counter()
            subprocess.run(
                [*cmd, "compile", str(plan), "-o", str(out)],
                cwd=ROOT,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first run warms the page cache


def batch_mix(t, n: int = 20000, seed: int = 0) -> list[tuple]:
    """(num_tokens, num_reqs, max_query_len, num_active_loras, redispatch kwargs or None)."""
    rnd = random.Random(seed)
    q, seqs, top = t.q, t.max_num_seqs, t.max_tokens
    counts = len(t.settings.lora_case_of_count)
    dp = t.settings.data_parallel_size > 1
    largest = t.capture_sizes[-1] if t.capture_sizes else top
    out = []
    for _ in range(n):
        loras = rnd.randrange(counts)
        if rnd.random() < 0.6:  # uniform decode, mostly within the captured range
            reqs = rnd.randint(1, min(seqs, top // q, max(1, largest // q)))
            tokens, mql = q * reqs, q
        else:  # a chunked prefill with some decodes beside it
            tokens = rnd.randint(2, min(top, 2 * largest))
            reqs = rnd.randint(1, min(seqs, tokens))
            mql = tokens - reqs + 1
        kw = None
        if dp:  # what the other ranks agreed on: a weaker or equal mode, a larger size
            agreed = min(top, tokens + rnd.choice([0, 0, 8, 64]))
            kw = {
                "allow": rnd.choice(["FULL", "FULL", "PIECEWISE", "NONE"]),
                "pad_to": agreed,
                "ubatched": rnd.random() < 0.3,
            }
        out.append((tokens, reqs, mql, loras, kw))
    return out


def _noop(
    num_tokens,
    num_reqs=None,
    max_query_len=None,
    num_active_loras=0,
    *,
    allow=None,
    pad_to=None,
    ubatched=False,
):
    return None


def time_loop(fn, batches, repeats: int = 15) -> tuple[float, float]:
    """(median, best) ns per call of fn over the batches (a DP step is two calls)."""
    plain = [(a, b, c, d) for a, b, c, d, kw in batches if kw is None]
    dp = [
        (a, b, c, d, kw["allow"], kw["pad_to"], kw["ubatched"])
        for a, b, c, d, kw in batches
        if kw is not None
    ]
    calls = len(plain) + 2 * len(dp)
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for a, b, c, d in plain:
            fn(a, b, c, d)
        for a, b, c, d, mode, agreed, ub in dp:  # as runtime/dp/runner.py calls it
            fn(a, b, c, d)
            fn(a, b, c, d, allow=mode, pad_to=agreed, ubatched=ub)
        per.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(per), min(per)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", help="also write the results as Markdown to this file")
    ap.add_argument(
        "--route-only",
        action="store_true",
        help="measure route() only (bar 3), skipping the compile and CLI timings",
    )
    args = ap.parse_args(argv)
    script = plan_script()
    rows, ok = [], True

    def row(metric, plan, value, bar, passed, note=""):
        nonlocal ok
        ok &= passed if passed is not None else True
        rows.append(
            (
                metric,
                plan,
                value,
                bar,
                "-" if passed is None else ("PASS" if passed else "FAIL"),
                note,
            )
        )

    for plan in PLANS:
        name = plan.name
        t = compile_plan(plan)
        note = f"{len(t.graphs)} graphs, {len(t.capture_sizes)} sizes"
        # in-process timings first, before any subprocess disturbs the caches
        warm = compile_warm(plan) * 1e3 if not args.route_only else 0.0
        batches = batch_mix(t)
        for a, b, c, d, kw in batches[:2000]:  # warm the lazily built outcome rows
            t.route(a, b, c, d)
            if kw:
                t.route(a, b, c, d, **kw)
        route_ns, route_best = time_loop(t.route, batches)
        base_ns, _ = time_loop(_noop, batches)
        if not args.route_only:
            cold = compile_cold(plan) * 1e3
            row(
                "compile, in-process, cold",
                name,
                f"{cold:.1f} ms",
                f"<= {COMPILE_BAR_MS:.0f} ms",
                cold <= COMPILE_BAR_MS,
                note,
            )
            row(
                "compile, in-process, warm",
                name,
                f"{warm:.1f} ms",
                f"<= {COMPILE_BAR_MS:.0f} ms",
                warm <= COMPILE_BAR_MS,
                note,
            )
            if script:
                wall = cli_wall(script, plan)
                row(
                    "`plan compile -o`, wall clock",
                    name,
                    f"{wall:.3f} s",
                    f"<= {CLI_BAR_S} s",
                    wall <= CLI_BAR_S,
                    "console script",
                )
            wall = cli_wall([sys.executable, "-m", "graphplan.compiler.cli"], plan)
            row(
                "`python -m graphplan.compiler.cli compile -o`",
                name,
                f"{wall:.3f} s",
                f"<= {CLI_BAR_S} s",
                wall <= CLI_BAR_S if not script else None,
                "" if not script else "no bar: beside it",
            )
        kinds = "route + DP re-dispatch per step" if batches[0][4] else "route per step"
        row(
            "route(), per call",
            name,
            f"{route_ns:.0f} ns",
            f"<= {ROUTE_BAR_NS:.0f} ns",
            route_ns <= ROUTE_BAR_NS,
            f"{kinds}; best loop {route_best:.0f} ns; "
            f"{route_ns / base_ns:.1f}x a no-op call ({base_ns:.0f} ns)",
        )

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = ("| metric | plan | value | bar | result | notes |", "|---|---|---:|---|---|---|")
    lines = [
        *header,
        *(f"| {' | '.join(r)} |" for r in rows),
        "",
        f"overall: {'PASS' if ok else 'FAIL'}  (1-minute load average {load:.2f}; timings "
        "on a busy machine run slow)",
    ]
    print("\n".join(lines))
    if args.record:
        cmd = "python bench/compile_bench.py" + (f" --record {args.record}" if args.record else "")
        text = [
            "# compiler benchmark",
            "",
            f"- date: {datetime.date.today().isoformat()}",
            f"- machine: {machine(load=False)} (a CPU benchmark: the compiler never touches a GPU)",
            f"- 1-minute load average when the run ended: {load:.2f}",
            f"- command: `{cmd}` (from the repository root)",
            "",
            *(line for line in __doc__.split("\n\n", 2)[2].splitlines()),
            "",
            *lines,
            "",
        ]
        Path(args.record).write_text("\n".join(text))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
