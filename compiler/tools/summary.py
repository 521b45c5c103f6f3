"""Readable summaries of a table: compact size lists, per-routine coverage and worst padding."""

from __future__ import annotations

from dataclasses import dataclass

from ..table import DispatchTable
from ..table_format import graph_json

RUN = 4
"""Arithmetic runs of at least this many sizes collapse; shorter ones read better spelled out."""


def count(n: int, noun: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def compact_sizes(sizes) -> str:
    """``1 2 4 8-248/8 256-512/16``: arithmetic runs of RUN+ sizes collapse to first-last/step
    (``first-last`` for consecutive sizes); shorter runs are listed."""
    sizes, out, i = sorted(sizes), [], 0
    while i < len(sizes):
        j = i + 1
        if j < len(sizes):
            step = sizes[j] - sizes[i]
            while j + 1 < len(sizes) and sizes[j + 1] - sizes[j] == step:
                j += 1
            if j - i + 1 >= RUN:
                out.append(f"{sizes[i]}-{sizes[j]}" + (f"/{step}" if step > 1 else ""))
                i = j + 1
                continue
        out.append(str(sizes[i]))
        i += 1
    return " ".join(out) if out else "(none)"


@dataclass(frozen=True, slots=True)
class Coverage:
    routine: str
    """``decode`` (uniform-decode batches) or ``mixed``."""
    mode: str
    sizes: tuple[int, ...]
    worst_pad: int
    """Most padding tokens any batch of this routine gets (0 when no sizes)."""
    worst_at: int
    """A num_tokens that gets ``worst_pad``."""


def padding_profile(sizes, step: int) -> dict:
    """Padding of batches of step, 2*step, ... up to the largest size: worst, mean, waste share."""
    total_pad = total_padded = count = 0
    worst, at, prev = 0, 0, 0
    for s in sizes:
        n0 = prev + step  # batches n0, n0 + step, ..., <= s pad to s
        k = (s - n0) // step + 1 if n0 <= s else 0
        if k:
            pads = (s - n0) * k - step * k * (k - 1) // 2
            total_pad, total_padded, count = total_pad + pads, total_padded + s * k, count + k
            if s - n0 > worst:
                worst, at = s - n0, n0
        prev = s
    return {
        "worst_pad": worst,
        "worst_at": at,
        "batches": count,
        "mean_pad": total_pad / count if count else 0.0,
        "waste_pct": 100.0 * total_pad / total_padded if total_padded else 0.0,
    }


def _worst_at(sizes, step: int) -> tuple[int, int]:
    p = padding_profile(sizes, step)
    return p["worst_pad"], p["worst_at"]


def coverage(table: DispatchTable) -> list[Coverage]:
    """What each routine captures (LoRA case 0 or the first case) and its worst padding."""
    out, q = [], table.q
    m = {k: v[0] for k, v in table.routes.items()} if table.capture_sizes else {}
    sizes = table.capture_sizes

    def present(name):
        return tuple(s for s, g in zip(sizes, m.get(name, ())) if g >= 0)

    decode = present("full_decode") or present("full_decode_ubatched")
    if decode:
        out.append(Coverage("decode", "FULL", decode, *_worst_at(decode, q)))
    for name, mode in (("full_mixed", "FULL"), ("piecewise", "PIECEWISE")):
        mixed = present(name)
        if mixed:
            out.append(Coverage("mixed", mode, mixed, *_worst_at(mixed, 1)))
    return out


def summary_lines(table: DispatchTable) -> list[str]:
    r = table.settings
    by_mode: dict[str, int] = {}
    for g in table.graphs:
        by_mode[g.mode.name] = by_mode.get(g.mode.name, 0) + 1
    mode = (
        r.mode.name
        if r.mode is r.requested_mode
        else f"{r.mode.name} (requested {r.requested_mode.name})"
    )
    lines = [
        f"plan {table.settings.name}  fingerprint {table.fingerprint[:19]}",
        f"mode {mode}; attention {r.attention_support.name}; q={r.decode_query_len}; "
        f"max_num_seqs={r.max_num_seqs}; max_num_batched_tokens={r.max_num_batched_tokens}",
        f"capture sizes ({len(r.capture_sizes)}): {compact_sizes(r.capture_sizes)}",
        f"graphs: {len(table.graphs)}"
        + (
            " (" + ", ".join(f"{v} {k}" for k, v in sorted(by_mode.items())) + ")"
            if by_mode
            else ""
        ),
    ]
    if r.tensor_parallel_size > 1 or r.data_parallel_size > 1:
        lines.append(
            f"parallel: DP {r.data_parallel_size} x TP {r.tensor_parallel_size} = "
            f"{r.data_parallel_size * r.tensor_parallel_size} ranks; every rank of a TP group "
            "replays the same graph each step"
        )
    if r.lora_enabled:
        lines.append(f"lora cases (active adapters captured): {r.lora_cases}")
    if r.ubatch.enabled:
        ub = r.ubatch
        lines.append(
            f"ubatch: {ub.num_ubatches} micro-batches, decode >= "
            f"{ub.decode_token_threshold}, prefill >= {ub.prefill_token_threshold}, "
            f"plain twins {'on' if ub.plain_twins else 'off'}; DP size "
            f"{r.data_parallel_size}"
        )
    lines.append("")
    lines.append(f"{'routine':<8} {'mode':<10} {'graph sizes':<34} {'worst padding':>14}")
    covered_top = 0
    for c in coverage(table):
        worst = f"{c.worst_pad} @ {c.worst_at}" if c.worst_pad else "0"
        lines.append(
            f"{c.routine:<8} {c.mode:<10} {_clip(compact_sizes(c.sizes), 34):<34} {worst:>14}"
        )
        covered_top = max(covered_top, c.sizes[-1])
    top = r.max_num_batched_tokens
    if covered_top < top:
        span = str(top) if covered_top + 1 == top else f"{covered_top + 1}..{top}"
        span += " token" if top == 1 else " tokens"
        lines.append(f"{'eager':<8} {'NONE':<10} {span:<34} {'-':>14}")
    return lines


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def summary_json(table: DispatchTable) -> dict:
    r = table.settings
    return {
        "name": table.settings.name,
        "fingerprint": table.fingerprint,
        "content_fingerprint": table.content_fingerprint,
        "mode": r.mode.name,
        "requested_mode": r.requested_mode.name,
        "capture_sizes": list(r.capture_sizes),
        "num_graphs": len(table.graphs),
        "data_parallel_size": r.data_parallel_size,
        "tensor_parallel_size": r.tensor_parallel_size,
        "graphs": [graph_json(g) for g in table.graphs],
        "coverage": [
            {
                "routine": c.routine,
                "mode": c.mode,
                "sizes": list(c.sizes),
                "worst_padding": c.worst_pad,
                "worst_at": c.worst_at,
            }
            for c in coverage(table)
        ],
        "diagnostics": list(table.diagnostics),
    }
