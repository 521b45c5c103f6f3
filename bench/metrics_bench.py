"""How much tuning from an engine's metrics loses against tuning from the exact trace.

    python bench/metrics_bench.py [--record bench/results/metrics_bench.md]

For each shipped trace (bench/traces/*.jsonl, simulated with the limits of
plans/llama3-8b-h100.yaml), the steps are turned into the histogram each engine would publish
(vLLM V1's buckets 1, 8, ..., 16384; vLLM 0.7's, the plan's capture sizes; graphplan's, one per
token count up to q * max_num_seqs for decode steps and the capture sizes, powers of two and
max_num_batched_tokens for mixed ones, docs/workload.md), rendered in the Prometheus text format,
read back by ``plan workload``'s code with each spread, tuned by ``plan optimize`` at the plan's
graph count, and the tuned sizes priced on the *real* trace. Baselines in the same run: the plan's
own list (vLLM's default) and the sizes tuned on the exact trace.

Bar: sizes tuned from vLLM V1's histogram (``--spread uniform``, the default) cut the real trace's
padded tokens by >= 30 % against the plan's list on every trace, at no more graphs.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

from graphplan.compiler import compile_plan
from graphplan.compiler.records import decode_token_range
from graphplan.compiler.tools import prom_text
from graphplan.compiler.tools.metrics import Options, workload_from_scrapes
from graphplan.compiler.tools.optimize import optimize
from graphplan.compiler.tools.trace import Trace, aggregate, check_trace, load_trace, padding

from machine import machine

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "plans" / "llama3-8b-h100.yaml"
TRACES = [ROOT / "bench" / "traces" / f"{n}.jsonl" for n in ("chat", "long_prompt")]
CUT_BAR = 30.0


def histogram_text(name: str, edges, tokens, counts, labels: str = "") -> list[str]:
    """``name`` as a Prometheus histogram of ``tokens`` (weighted by ``counts``)."""
    order = np.argsort(tokens)
    t, c = tokens[order], np.cumsum(counts[order])
    out = []
    for e in [*edges, "+Inf"]:
        at = len(t) if e == "+Inf" else np.searchsorted(t, e, side="right")
        total = int(c[at - 1]) if at else 0
        out.append(f'{name}_bucket{{{labels}le="{e}"}} {float(total)}')
    return out


def workload_of(lines: list[str], spread: str, max_tokens: int):
    scrape = prom_text.parse(("\n".join(lines) + "\n").encode(), "bench")
    w = workload_from_scrapes([scrape], Options(spread=spread, max_tokens=max_tokens))
    n, r, m, c = (np.array(x, dtype=np.int64) for x in zip(*w.rows))
    return aggregate(
        Trace(source="w", num_tokens=n, num_reqs=r, max_query_len=m, line=n, count=c), 1
    )


def shapes(table, work):
    """(label, Prometheus lines) of each engine's histogram of ``work``."""
    n, c, u = work.tokens, work.count, work.uniform
    sizes, top = list(table.capture_sizes), table.max_tokens
    mixed_edges = sorted(set(sizes) | {2**i for i in range(top.bit_length())} | {top})
    decode_edges = list(range(1, decode_token_range(table.q, table.max_num_seqs)[-1] + 1))
    return [
        (
            "vLLM V1 (1, 8, ..., 16384)",
            histogram_text(
                "vllm:iteration_tokens_total",
                [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
                n,
                c,
            ),
        ),
        (
            "vLLM 0.7 (the capture sizes)",
            histogram_text("vllm:iteration_tokens_total", sizes, n, c),
        ),
        (
            "graphplan (docs/workload.md)",
            histogram_text(
                "graphplan:iteration_tokens", decode_edges, n[u], c[u], 'routine="decode",'
            )
            + histogram_text(
                "graphplan:iteration_tokens", mixed_edges, n[~u], c[~u], 'routine="mixed",'
            ),
        ),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", help="also write the results as Markdown to this file")
    a = ap.parse_args(argv)
    where = machine()
    table = compile_plan(PLAN)
    k = len(table.graphs)
    lines = [
        f"plan {PLAN.relative_to(ROOT)}: vLLM default list, {len(table.capture_sizes)} sizes, "
        f"{k} graphs (the budget for every tuned list); padded tokens priced on the real trace",
        "",
        "| trace | tuned from | spread | sizes | graphs | padded tokens | cut vs plan | bar |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    ok = True
    for path in TRACES:
        trace = load_trace(path)
        check_trace(trace, table)
        work = aggregate(trace, table.q)
        exact = optimize(table, work, k)
        base = exact.before.padded_tokens
        cut = lambda p: 100.0 * (base - p) / base
        lines.append(
            f"| {path.name} | the plan's list (baseline) | - | {len(table.capture_sizes)} | {k} | {base} | - | |"
        )
        lines.append(
            f"| {path.name} | the exact trace | - | {len(exact.sizes)} | {exact.graphs} | "
            f"{exact.after.padded_tokens} | {cut(exact.after.padded_tokens):.1f} % | |"
        )
        for label, text in shapes(table, work):
            for spread in ("uniform", "upper"):
                res = optimize(table, workload_of(text, spread, table.max_tokens), k)
                real = padding(res.table, work).padded_tokens
                barred = label.startswith("vLLM V1") and spread == "uniform"
                good = cut(real) >= CUT_BAR and res.graphs <= k
                ok &= good or not barred
                verdict = (f">= {CUT_BAR:.0f} %: " + ("PASS" if good else "FAIL")) if barred else ""
                lines.append(
                    f"| {path.name} | {label} | {spread} | {len(res.sizes)} | {res.graphs} | "
                    f"{real} | {cut(real):.1f} % | {verdict} |"
                )
    lines += ["", f"overall: {'PASS' if ok else 'FAIL'}"]
    print("\n".join(lines))
    if a.record:
        head = [
            "# plan workload --from-metrics: tuning from a histogram against the exact trace",
            "",
            f"- date: {datetime.date.today().isoformat()}",
            f"- machine: {where}",
            "- command: `python bench/metrics_bench.py` (from the repository root)",
            "",
        ]
        Path(a.record).write_text("\n".join(head + lines) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
