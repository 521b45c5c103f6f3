"""The workload file: observed steps as JSONL, one object per line,

    {"num_tokens": N, "num_reqs": R, "max_query_len": L}              one step, or
    {"num_tokens": N, "num_reqs": R, "max_query_len": L, "count": C}  C steps of that shape,

optionally after one header line ``{"graphplan_workload": {...}}`` that says where the steps came
from (``plan workload --from-metrics`` writes one: the engine, the scrapes, how bucket counts were
spread; docs/workload.md). Traces written before ``count`` existed read as before.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GraphplanError
from ..fileio import write_atomic

KEYS = ("num_tokens", "num_reqs", "max_query_len")
COUNT = "count"
HEADER_KEY = "graphplan_workload"
HEADER_VERSION = 1
ENGINES = ("vllm", "sglang", "graphplan")
"""Engines a header may name (``plan export --engine`` takes the first two)."""
MAX_TRACE_BYTES = 1 << 30
MAX_HEADER_BYTES = 1 << 16
MAX_STEPS = 1 << 28
"""Total steps (sum of counts) a workload may hold: the optimizer's exact integer arithmetic
stays inside int64 below it (steps x tokens x candidates). ``plan workload`` scales larger
histograms down to it and says so."""
# Digit-free shapes of canonical lines (json.dumps with default and compact separators) -> values
_SHAPES = {
    json.dumps(dict.fromkeys(keys, ""), separators=seps).replace('""', "").encode(): len(keys)
    for keys in (KEYS, (*KEYS, COUNT))
    for seps in ((", ", ": "), (",", ":"))
}


class TraceError(GraphplanError):
    """A trace file cannot be read, or a line is not a valid step for the plan."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Trace:
    source: str
    num_tokens: np.ndarray
    """[rows] int64."""
    num_reqs: np.ndarray
    max_query_len: np.ndarray
    line: np.ndarray
    """[rows] 1-based line number of each row in the file (blank lines are skipped)."""
    count: np.ndarray | None = None
    """[rows] steps each row stands for (all 1 when None is given)."""
    header: dict | None = None
    """The file's ``graphplan_workload`` header, if it has one."""

    def __post_init__(self):
        if self.count is None:
            object.__setattr__(self, "count", np.ones(len(self.num_tokens), dtype=np.int64))

    @property
    def counts(self) -> np.ndarray:
        """[rows] steps each row stands for: ``count``, or all 1 when None was given."""
        assert self.count is not None  # __post_init__ fills it
        return self.count

    @property
    def steps(self) -> int:
        return int(self.counts.sum())


_DIGITS_ONLY = bytes(c if 48 <= c <= 57 else 32 for c in range(256))  # non-digits -> spaces


def _fast_parse(raw: bytes):
    """Lines of one canonical shape only, parsed by numpy in one pass; None sends the file to the
    JSON path (which explains whatever is wrong). Returns ([rows, 4] values, line numbers)."""
    first = raw[: raw.find(b"\n")] if b"\n" in raw else raw
    shape = first.translate(None, b"0123456789")
    width = _SHAPES.get(shape)
    if width is None:
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
    if len(values) != width * len(line_no) or int(digits.sum()) != len(raw) - len(bare):
        return None  # an empty value, a leading zero, or a number too large for int64
    values = values.reshape(-1, width)
    if width == 3:
        values = np.concatenate((values, np.ones((len(values), 1), dtype=np.int64)), axis=1)
    return values, line_no


def _slow_parse(text: str, source: str, first_line: int = 1):
    rows, line_no = [], []
    for i, line in enumerate(text.split("\n"), first_line):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(
                f"{source}:{i}: not JSON ({e.msg} at column {e.colno}); each line is "
                '{"num_tokens": N, "num_reqs": R, "max_query_len": L} (and optionally "count": C)'
            ) from None
        except (RecursionError, ValueError) as e:  # 100k-deep, or a 5000-digit integer
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
            raise TraceError(f"{source}:{i}: not a trace step ({why})") from None
        if not isinstance(step, dict):
            raise TraceError(f"{source}:{i}: expected a JSON object, got {type(step).__name__}")
        if HEADER_KEY in step:
            raise TraceError(f"{source}:{i}: a workload header belongs on the first line only")
        row = []
        for key in (*KEYS, COUNT):
            if key not in step:
                if key == COUNT:
                    row.append(1)
                    continue
                raise TraceError(
                    f"{source}:{i}: missing '{key}' (each line needs "
                    f"{', '.join(KEYS)}; extra keys are ignored)"
                )
            v = step[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise TraceError(f"{source}:{i}: {key}: expected an integer, got {v!r}"[:300])
            if abs(v) >= 1 << 62:
                raise TraceError(f"{source}:{i}: {key}: {v} is out of range"[:300])
            row.append(v)
        rows.append(row)
        line_no.append(i)
    return np.array(rows, dtype=np.int64).reshape(-1, 4), np.array(line_no, dtype=np.int64)


def check_header(data, source: str) -> dict:
    """The header's inner object, checked where it is read (engine, version)."""
    head = data.get(HEADER_KEY) if isinstance(data, dict) else None
    if not isinstance(head, dict):
        raise TraceError(f'{source}:1: "{HEADER_KEY}" must be an object')
    if head.get("version") != HEADER_VERSION:
        raise TraceError(
            f"{source}:1: workload header version {head.get('version')!r}; this graphplan reads "
            f"version {HEADER_VERSION} (rewrite it with this graphplan's `plan workload`)"[:400]
        )
    engine = head.get("engine")
    if engine is not None and engine not in ENGINES:
        raise TraceError(
            f"{source}:1: workload header engine {engine!r} is not one of {', '.join(ENGINES)}"[
                :400
            ]
        )
    return dict(head)


def _split_header(raw: bytes, source: str) -> tuple[dict | None, bytes]:
    if not raw.lstrip(b" \t").startswith(b'{"' + HEADER_KEY.encode() + b'"'):
        return None, raw
    end = raw.find(b"\n")
    first, body = (raw, b"") if end < 0 else (raw[:end], raw[end + 1 :])
    if len(first) > MAX_HEADER_BYTES:
        raise TraceError(
            f"{source}:1: the workload header is {len(first)} bytes; at most {MAX_HEADER_BYTES}"
        )
    try:
        data = json.loads(first.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise TraceError(f"{source}:1: the workload header is not a JSON object") from None
    return check_header(data, source), body


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and shape-check a JSONL trace. Errors name the line; values are checked against a
    plan's limits by ``trace.check_trace``."""
    p, source = Path(path), str(path)
    from ..limits import read_regular_file  # regular files only, size first

    raw = read_regular_file(
        p,
        MAX_TRACE_BYTES,
        "trace",
        "give the trace .jsonl file; sample a larger trace",
        error=TraceError,
    )
    header, body = _split_header(raw, source)
    skip = int(header is not None)
    parsed = _fast_parse(body)
    if parsed is not None:
        values, line_no = parsed[0], parsed[1] + skip
    else:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            line = body[: e.start].count(b"\n") + 1 + skip
            raise TraceError(f"{source}:{line}: not UTF-8 (save the trace as UTF-8)") from None
        values, line_no = _slow_parse(text, source, 1 + skip)
    if len(values) == 0:
        raise TraceError(f"{source}: no steps; a trace has one JSON object per line")
    count = values[:, 3]
    bad = (count < 1) | (count > MAX_STEPS)
    if bad.any():
        i = int(np.argmax(bad))
        raise TraceError(f"{source}:{line_no[i]}: count {count[i]} must be in 1..{MAX_STEPS}")
    if int(count.sum()) > MAX_STEPS:
        raise TraceError(
            f"{source}: {int(count.sum())} steps in all; a workload holds at most {MAX_STEPS} "
            "(scale the counts down: the optimum depends on their proportions only)"
        )
    return Trace(
        source=source,
        num_tokens=values[:, 0].copy(),
        num_reqs=values[:, 1].copy(),
        max_query_len=values[:, 2].copy(),
        line=line_no,
        count=count.copy(),
        header=header,
    )


def workload_text(header: dict | None, rows) -> str:
    """JSONL of ``rows`` ((num_tokens, num_reqs, max_query_len, count), ...) after the header;
    canonical lines, so ``load_trace`` reads them on its fast path."""
    lines = [json.dumps({HEADER_KEY: header}, sort_keys=True)] if header is not None else []
    for n, r, m, c in rows:
        lines.append(
            json.dumps(
                {"num_tokens": int(n), "num_reqs": int(r), "max_query_len": int(m), COUNT: int(c)}
            )
        )
    return "\n".join(lines) + "\n"


def write_workload(path: str | os.PathLike, header: dict | None, rows) -> None:
    write_atomic(path, workload_text(header, rows).encode("utf-8"))
