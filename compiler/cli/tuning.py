"""The tuning half of the ``plan`` CLI: ``report``, ``optimize`` and ``compile --memory``.

``compiler.cli.build_parser`` calls ``add_tuning_commands``; the exit codes and error style are
the CLI's (0 ok, 2 invalid plan, 1 anything else; no traceback for bad input; atomic writes).
"""

from __future__ import annotations

import json

MIB = 1024 * 1024


def memory_estimate(table, profile_path: str | None) -> dict:
    from ..tools.memory import estimate, load_profile

    return estimate(table, load_profile(profile_path) if profile_path else None)


def _workload(path: str, table):
    from ..tools.trace import aggregate, check_trace, load_trace

    trace = load_trace(path)
    check_trace(trace, table)
    return aggregate(trace, table.q)


def _report_workload(path: str, table):
    """(workload, warnings, left out): a report prices what fits the plan, warns about the rest
    and counts every step in its headline."""
    import sys

    from ..tools.trace import aggregate, fit_trace, left_out, load_trace

    trace = load_trace(path)
    out = left_out(trace, table)
    trace, warnings = fit_trace(trace, table)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return aggregate(trace, table.q), warnings, out


def cmd_report(a) -> int:
    from ..plan_or_table import is_table_path
    from ..tools.memory import load_profile
    from ..tools.report import build, write_report
    from .inputs import load_any
    from .outputs import check_output

    check_output(a.output, [a.plan, a.trace, a.profile])
    table, diags = load_any(a.plan, a.set)
    profile = load_profile(a.profile) if a.profile else None
    work, warnings, out = _report_workload(a.trace, table) if a.trace else (None, [], None)
    ctx = build(
        table,
        source=a.plan,
        located=None if is_table_path(a.plan) else diags,
        work=work,
        trace_source=a.trace or "",
        profile=profile,
        trace_warnings=warnings,
        trace_left_out=out,
    )
    write_report(a.output, ctx)
    if a.format == "json":
        print(
            json.dumps(
                {
                    "output": a.output,
                    "graphs": len(table.graphs),
                    "diagnostics": len(ctx["diagnostics"]),
                    "memory_bytes": ctx["memory"]["total_bytes"],
                    "trace": _trace_json(ctx["trace"]),
                },
                sort_keys=True,
            )
        )
    else:
        t = ctx["trace"]
        print(
            f"wrote {a.output}: {len(table.graphs)} graphs, {len(ctx['diagnostics'])} "
            f"diagnostic(s), {ctx['memory']['total_mib']:.1f} MiB estimated graph memory"
            + (
                f"; trace: {100 * t['graphed_share']:.1f} % of all {t['steps']} steps on graphs"
                + (f"; {t['left_out']}" if t["left_out"].left_out else "")
                + f"; {t['pad'].per_graph_step:.3f} padding tokens per graph step, "
                f"{t['pad'].eager_steps} eager steps"
                if t
                else ""
            )
        )
    return 0


def _trace_json(t) -> dict | None:
    if not t:
        return None
    p, out = t["pad"], t["left_out"]
    return {
        "steps": t["steps"],
        "priced_steps": p.steps,
        "left_out_steps": out.left_out,
        "left_out": dict(out.reasons),
        "graphed_steps": p.graphed_steps,
        "eager_steps": p.eager_steps,
        "graphed_share": t["graphed_share"],
        "padded_tokens": p.padded_tokens,
        "padding_per_graph_step": p.per_graph_step,
        "warnings": list(t["warnings"]),
    }


def _header(a, res, trace_steps: int, above: int, graphs_before: int) -> list[str]:
    from ..table_format import COMPILER_VERSION
    from ..tools.tuned_plan import HEADER_MARK

    b, f = res.before, res.after
    cut = f", {0.0 - _cut(b.padded_tokens, f.padded_tokens):+.1f} %" if b.padded_tokens else ""
    return [
        f"{HEADER_MARK} (graphplan {COMPILER_VERSION}) from {a.plan}",
        f"#   trace {a.trace}: {trace_steps} steps, {trace_steps - above} at or below the "
        f"largest size {res.top}",
        f"#   expected padding {b.per_step:.3f} -> {f.per_step:.3f} tokens per step "
        f"({b.padded_tokens} -> {f.padded_tokens} padded tokens{cut})",
        f"#   graphs {graphs_before} -> {res.graphs} (budget {res.budget_graphs}); "
        f"eager steps {b.eager_steps} -> "
        f"{f.eager_steps}",
    ]


def _cut(before: int, after: int) -> float:
    """Percent fewer padded tokens after than before (0 when there was none)."""
    return 100.0 * (before - after) / before if before else 0.0


def cmd_optimize(a) -> int:
    from ..fileio import write_atomic
    from ..tools.memory import estimate, load_profile
    from ..tools.optimize import optimize, rank_start_sizes
    from ..tools.summary import compact_sizes
    from ..tools.tuned_plan import check_tuned, raw_plan, tuned_plan_text
    from . import tuned_output
    from .inputs import UsageError, load_any, parse_overrides
    from .outputs import check_output

    check_output(a.output, [a.plan, a.trace, a.profile])
    check_output(a.report, [a.plan, a.trace, a.profile])
    if a.report and a.output and a.report == a.output:
        raise UsageError("plan optimize: --report and -o name the same file; give two names")
    table, diags = load_any(a.plan, a.set)
    profile = load_profile(a.profile) if a.profile else None
    work = _workload(a.trace, table)
    pins = tuned_output.pins_of(table.plan, a.pin)
    budget = a.memory_budget * MIB if a.memory_budget is not None else None
    max_graphs = a.max_graphs if a.max_graphs is not None else len(table.graphs)
    res = optimize(
        table,
        work,
        max_graphs,
        pins=pins,
        max_size=a.max_size,
        memory_budget=budget,
        capture_budget=a.budget_capture_seconds,
        profile=profile,
        keep_small=not a.no_small,
        curve_graphs=max(max_graphs, len(table.graphs)) * 3 // 2 if a.report else None,
    )
    outside = outside_trace(table, res.table, res.top)
    above = int(work.count[work.tokens > res.top].sum())
    header = _header(a, res, work.steps, above, len(table.graphs))
    mem_before, mem_after = estimate(table, profile), estimate(res.table, profile)
    cap = (mem_before["capture_seconds"], mem_after["capture_seconds"])
    header += tuned_output.header_lines(a, res, work, len(table.graphs), cap)
    notes = [*tuned_output.list_notes(table.plan), *res.notes, *tuned_output.workload_notes(work)]
    engine = tuned_output.engine_of(work)
    if a.start_graphs is not None and a.start_graphs < 0:
        from ..tools.optimize import OptimizeError

        raise OptimizeError(f"--start-graphs {a.start_graphs}: give a count >= 0")
    start = (
        rank_start_sizes(res.after, res.sizes, a.start_graphs)
        if a.start_graphs is not None
        else None
    )
    if start is not None:
        header.append(
            f"#   on-demand capture: at start sizes {list(start)} (the "
            f"{a.start_graphs} most used by the trace and the largest)"
        )
    if a.output:
        data, comments = raw_plan(a.plan, parse_overrides(a.set, a.plan))
        text = tuned_plan_text(data, res.sizes, header, comments, start)
        check_tuned(text, res.sizes)
        write_atomic(a.output, text.encode("utf-8"))
    if a.report:
        tuned_output.write_report(a.report, a, table, res, work, profile)
    if a.format == "json":
        side = lambda t, p, m: {
            "sizes": list(t.capture_sizes),
            "graphs": len(t.graphs),
            "padded_tokens": p.padded_tokens,
            "per_step": p.per_step,
            "eager_steps": p.eager_steps,
            "memory_bytes": m["total_bytes"],
            "capture_seconds": m["capture_seconds"],
        }
        print(
            json.dumps(
                {
                    "steps": work.steps,
                    "top": res.top,
                    "budget_graphs": res.budget_graphs,
                    "before": side(table, res.before, mem_before),
                    "after": side(res.table, res.after, mem_after),
                    "reduction_pct": _cut(res.before.padded_tokens, res.after.padded_tokens),
                    "notes": notes,
                    "kept": [{"size": s, "why": w} for s, w in res.kept],
                    "outside_trace": outside,
                    "start_sizes": list(start) if start is not None else None,
                    "output": a.output,
                    "report": a.report,
                    "limits": res.limits,
                    "engine": engine,
                    "prediction": tuned_output.prediction(a, res, work, len(table.graphs)),
                    "curve": [list(p) for p in res.curve],
                },
                sort_keys=True,
            )
        )
        return 0
    decode = int(work.count[work.uniform].sum())
    print(
        f"trace {a.trace}: {work.steps} steps ({decode} uniform decode, {work.steps - decode} "
        f"mixed), {work.steps - above} at or below the largest size {res.top}"
    )
    print(f"graph budget: {res.budget_graphs} graphs ({tuned_output.limit_text(res, a, profile)})")
    for note in notes:
        print(f"note: {note}")
    print(
        f"\n{'':<18} {'sizes':>6} {'graphs':>7} {'padded tokens':>14} {'per step':>9} "
        f"{'eager steps':>12} {'memory':>11} {'capture':>8}"
    )
    for label, t, p, m in (  # memory and capture time: estimates (tools/memory.py)
        ("before (plan)", table, res.before, mem_before),
        ("after (optimized)", res.table, res.after, mem_after),
    ):
        print(
            f"{label:<18} {len(t.capture_sizes):>6} {len(t.graphs):>7} {p.padded_tokens:>14} "
            f"{p.per_step:>9.3f} {p.eager_steps:>12} {m['total_mib']:>7.1f} MiB "
            f"{m['capture_seconds']:>6.2f} s"
        )
    print(
        f"\npadded tokens: {0.0 - _cut(res.before.padded_tokens, res.after.padded_tokens):+.1f} %"
    )
    print(f"sizes before: {compact_sizes(table.capture_sizes)}")
    print(f"sizes after:  {compact_sizes(res.sizes)}")
    print("\n".join(tuned_output.kept_lines(res)))
    if start is not None:
        print(
            f"on-demand capture: at start sizes {list(start)} (the {a.start_graphs} most used "
            "by the trace and the largest); the rest on first use"
        )
    print("\n".join(outside_lines(outside)))
    for line in tuned_output.engine_lines(engine, a.output):
        print(line)
    print(f"wrote {a.output}" if a.output else "(no plan written; add -o tuned.yaml)")
    if a.report:
        print(f"wrote {a.report} (the tuned plan, its padding, and the trade-off curve)")
    return 0


def outside_trace(before, after, top: int) -> dict:
    """What the plan and the tuned plan cost for batches the trace did not show: the smallest
    size (what a 1-token step pads to), the worst padding of any batch per routine (trace or
    not), and where eager starts."""
    from ..tools.summary import coverage

    worst: dict[str, dict[str, dict | None]] = {}  # "routine mode" -> side -> worst padding
    for side, t in (("before", before), ("after", after)):
        for c in coverage(t):
            row = worst.setdefault(f"{c.routine} {c.mode}", {"before": None, "after": None})
            row[side] = {"tokens": c.worst_pad, "at": c.worst_at}
    small = lambda t: t.capture_sizes[0] if t.capture_sizes else None
    return {
        "smallest_size": {"before": small(before), "after": small(after)},
        "worst_padding": worst,
        "eager_above": {
            "before": before.capture_sizes[-1] if before.capture_sizes else 0,
            "after": top,
        },
    }


def outside_lines(o: dict) -> list[str]:
    s = o["smallest_size"]
    lines = [
        "outside the trace (any batch, seen or not):",
        f"  smallest size {s['before']} -> {s['after']}"
        + (f" (a 1-token step pads to {s['after']})" if s["after"] and s["after"] > 1 else ""),
    ]
    fmt = lambda w: "-" if w is None else f"{w['tokens']} @ {w['at']}"
    for name, w in o["worst_padding"].items():
        lines.append(f"  worst padding, {name}: {fmt(w['before'])} -> {fmt(w['after'])} tokens")
    e = o["eager_above"]
    lines.append(f"  eager above {e['before']} -> {e['after']} tokens")
    return lines


def add_tuning_commands(sub, common) -> None:
    sp = sub.add_parser("report", help="write a self-contained HTML report of a plan or table")
    sp.add_argument("plan", help="a plan or a compiled table.json")
    sp.add_argument("-o", "--output", required=True, help="where to write report.html (atomically)")
    sp.add_argument("--trace", help="a JSONL trace of steps: adds the padding that workload pays")
    sp.add_argument("--profile", help="a calibrated memory profile (default: a built-in guess)")
    common(sp)
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("optimize", help="choose capture sizes that minimise a trace's padding")
    sp.add_argument("plan", help="a plan (or table.json) whose capture sizes to tune")
    sp.add_argument(
        "--trace",
        required=True,
        help="JSONL: one {num_tokens, num_reqs, max_query_len} object per step",
    )
    sp.add_argument(
        "--max-graphs",
        "--budget-graphs",
        type=int,
        metavar="K",
        help="graph budget, all routines and LoRA cases (default: the plan's count)",
    )
    sp.add_argument(
        "--budget-capture-seconds",
        type=float,
        metavar="S",
        help="capture-time budget in seconds, by the capture-time model (a calibrated "
        "--profile's per_graph_capture_seconds, else 0.1 s per graph)",
    )
    sp.add_argument(
        "--memory-budget",
        type=float,
        metavar="MiB",
        help="graph-pool budget in MiB, by the memory model (see --profile)",
    )
    sp.add_argument("--profile", help="a calibrated memory profile (default: a built-in guess)")
    sp.add_argument(
        "--pin",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="keep capture size N (repeatable)",
    )
    sp.add_argument(
        "--max-size",
        type=int,
        metavar="N",
        help="largest capture size (default: the plan's); steps above run eager",
    )
    sp.add_argument(
        "--no-small",
        action="store_true",
        help="let the plan's sizes below the trace's smallest step go (by default "
        "they are kept, so batches smaller than any in the trace still pad little)",
    )
    sp.add_argument(
        "--start-graphs",
        type=int,
        metavar="K",
        help="turn on on-demand capture in the tuned plan: capture at start the K "
        "sizes most steps of the trace land on, and the largest; the rest on first use",
    )
    sp.add_argument("-o", "--output", help="where to write the tuned plan YAML (atomically)")
    sp.add_argument(
        "--report",
        metavar="HTML",
        help="also write an HTML report: the plan's list against the tuned one (padding, "
        "graphs, capture time, memory) and the padding-vs-graphs trade-off curve",
    )
    common(sp)
    sp.set_defaults(fn=cmd_optimize)

    from .workload import add_workload_command

    add_workload_command(sub, common)
