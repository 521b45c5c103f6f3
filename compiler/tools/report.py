"""``plan report``: one self-contained HTML page about a compiled plan (no JavaScript, no external
resources): the resolved plan, every diagnostic, the graphs in capture order, padding and graph
charts as inline SVG, the memory estimate, with a trace the padding that workload pays, and from
``plan optimize --report`` the tuning: the plan's list against the tuned one (padding, graphs,
capture time, memory) and the trade-off curve of padding against the graph budget.

The page is rendered with Jinja2 from ``compiler/templates/report.html.j2`` (package data).
"""

from __future__ import annotations

from importlib import resources

from ..fileio import write_atomic
from ..records import RuntimeMode, decode_token_range, padded_num_reqs
from ..table import DispatchTable
from ..table_format import graph_json
from . import report_charts as charts
from .memory import MIB, capture_model, estimate
from .summary import compact_sizes, coverage, padding_profile
from .trace import LeftOut, Padding, Workload, padding

MAX_GRAPH_ROWS = 2000
ROUTINE_LABEL = {
    "full_decode": "FULL decode",
    "full_decode_ubatched": "FULL decode, ubatched",
    "full_mixed": "FULL mixed",
    "piecewise": "PIECEWISE",
}


def _limit(table: DispatchTable, routine: str) -> int:
    """Largest batch of a routine: decode batches have at most max_num_seqs requests."""
    if routine == "decode":
        return min(table.max_tokens, decode_token_range(table.q, table.max_num_seqs)[-1])
    return table.max_tokens


def _beyond(table: DispatchTable, routine: str, top: int) -> str:
    """Where the first batch above a routine's largest size goes."""
    if routine == "decode":
        n = (top // table.q + 1) * table.q  # the next multiple of q
        if n > _limit(table, routine):
            return ""
        route = table.route(n, padded_num_reqs(n, table.max_num_seqs, table.q), table.q)
    else:
        if top >= table.max_tokens:
            return ""
        n, route = top + 1, table.route(top + 1)
    return f"above {top}: " + ("eager" if route.mode is RuntimeMode.NONE else route.mode.name)


def _diagnostics(table: DispatchTable, located) -> list[dict]:
    out = []
    for d in located if located is not None else table.diagnostics:
        d = (
            d
            if isinstance(d, dict)
            else {**d.to_json(), "file": d.file, "line": d.line, "col": d.col}
        )
        where = f"{d.get('file', '')}:{d['line']}:{d['col']}" if d.get("line") else ""
        out.append({**d, "where": where, "downgrade": d["code"] == "mode-downgrade"})
    return out


def _resolved_rows(table: DispatchTable) -> list[tuple[str, str]]:
    r = table.settings
    mode = (
        r.mode.name
        if r.mode is r.requested_mode
        else f"{r.mode.name} (requested {r.requested_mode.name})"
    )
    rows = [
        ("mode", mode),
        ("decode routine", r.decode_mode.name),
        ("mixed routine", r.mixed_mode.name),
        ("attention support", r.attention_support.name),
        ("decode_query_len (q)", str(r.decode_query_len)),
        ("max_num_seqs", str(r.max_num_seqs)),
        ("max_num_batched_tokens", str(r.max_num_batched_tokens)),
        ("capture sizes", f"{len(r.capture_sizes)}: {compact_sizes(r.capture_sizes)}"),
        ("LoRA cases", ", ".join(map(str, r.lora_cases)) if r.lora_enabled else "off"),
        ("data parallel size", str(r.data_parallel_size)),
        (
            "tensor parallel size",
            f"{r.tensor_parallel_size} (world {r.data_parallel_size * r.tensor_parallel_size} "
            "ranks; graph memory and capture time are per rank)",
        ),
    ]
    ub = r.ubatch
    rows.append(
        (
            "micro-batching",
            f"{ub.num_ubatches} ubatches, decode >= "
            f"{ub.decode_token_threshold}, prefill >= {ub.prefill_token_threshold}, "
            f"plain twins {'on' if ub.plain_twins else 'off'}"
            if ub.enabled
            else "off",
        )
    )
    return rows


def _trace_section(
    table: DispatchTable, work: Workload, source: str, warnings=(), out: LeftOut | None = None
) -> dict:
    pad: Padding = padding(table, work)
    out = out or LeftOut(steps=pad.steps, left_out=0, reasons=())
    steps = max(out.steps, pad.steps)
    top = table.capture_sizes[-1] if table.capture_sizes else 1
    x_max = charts.nice_max(top * 1.15)
    hist_max = charts.nice_max(max(top * 1.15, int(work.tokens.max())))  # every step shows
    bins = 128
    hist = charts.histogram(work.tokens.tolist(), work.count.tolist(), hist_max, bins)
    return {
        "source": source,
        "pad": pad,
        "steps": steps,
        "left_out": out,
        # the headline: steps on graphs over every step of the trace, left-out ones included
        "graphed_share": pad.graphed_steps / steps if steps else 0.0,
        "top": top,
        "warnings": list(warnings),
        "above_top": int(work.count[work.tokens > top].sum()),
        "rows": [(name, row) for name, row in pad.routines.items() if row["steps"]],
        "hist_chart": charts.spike_chart(
            hist,
            hist_max,
            "num_tokens of the step",
            "steps",
            marks=table.capture_sizes,
            bar_tokens=hist_max / bins,
        ),
        "by_size_chart": charts.spike_chart(
            [(s, v[1]) for s, v in pad.by_size.items()],
            x_max,
            "capture size (tokens)",
            "padding tokens, all steps",
        ),
        "worst_sizes": sorted(pad.by_size.items(), key=lambda kv: -kv[1][1])[:10],
    }


def tuning_section(
    before: DispatchTable, res, work: Workload, profile=None, source: str = ""
) -> dict:
    """The plan's sizes against ``plan optimize``'s (``res``: an optimize.Result with a curve)."""
    rows = []
    for label, t, p in (
        ("plan (the current list)", before, res.before),
        ("tuned", res.table, res.after),
    ):
        mem = estimate(t, profile)
        rows.append(
            {
                "label": label,
                "sizes": len(t.capture_sizes),
                "compact": compact_sizes(t.capture_sizes),
                "graphs": len(t.graphs),
                "padded_tokens": p.padded_tokens,
                "per_step": p.per_step,
                "eager_steps": p.eager_steps,
                "capture_seconds": mem["capture_seconds"],
                "memory_mib": mem["total_mib"],
            }
        )
    steps = max(work.steps, 1)
    curve = [(g, c / steps) for g, c in res.curve]
    marks = [
        (len(before.graphs), res.before.per_step, "plan", "plan"),
        (res.graphs, res.after.per_step, "tuned", "tuned"),
    ]
    cut = res.before.padded_tokens - res.after.padded_tokens
    return {
        "source": source,
        "engine": (work.header or {}).get("engine"),
        "rows": rows,
        "limits": sorted(res.limits.items()),
        "budget": res.budget_graphs,
        "reduction_pct": 100.0 * cut / res.before.padded_tokens if res.before.padded_tokens else 0,
        "curve": curve,
        "chart": charts.tradeoff_chart(curve, marks),
        "capture_model": capture_model(profile)[2],
        "memory_model": "the built-in default profile"
        if profile is None
        else profile.get("source", "the given profile"),
    }


def build(
    table: DispatchTable,
    *,
    source: str,
    located=None,
    work: Workload | None = None,
    trace_source: str = "",
    profile: dict | None = None,
    trace_warnings=(),
    tuning: dict | None = None,
    trace_left_out: LeftOut | None = None,
) -> dict:
    """Everything the template shows, computed here so that tests can check the same numbers."""
    routines = []
    for c in coverage(table):
        step = table.q if c.routine == "decode" else 1
        stats = padding_profile(c.sizes, step)
        routines.append(
            {
                "routine": c.routine,
                "mode": c.mode,
                "sizes": c.sizes,
                "step": step,
                "compact": compact_sizes(c.sizes),
                **stats,
                "chart": charts.padding_chart(
                    c.sizes,
                    step,
                    _limit(table, c.routine),
                    (stats["worst_pad"], stats["worst_at"]),
                    _beyond(table, c.routine, c.sizes[-1]),
                ),
            }
        )
    per_routine: dict[str, int] = {}
    per_mode: dict[str, int] = {}
    for g in table.graphs:
        per_routine[g.routine] = per_routine.get(g.routine, 0) + 1
        per_mode[g.mode.name] = per_mode.get(g.mode.name, 0) + 1
    bars = [
        (ROUTINE_LABEL[r], n, "full" if r.startswith("full") else "piecewise")
        for r, n in sorted(per_routine.items())
    ]
    mem = estimate(table, profile)
    graphs = [graph_json(g) for g in table.graphs[:MAX_GRAPH_ROWS]]
    return {
        "title": f"graphplan report: {table.plan.get('name', 'plan')}",
        "name": table.plan.get("name", "plan"),
        "source": source,
        "fingerprint": table.fingerprint,
        "compiler_version": table.compiler_version,
        "resolved": _resolved_rows(table),
        "sizes": list(table.capture_sizes),
        "diagnostics": _diagnostics(table, located),
        "routines": routines,
        "max_tokens": table.max_tokens,
        "per_mode": sorted(per_mode.items()),
        "num_graphs": len(table.graphs),
        "mode_chart": charts.bar_chart(bars, "graphs") if bars else None,
        "graphs": graphs,
        "graphs_left_out": len(table.graphs) - len(graphs),
        "memory": mem,
        "mib": MIB,
        "trace": _trace_section(table, work, trace_source, trace_warnings, trace_left_out)
        if work is not None
        else None,
        "tuning": tuning,
    }


def render(context: dict) -> str:
    import jinja2

    text = (
        resources.files("graphplan.compiler")
        .joinpath("templates/report.html.j2")
        .read_text("utf-8")
    )
    env = jinja2.Environment(
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True
    )
    return env.from_string(text).render(**context)


def write_report(path, context: dict) -> None:
    write_atomic(path, render(context).encode("utf-8"))
