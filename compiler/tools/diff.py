"""``plan diff``: graphs added/removed, routes that changed, worst-case padding before/after."""

from __future__ import annotations

from dataclasses import dataclass

from ..records import RuntimeMode, decode_token_range, padded_num_reqs
from ..table import DispatchTable
from .summary import coverage


@dataclass(frozen=True, slots=True)
class RouteChange:
    kind: str
    """``decode`` (uniform-decode batches) or ``mixed``."""
    first: int
    last: int
    """The num_tokens range [first, last] over which the route changed the same way."""
    before: str
    after: str


@dataclass(frozen=True, slots=True)
class TableDiff:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changes: tuple[RouteChange, ...]
    padding: tuple[tuple[str, str, int | None, int | None], ...]
    """(routine, mode, worst padding before, after); None where the routine is absent."""
    same_fingerprint: bool


def _graph_label(g) -> str:
    k = g.key
    parts = [f"{g.mode.name} {k.num_tokens} tok"]
    if k.num_reqs is not None:
        parts.append(f"{k.num_reqs} req")
    if k.uniform:
        parts.append("uniform")
    if k.has_lora:
        parts.append(f"lora {k.num_active_loras}")
    if k.num_ubatches > 1:
        parts.append(f"{k.num_ubatches} ubatches")
    return ", ".join(parts)


def _graph_order(g) -> tuple:
    """Graphs listed by mode, then numerically by tokens, requests, LoRA count, ubatches."""
    k = g.key
    return (
        g.mode.name,
        k.num_tokens,
        k.num_reqs or 0,
        k.uniform,
        k.num_active_loras,
        k.num_ubatches,
    )


def _route_label(t: DispatchTable, n: int, uniform: bool) -> str:
    if n > t.max_tokens:
        return "out of range"
    if uniform:
        if n not in decode_token_range(t.q, t.max_num_seqs):
            return "out of range"
        route = t.route(n, padded_num_reqs(n, t.max_num_seqs, t.q), t.q)
    else:
        route = t.route(n)
    return (
        f"{route.mode.name} {route.padded_tokens}" if route.mode is not RuntimeMode.NONE else "NONE"
    )


def _changes(a: DispatchTable, b: DispatchTable, kind: str) -> list[RouteChange]:
    uniform = kind == "decode"
    if uniform and a.q != b.q:
        return [RouteChange(kind, 1, max(a.max_tokens, b.max_tokens), f"q={a.q}", f"q={b.q}")]
    step = a.q if uniform else 1
    top = max(a.max_tokens, b.max_tokens)
    if uniform:
        top = min(top, decode_token_range(a.q, max(a.max_num_seqs, b.max_num_seqs))[-1])
    out: list[RouteChange] = []
    for n in range(step, top + 1, step):
        before, after = _route_label(a, n, uniform), _route_label(b, n, uniform)
        if before == after:
            continue
        # extend the previous run when the change has the same shape (same modes, padding moved)
        shape = (before.split()[0], after.split()[0])
        if (
            out
            and out[-1].last == n - step
            and (out[-1].before.split()[0], out[-1].after.split()[0]) == shape
        ):
            prev = out[-1]
            out[-1] = RouteChange(kind, prev.first, n, prev.before, prev.after)
            continue
        out.append(RouteChange(kind, n, n, before, after))
    return out


def diff_tables(a: DispatchTable, b: DispatchTable) -> TableDiff:
    order = {_graph_label(g): _graph_order(g) for g in (*a.graphs, *b.graphs)}
    ga = {_graph_label(g) for g in a.graphs}
    gb = {_graph_label(g) for g in b.graphs}
    pad_a = {(c.routine, c.mode): c.worst_pad for c in coverage(a)}
    pad_b = {(c.routine, c.mode): c.worst_pad for c in coverage(b)}
    padding = tuple(
        (r, m, pad_a.get((r, m)), pad_b.get((r, m))) for r, m in sorted(set(pad_a) | set(pad_b))
    )
    return TableDiff(
        added=tuple(sorted(gb - ga, key=order.__getitem__)),
        removed=tuple(sorted(ga - gb, key=order.__getitem__)),
        changes=tuple(_changes(a, b, "decode") + _changes(a, b, "mixed")),
        padding=padding,
        same_fingerprint=a.fingerprint == b.fingerprint,
    )


def diff_lines(d: TableDiff, name_a: str, name_b: str, limit: int = 40) -> list[str]:
    if d.same_fingerprint:
        return [f"{name_a} and {name_b} compile to the same table"]
    lines = [f"--- {name_a}", f"+++ {name_b}", f"graphs: +{len(d.added)} -{len(d.removed)}"]
    lines += [f"  + {g}" for g in d.added[:limit]]
    lines += [f"  - {g}" for g in d.removed[:limit]]
    if len(d.added) > limit or len(d.removed) > limit:
        lines.append("  ... (--format json lists all)")
    lines.append(f"routes changed: {len(d.changes)} range(s)")
    for c in d.changes[:limit]:
        span = f"{c.first}" if c.first == c.last else f"{c.first}..{c.last}"
        noun = "token " if c.first == c.last == 1 else "tokens"
        lines.append(f"  {c.kind:<6} {noun} {span:<14} {c.before} -> {c.after}")
    lines.append("worst-case padding (tokens):")
    for routine, mode, before, after in d.padding:
        fmt = lambda v: "-" if v is None else str(v)
        lines.append(f"  {routine:<6} {mode:<10} {fmt(before):>6} -> {fmt(after)}")
    return lines


def diff_json(d: TableDiff) -> dict:
    return {
        "same": d.same_fingerprint,
        "added": list(d.added),
        "removed": list(d.removed),
        "route_changes": [
            {"kind": c.kind, "first": c.first, "last": c.last, "before": c.before, "after": c.after}
            for c in d.changes
        ],
        "worst_padding": [
            {"routine": r, "mode": m, "before": b, "after": a} for r, m, b, a in d.padding
        ],
    }
