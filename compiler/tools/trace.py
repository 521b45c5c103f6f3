"""Workload traces (the file format is ``trace_file``: one ``{"num_tokens", "num_reqs",
"max_query_len"}`` object per step, or per ``count`` steps) checked against a plan, aggregated with
numpy, and priced against a table.

A step's route is ``step_route``: the plain dispatch of one rank with no LoRA adapter (the trace
records neither DP peers nor adapters); a step that wants to micro-batch uses its ubatched graph
when there is one. The *padding* of a step that lands on a graph is ``padded_tokens - num_tokens``;
a step that runs eager pads nothing and is counted as an eager step instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..records import RuntimeMode, is_uniform_decode
from ..table import DispatchTable
from .trace_file import KEYS, MAX_TRACE_BYTES, Trace, TraceError, load_trace

__all__ = [
    "KEYS",
    "MAX_TRACE_BYTES",
    "Trace",
    "TraceError",
    "load_trace",
    "check_trace",
    "fit_trace",
    "aggregate",
    "Workload",
    "padding",
    "Padding",
    "step_route",
    "LeftOut",
    "left_out",
]


def check_trace(trace: Trace, table: DispatchTable) -> None:
    """Every step must be a batch the plan can see (the same rules as ``DispatchTable.route``)."""
    n, r, m = trace.num_tokens, trace.num_reqs, trace.max_query_len
    name = table.plan.get("name", "plan")
    again = (  # a workload from plan workload: the command that writes it for this plan
        "write the workload for this plan: plan workload --from-metrics ... --plan PLAN (or "
        f"--max-num-seqs {table.max_num_seqs} --max-tokens {table.max_tokens})"
        if trace.header
        else "record the trace with the plan's scheduler limits"
    )
    checks = (
        (n < 1, "num_tokens {n} must be >= 1", ""),
        (
            n > table.max_tokens,
            "num_tokens {n} exceeds scheduler.max_num_batched_tokens="
            f"{table.max_tokens} of plan {name}",
            again,
        ),
        ((r < 1) | (r > n), "num_reqs {r} must be in 1..num_tokens={n}", ""),
        (
            r > table.max_num_seqs,
            f"num_reqs {{r}} exceeds scheduler.max_num_seqs={table.max_num_seqs} of plan {name}",
            again,
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


def _over_limits(trace: Trace, table: DispatchTable) -> list[tuple]:
    """(mask, key, values, scheduler limit name, limit) per scheduler limit a trace can exceed."""
    n, r = trace.num_tokens, trace.num_reqs
    return [
        (n > table.max_tokens, "num_tokens", n, "max_num_batched_tokens", table.max_tokens),
        (r > table.max_num_seqs, "num_reqs", r, "max_num_seqs", table.max_num_seqs),
    ]


@dataclass(frozen=True, kw_only=True, slots=True)
class LeftOut:
    """The steps of a trace a plan's scheduler never runs, which pricing leaves out."""

    steps: int
    """Every step of the trace."""
    left_out: int
    """Steps left out (one over both limits counts once)."""
    reasons: tuple[tuple[str, int], ...]
    """(why, steps) per scheduler limit, e.g. ("num_reqs above scheduler.max_num_seqs=128", 5)."""

    def __str__(self) -> str:
        if not self.left_out:
            return f"all {self.steps} steps priced"
        why = ", ".join(f"{k} with {why}" for why, k in self.reasons)
        return (
            f"{self.left_out} of {self.steps} steps left out ({why}): this plan's scheduler "
            "never runs them"
        )


def left_out(trace: Trace, table: DispatchTable) -> LeftOut:
    """Which steps ``fit_trace`` leaves out, and why, counted over the whole trace (a row that
    stands for ``count`` steps counts ``count`` times)."""
    limits = _over_limits(trace, table)
    over = np.zeros(len(trace.num_tokens), dtype=bool)
    for bad, *_ in limits:
        over |= bad
    c = trace.counts
    return LeftOut(
        steps=trace.steps,
        left_out=int(c[over].sum()),
        reasons=tuple(
            (f"{key} above scheduler.{limit}={value}", int(c[bad].sum()))
            for bad, key, _, limit, value in limits
            if bad.any()
        ),
    )


def fit_trace(trace: Trace, table: DispatchTable) -> tuple[Trace, list[str]]:
    """The steps of ``trace`` the plan's scheduler could produce, and warnings about the rest.

    Steps with more tokens than max_num_batched_tokens or more requests than max_num_seqs are
    left out (a warning per limit, naming the first line); a trace whose uniform batches have
    another query length than the plan's decode_query_len gets a warning (its decode steps route
    as mixed batches). What is left must pass ``check_trace``; a trace with nothing left is an
    error."""
    n, r, m, c = trace.num_tokens, trace.num_reqs, trace.max_query_len, trace.counts
    name, warnings_, total = table.plan.get("name", "plan"), [], trace.steps
    over = np.zeros(len(n), dtype=bool)
    for bad, key, got, limit, value in _over_limits(trace, table):
        if bad.any():
            i, more = int(np.argmax(bad)), int(c[bad].sum()) - int(c[np.argmax(bad)])
            warnings_.append(
                f"{trace.source}:{trace.line[i]}: {key} {int(got[i])} exceeds scheduler.{limit}="
                f"{value} of plan {name}"
                + (f", as do {more} more of {total} steps" if more else "")
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
            count=c[keep],
            header=trace.header,
        )
        n, r, m, c = trace.num_tokens, trace.num_reqs, trace.max_query_len, trace.counts
    check_trace(trace, table)
    # uniform batches at their own query length (a decode at whatever q the trace had)
    uniform = is_uniform_decode(n, r, m, m) & (m <= QUERY_LEN_PROBE)
    lens, where = np.unique(m[uniform], return_inverse=True)
    counts = np.bincount(where.ravel(), weights=c[uniform], minlength=len(lens)).astype(np.int64)
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
    header: dict | None = None
    """The workload file's header (where the steps came from), if it had one."""

    @property
    def steps(self) -> int:
        return int(self.count.sum())


def aggregate(trace: Trace, q: int) -> Workload:
    n, r, m = trace.num_tokens, trace.num_reqs, trace.max_query_len
    uniform = is_uniform_decode(n, r, m, q)
    key = n * 2 + (~uniform)
    keys, first, where = np.unique(key, return_index=True, return_inverse=True)
    count = np.bincount(where.ravel(), weights=trace.counts, minlength=len(keys))
    return Workload(
        tokens=keys // 2,
        uniform=(keys % 2) == 0,
        count=np.rint(count).astype(np.int64),  # exact: sums stay below 2**53 (MAX_STEPS)
        reqs=r[first],
        query_len=m[first],
        header=trace.header,
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
