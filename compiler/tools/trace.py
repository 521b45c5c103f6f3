"""Workload traces: observed steps as JSONL, one ``{"num_tokens", "num_reqs", "max_query_len"}``
object per line, checked line by line, aggregated with numpy, and priced against a table.

A step's route is ``step_route``: the plain dispatch of one rank with no LoRA adapter (the trace
records neither DP peers nor adapters); a step that wants to micro-batch uses its ubatched graph
when there is one. The *padding* of a step that lands on a graph is ``padded_tokens - num_tokens``;
a step that runs eager pads nothing and is counted as an eager step instead.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GraphplanError
from ..records import RuntimeMode, is_uniform_decode
from ..table import DispatchTable

KEYS = ("num_tokens", "num_reqs", "max_query_len")
MAX_TRACE_BYTES = 1 << 30
# Digit-free shapes of canonical lines (json.dumps with default and compact separators).
_SHAPES = {
    json.dumps(dict.fromkeys(KEYS, "")).replace('""', "").encode(),
    json.dumps(dict.fromkeys(KEYS, ""), separators=(",", ":")).replace('""', "").encode(),
}


class TraceError(GraphplanError):
    """A trace file cannot be read, or a line is not a valid step for the plan."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Trace:
    source: str
    num_tokens: np.ndarray
    """[steps] int64."""
    num_reqs: np.ndarray
    max_query_len: np.ndarray
    line: np.ndarray
    """[steps] 1-based line number of each step in the file (blank lines are skipped)."""

    @property
    def steps(self) -> int:
        return len(self.num_tokens)


_DIGITS_ONLY = bytes(c if 48 <= c <= 57 else 32 for c in range(256))  # non-digits -> spaces


def _fast_parse(raw: bytes):
    """Lines of one canonical shape only, parsed by numpy in one pass; None sends the file to the
    JSON path (which explains whatever is wrong)."""
    first = raw[: raw.find(b"\n")] if b"\n" in raw else raw
    shape = first.translate(None, b"0123456789")
    if shape not in _SHAPES:
        return None
    bare = raw.translate(None, b"0123456789")
    lines = bare.count(b"\n")
    if bare == (shape + b"\n") * lines or bare == (shape + b"\n") * lines + shape:
        line_no = np.arange(1, lines + (not raw.endswith(b"\n")) + 1)
    else:
        rest = bare.replace(shape + b"\n", b"")  # blank lines, or a bad line somewhere
        if (
            rest.replace(b"\n", b"") not in (b"", shape)
            or rest
            and not rest.endswith((shape, b"\n"))
        ):
            return None
        a = np.frombuffer(raw, dtype=np.uint8)
        bounds = np.concatenate(([-1], np.flatnonzero(a == 10), [len(a)]))
        line_no = np.flatnonzero(np.diff(bounds) > 1) + 1  # number the non-blank lines
    text = raw.translate(_DIGITS_ONLY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a number numpy cannot read: let the JSON path explain
        try:
            values = np.fromstring(text, dtype=np.int64, sep=" ")
        except (ValueError, Warning):
            return None
    digits = np.floor(np.log10(np.maximum(values, 1))).astype(np.int64) + 1
    if len(values) != 3 * len(line_no) or int(digits.sum()) != len(raw) - len(bare):
        return None  # an empty value, a leading zero, or a number too large for int64
    return values.reshape(-1, 3), line_no


def _slow_parse(text: str, source: str):
    rows, line_no = [], []
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(
                f"{source}:{i}: not JSON ({e.msg} at column {e.colno}); each line is "
                '{"num_tokens": N, "num_reqs": R, "max_query_len": L}'
            ) from None
        if not isinstance(step, dict):
            raise TraceError(f"{source}:{i}: expected a JSON object, got {type(step).__name__}")
        row = []
        for key in KEYS:
            v = step.get(key)
            if key not in step:
                raise TraceError(
                    f"{source}:{i}: missing '{key}' (each line needs "
                    f"{', '.join(KEYS)}; extra keys are ignored)"
                )
            if isinstance(v, bool) or not isinstance(v, int):
                raise TraceError(f"{source}:{i}: {key}: expected an integer, got {v!r}"[:300])
            if abs(v) >= 1 << 62:
                raise TraceError(f"{source}:{i}: {key}: {v} is out of range"[:300])
            row.append(v)
        rows.append(row)
        line_no.append(i)
    return np.array(rows, dtype=np.int64).reshape(-1, 3), np.array(line_no, dtype=np.int64)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and shape-check a JSONL trace. Errors name the line; values are checked against a
    plan's limits by ``check_trace``."""
    p, source = Path(path), str(path)
    from ..limits import read_regular_file  # regular files only, size first

    raw = read_regular_file(
        p,
        MAX_TRACE_BYTES,
        "trace",
        "give the trace .jsonl file; sample a larger trace",
        error=TraceError,
    )
    parsed = _fast_parse(raw)
    if parsed is None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise TraceError(f"{source}:{line}: not UTF-8 (save the trace as UTF-8)") from None
        parsed = _slow_parse(text, source)
    values, line_no = parsed
    if len(values) == 0:
        raise TraceError(f"{source}: no steps; a trace has one JSON object per line")
    return Trace(
        source=source,
        num_tokens=values[:, 0].copy(),
        num_reqs=values[:, 1].copy(),
        max_query_len=values[:, 2].copy(),
        line=line_no,
    )


def check_trace(trace: Trace, table: DispatchTable) -> None:
    """Every step must be a batch the plan can see (the same rules as ``DispatchTable.route``)."""
    n, r, m = trace.num_tokens, trace.num_reqs, trace.max_query_len
    name = table.plan.get("name", "plan")
    checks = (
        (n < 1, "num_tokens {n} must be >= 1", ""),
        (
            n > table.max_tokens,
            "num_tokens {n} exceeds scheduler.max_num_batched_tokens="
            f"{table.max_tokens} of plan {name}",
            "record the trace with the plan's scheduler limits",
        ),
        ((r < 1) | (r > n), "num_reqs {r} must be in 1..num_tokens={n}", ""),
        (
            r > table.max_num_seqs,
            f"num_reqs {{r}} exceeds scheduler.max_num_seqs={table.max_num_seqs} of plan {name}",
            "record the trace with the plan's scheduler limits",
        ),
        (
            (m < 1) | (m * r < n) | (m > n - r + 1),
            "max_query_len {m} is impossible for {n} tokens in {r} requests",
            "it must be in ceil(num_tokens/num_reqs)..num_tokens-num_reqs+1",
        ),
    )
    for bad, message, hint in checks:
        if bad.any():
            i = int(np.argmax(bad))
            text = message.format(n=n[i], r=r[i], m=m[i])
            raise TraceError(
                f"{trace.source}:{trace.line[i]}: {text}" + (f" ({hint})" if hint else "")
            )


QUERY_LEN_PROBE = 16
"""Uniform batches of query length up to this count as decode steps when guessing the
decode_query_len a trace was recorded with (a longer uniform batch is a prefill)."""


def fit_trace(trace: Trace, table: DispatchTable) -> tuple[Trace, list[str]]:
    """The steps of ``trace`` the plan's scheduler could produce, and warnings about the rest.

    Steps with more tokens than max_num_batched_tokens or more requests than max_num_seqs are
    left out (a warning per limit, naming the first line); a trace whose uniform batches have
    another query length than the plan's decode_query_len gets a warning (its decode steps route
    as mixed batches). What is left must pass ``check_trace``; a trace with nothing left is an
    error."""
    n, r, m = trace.num_tokens, trace.num_reqs, trace.max_query_len
    name, warnings_ = table.plan.get("name", "plan"), []
    over = np.zeros(len(n), dtype=bool)
    for bad, key, got, limit, value in (
        (n > table.max_tokens, "num_tokens", n, "max_num_batched_tokens", table.max_tokens),
        (r > table.max_num_seqs, "num_reqs", r, "max_num_seqs", table.max_num_seqs),
    ):
        if bad.any():
            i, more = int(np.argmax(bad)), int(bad.sum()) - 1
            warnings_.append(
                f"{trace.source}:{trace.line[i]}: {key} {int(got[i])} exceeds scheduler.{limit}="
                f"{value} of plan {name}"
                + (f", as do {more} more of {len(n)} steps" if more else "")
                + "; left out: this plan's scheduler "
                "never runs such steps (record the trace with the plan's scheduler limits)"
            )
            over |= bad
    if over.all():
        raise TraceError("\n".join(warnings_) + f"\n{trace.source}: no step is left")
    if over.any():
        keep = ~over
        trace = Trace(
            source=trace.source,
            num_tokens=n[keep],
            num_reqs=r[keep],
            max_query_len=m[keep],
            line=trace.line[keep],
        )
        n, r, m = trace.num_tokens, trace.num_reqs, trace.max_query_len
    check_trace(trace, table)
    # uniform batches at their own query length (a decode at whatever q the trace had)
    uniform = is_uniform_decode(n, r, m, m) & (m <= QUERY_LEN_PROBE)
    lens, counts = np.unique(m[uniform], return_counts=True)
    if len(lens):
        common = int(lens[np.argmax(counts)])
        at_q = int(counts[lens == table.q].sum())
        if common != table.q and counts.max() > at_q:
            noun = "token" if common == 1 else "tokens"
            warnings_.append(
                f"{trace.source}: {int(counts.max())} steps have every request at {common} "
                f"{noun} ({at_q} at {table.q}): the trace looks recorded with decode_query_len="
                f"{common}, but plan {name} has decode_query_len={table.q}, so its decode steps "
                "route as mixed batches here (record the trace with the plan's speculative-token "
                "count, or set scheduler.decode_query_len)"
            )
    return trace, warnings_


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Workload:
    """A trace aggregated by (num_tokens, uniform decode): what routing and padding depend on."""

    tokens: np.ndarray
    """[groups] num_tokens, ascending (decode groups before mixed at equal tokens)."""
    uniform: np.ndarray
    """[groups] bool: every request has exactly q tokens."""
    count: np.ndarray
    """[groups] steps in the group."""
    reqs: np.ndarray
    query_len: np.ndarray
    """[groups] one observed (num_reqs, max_query_len) of the group, to route it."""

    @property
    def steps(self) -> int:
        return int(self.count.sum())


def aggregate(trace: Trace, q: int) -> Workload:
    n, r, m = trace.num_tokens, trace.num_reqs, trace.max_query_len
    uniform = is_uniform_decode(n, r, m, q)
    key = n * 2 + (~uniform)
    keys, first, count = np.unique(key, return_index=True, return_counts=True)
    return Workload(
        tokens=keys // 2,
        uniform=(keys % 2) == 0,
        count=count.astype(np.int64),
        reqs=r[first],
        query_len=m[first],
    )


def step_route(table: DispatchTable, n: int, r: int, mql: int, pad_to: int | None = None):
    route = table.route(n, r, mql, pad_to=pad_to)
    if route.wants_ubatch:
        sub = table.route(n, r, mql, pad_to=pad_to, ubatched=True)
        if sub.mode != "NONE":
            return sub
    return route


@dataclass(frozen=True, kw_only=True, slots=True)
class Padding:
    """What a workload costs on a table."""

    steps: int
    graphed_steps: int
    eager_steps: int
    """Steps that run eager: above the largest size, or no graph for their routine."""
    padded_tokens: int
    """Sum over graphed steps of padded_tokens - num_tokens: the objective ``plan optimize`` cuts."""
    routines: dict
    """``decode`` / ``mixed`` -> {steps, graphed_steps, eager_steps, padded_tokens}."""
    by_size: dict
    """capture size -> [steps landing on it, padding tokens they add]."""

    @property
    def per_step(self) -> float:
        """Padding tokens per step of the workload, eager steps counted as 0: an all-eager plan
        scores 0, so never show it alone (``graphed_share``, ``per_graph_step``)."""
        return self.padded_tokens / self.steps if self.steps else 0.0

    @property
    def graphed_share(self) -> float:
        """Share of the steps that replay a graph (0..1)."""
        return self.graphed_steps / self.steps if self.steps else 0.0

    @property
    def per_graph_step(self) -> float:
        """Padding tokens per step that replays a graph (what a graph step pays)."""
        return self.padded_tokens / self.graphed_steps if self.graphed_steps else 0.0


def padding(table: DispatchTable, work: Workload) -> Padding:
    routines = {
        k: dict(steps=0, graphed_steps=0, eager_steps=0, padded_tokens=0)
        for k in ("decode", "mixed")
    }
    by_size: dict[int, list[int]] = {}
    for n, u, c, r, m in zip(
        work.tokens.tolist(),
        work.uniform.tolist(),
        work.count.tolist(),
        work.reqs.tolist(),
        work.query_len.tolist(),
    ):
        route = step_route(table, n, r, m)
        row = routines["decode" if u else "mixed"]
        row["steps"] += c
        if route.mode is RuntimeMode.NONE:
            row["eager_steps"] += c
            continue
        row["graphed_steps"] += c
        row["padded_tokens"] += c * (route.padded_tokens - n)
        cell = by_size.setdefault(route.padded_tokens, [0, 0])
        cell[0] += c
        cell[1] += c * (route.padded_tokens - n)
    total = {k: sum(v[k] for v in routines.values()) for k in routines["decode"]}
    return Padding(
        steps=total["steps"],
        graphed_steps=total["graphed_steps"],
        eager_steps=total["eager_steps"],
        padded_tokens=total["padded_tokens"],
        routines=routines,
        by_size=dict(sorted(by_size.items())),
    )
