"""What ``plan optimize`` says beyond the sizes: the budgets as graph counts, the capture time, the
engine the workload came from (and how to hand the tuned plan back to it), the prediction it
records in the tuned plan's header for ``plan export``, and the ``--report`` page."""

from __future__ import annotations

EXPORTABLE = ("vllm", "sglang")


def engine_of(work) -> str | None:
    return (work.header or {}).get("engine")


def prediction(a, res, work, graphs_before: int) -> dict:
    b, f = res.before, res.after
    cut = 100.0 * (b.padded_tokens - f.padded_tokens) / b.padded_tokens if b.padded_tokens else 0
    return {
        "engine": engine_of(work),
        "workload": a.trace,
        "sizes": [int(s) for s in res.sizes],
        "graphs_before": graphs_before,
        "graphs_after": res.graphs,
        "per_step_before": round(b.per_step, 6),
        "per_step_after": round(f.per_step, 6),
        "reduction_pct": round(cut, 3),
    }


def pins_of(plan: dict, flag_pins) -> dict[int, str]:
    """The sizes to keep and why: the plan's ``cudagraph.pinned_sizes``, then ``--pin``."""
    pins = {int(p): "cudagraph.pinned_sizes" for p in plan["cudagraph"].get("pinned_sizes", [])}
    pins.update((int(p), "--pin") for p in flag_pins)
    return pins


def list_notes(plan: dict) -> list[str]:
    """What ``plan optimize`` does with a plan's explicit list (it tunes it, as a preset)."""
    if not isinstance(plan["cudagraph"]["capture_sizes"], list):
        return []
    return [
        "the plan lists its capture sizes explicitly (as an imported engine config does): they "
        "are tuned like a preset's; to keep a size, pin it (--pin N, or cudagraph.pinned_sizes "
        "in the plan)"
    ]


def kept_lines(res) -> list[str]:
    """One line per reason a size was kept whatever the trace says."""
    from ..tools.summary import compact_sizes

    by_why: dict[str, list[int]] = {}
    for size, why in res.kept:
        by_why.setdefault(why, []).append(size)
    if not by_why:
        return ["kept: no size is pinned: every size was chosen for the trace"]
    return [f"kept: {compact_sizes(s)} ({why})" for why, s in by_why.items()]


def workload_notes(work) -> list[str]:
    """Warnings about how the workload was made, from its header."""
    h = work.header or {}
    if h.get("spread") == "upper":
        return [
            "the workload puts each histogram bucket's steps at its upper edge (--spread upper): "
            "a worst case to price a list with, but sizes tuned on it fit those edges only and "
            "pad real steps far more (bench/results/metrics_bench.md); tune on --spread uniform"
        ]
    return []


def header_lines(a, res, work, graphs_before: int, cap: tuple[float, float]) -> list[str]:
    from ..tools.tuned_plan import prediction_line

    pred = prediction(a, res, work, graphs_before)
    lines = [f"#   capture (estimate) {cap[0]:.2f} s -> {cap[1]:.2f} s"]
    lines += [f"#   {line}" for line in kept_lines(res) if res.kept]
    engine = pred["engine"]
    if engine in EXPORTABLE:
        lines.append(f"#   workload from {engine}'s metrics: `plan export THIS --engine {engine}`")
    return lines + [prediction_line(pred)]


def limit_text(res, a, profile) -> str:
    """Each budget given and the graphs it allows, e.g. ``--max-graphs 86; --memory-budget 300
    MiB: 61 graphs``."""
    from ..tools.memory import capture_model

    parts = []
    for flag, graphs in res.limits.items():
        if flag == "--max-graphs":
            parts.append(f"--max-graphs {graphs}")
        elif flag == "--memory-budget":
            model = "built-in default profile" if profile is None else profile["source"]
            parts.append(f"--memory-budget {a.memory_budget:g} MiB ({model}): {graphs} graphs")
        else:
            parts.append(
                f"{flag} {a.budget_capture_seconds:g} ({capture_model(profile)[2]}): "
                f"{graphs} graphs"
            )
    return "; ".join(parts)


def engine_lines(engine: str | None, output: str | None) -> list[str]:
    plan = output or "TUNED.yaml (write it with -o)"
    if engine in EXPORTABLE:
        return [f"engine: {engine} (the workload's metrics): `plan export {plan}` gives its flags"]
    if engine == "graphplan":
        return [f"engine: graphplan (the workload's metrics): serve {plan} (POST /admin/reload)"]
    return []


def write_report(path: str, a, table, res, work, profile) -> None:
    from ..tools.report import build, tuning_section, write_report

    ctx = build(
        res.table,
        source=a.output or f"{a.plan} (tuned)",
        work=work,
        trace_source=a.trace,
        profile=profile,
        tuning=tuning_section(table, res, work, profile, a.trace),
    )
    write_report(path, ctx)
