"""``plan engines``: a plan's padding under each engine's default capture list, side by side.

Each row keeps the plan (scheduler limits, mode, LoRA, parallelism) and swaps only
``cudagraph.capture_sizes``: the plan's own list, vLLM's default list (as vLLM 0.11 generates
it), and the sglang and trtllm presets (SEMANTICS.md section 9). Padding is over every batch a
routine serves: uniform-decode batches of q, 2q, ... tokens and mixed batches of 1, 2, ...
tokens, up to the routine's largest size; with a trace, also the padded tokens that trace pays.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from .summary import compact_sizes, coverage, padding_profile


@dataclass(frozen=True, slots=True)
class EngineRow:
    label: str
    sizes: tuple[int, ...]
    graphs: int
    decode: dict | None
    """padding_profile of uniform-decode batches (None: no FULL decode routine)."""
    mixed: dict | None
    trace_padded: int | None = None
    trace_eager: int | None = None

    def to_json(self) -> dict:
        return {
            "list": self.label,
            "sizes": list(self.sizes),
            "graphs": self.graphs,
            "decode": self.decode,
            "mixed": self.mixed,
            "trace_padded_tokens": self.trace_padded,
            "trace_eager_steps": self.trace_eager,
        }


def _variants(loaded) -> list[tuple[str, object]]:
    from ..engines.vllm_rules import default_max_size, default_sizes

    s = loaded.spec.scheduler
    top = default_max_size(s.max_num_seqs, s.max_num_batched_tokens, s.decode_query_len)
    return [
        ("plan", None),
        ("vllm 0.11 default", default_sizes(top)),
        ("sglang preset", {"preset": "sglang"}),
        ("trtllm preset", {"preset": "trtllm"}),
        ("trtllm preset, padded", {"preset": "trtllm", "enable_padding": True}),
    ]


def compare(loaded, table, work=None) -> list[EngineRow]:
    from .. import compile_plan

    rows = []
    for label, sizes in _variants(loaded):
        if sizes is None:
            t = table
        else:
            plan = copy.deepcopy(loaded.plan)
            plan["cudagraph"]["capture_sizes"] = sizes
            plan["cudagraph"]["strict"] = False  # a default list may drop sizes: compare anyway
            t = compile_plan(plan)
        decode = mixed = None
        for c in coverage(t):
            prof = padding_profile(c.sizes, t.q if c.routine == "decode" else 1)
            if c.routine == "decode":
                decode = prof
            else:
                mixed = prof
        padded = eager = None
        if work is not None:
            from .trace import padding

            p = padding(t, work)
            padded, eager = p.padded_tokens, p.eager_steps
        rows.append(
            EngineRow(label, tuple(t.capture_sizes), len(t.graphs), decode, mixed, padded, eager)
        )
    return rows


def compare_lines(rows: list[EngineRow], plan: str, trace: str | None) -> list[str]:
    def pad(p):
        return "-" if p is None else f"{p['mean_pad']:.1f} / {p['worst_pad']}"

    head = (
        f"{'capture list':<22} {'sizes':>5} {'graphs':>6} {'largest':>7} "
        f"{'decode pad mean/worst':>21} {'mixed pad mean/worst':>20}"
    )
    if trace:
        head += f" {'trace padded':>12} {'eager':>6}"
    lines = [f"{plan}: padding under each engine's default capture list", "", head]
    for r in rows:
        line = (
            f"{r.label:<22} {len(r.sizes):>5} {r.graphs:>6} "
            f"{(r.sizes[-1] if r.sizes else 0):>7} {pad(r.decode):>21} {pad(r.mixed):>20}"
        )
        if trace:
            line += f" {r.trace_padded:>12} {r.trace_eager:>6}"
        lines.append(line)
    lines.append("")
    lines += [f"{r.label:<22} {compact_sizes(r.sizes)}" for r in rows]
    return lines
