"""``plan optimize``: capture sizes that minimise the padding a workload pays, exactly.

Objective. Given a trace and a plan, choose capture sizes S minimising the *padded tokens*
``sum over steps that land on a graph of (padded_tokens - num_tokens)``, where a step routes as in
``compiler.trace.step_route``. Subject to:
- graphs: the table compiled with S has at most ``max_graphs`` graphs (all routines, LoRA cases
  and ubatch variants counted); with ``memory_budget``, the memory model (``tools.memory``)
  fits: ``base + per_graph * graphs + per_token * max(S) <= budget``; with ``capture_budget``,
  the capture-time model fits: ``base_capture + per_graph_capture * graphs <= seconds``. Each is
  a graph count (the largest size is fixed), so the DP runs under the smallest;
- coverage: ``max(S) = top``, by default the plan's current largest size (``--max-size`` moves it),
  so the steps above it run eager exactly as before; and every step at or below ``top`` gets the
  strongest runtime mode any legal size >= its token count would give it: no step is pushed to
  eager, and no decode step that could replay a FULL graph is padded onto a PIECEWISE one;
- legality: sizes are <= max_num_batched_tokens and, when decode is FULL with q > 1, multiples of q
  (what the compiler would round them to); pinned sizes (``--pin``, the plan's
  ``cudagraph.pinned_sizes``) are kept, and nothing else is: a preset, ranges and an explicit list
  are all tuned alike; with ``keep_small`` (the CLI's default; ``--no-small`` turns it off)
  so are the plan's sizes below the trace's smallest step, so batches the trace never saw but a
  server still runs (a lone decode) pad as they did before rather than to the trace's smallest size.
  ``Result.kept`` says which sizes were kept and why.
Ties go to the fewest graphs. Decode and mixed steps share the sizes, so both are priced together.
The same DP gives the optimum under every smaller graph budget too: ``curve_graphs`` returns that
trade-off curve (padded tokens against graphs) up to the given count.

Exactness. An optimal S exists within the candidates: the observed token counts <= top (rounded
up to legal sizes), the pins, ``top``, and the first legal size of every interval on which the
graphs a size gets are constant (they change only at q, q * max_num_seqs + 1 and the ubatch decode
threshold): lowering a chosen size to the largest observed count below it within its interval
never costs more. The DP in ``compiler.size_dp`` is exact over these candidates. Above
``MAX_CANDIDATES`` candidates, observed counts are first rounded up to a coarser grid (stated in
the result); the optimum is then exact for that grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GraphplanError
from ..records import CudagraphMode, RuntimeMode, decode_token_range
from ..table import DispatchTable
from .memory import DEFAULT_PROFILE, capture_model, check_profile
from .size_dp import min_units, solve_with_curve
from .trace import Padding, Workload, padding, step_route

MAX_CANDIDATES = 4000


class OptimizeError(GraphplanError):
    """The optimization cannot run as asked (budget too small, bad pin, a plan without graphs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    sizes: tuple[int, ...]
    top: int
    graphs: int
    budget_graphs: int
    """The graph limit the DP ran under: the least of ``limits``."""
    limits: dict
    """Each budget given, as a graph count: {"--max-graphs": K, "--memory-budget": ..., ...}."""
    padded_tokens: int
    """The DP's optimum; equals ``after.padded_tokens``."""
    before: Padding
    after: Padding
    table: DispatchTable
    """The table compiled from the tuned plan."""
    grid: int
    """Candidate grid step (1, or q, unless the trace had more than MAX_CANDIDATES sizes)."""
    notes: tuple[str, ...]
    kept: tuple[tuple[int, str], ...] = ()
    """(size, why) for every size kept whatever the trace says: the pins (``--pin``, the plan's
    ``cudagraph.pinned_sizes``) and, with ``keep_small``, the plan's sizes below the trace."""
    curve: tuple[tuple[int, int], ...] = ()
    """(graph budget, least padded tokens within it) for every budget up to ``curve_graphs``
    at which some size set fits, in steps of the LoRA case count."""


def rank_start_sizes(after: Padding, sizes, k: int) -> tuple[int, ...]:
    """The ``k`` capture sizes most steps of a trace land on (ties: the larger size), plus the
    largest size: what ``cudagraph.on_demand.start_sizes`` captures at start."""
    ranked = sorted(after.by_size.items(), key=lambda kv: (-kv[1][0], -kv[0]))
    return tuple(
        sorted({int(s) for s, _ in ranked[: max(k, 0)]} | ({int(sizes[-1])} if sizes else set()))
    )


def _ceil_to(x, step):
    return -(-np.asarray(x) // step) * step


def _with_sizes(plan: dict, sizes, lora: bool = True) -> DispatchTable:
    from .. import compile_plan

    cg = dict(plan["cudagraph"], capture_sizes=[int(s) for s in sizes], strict=False)
    d = dict(plan, cudagraph=cg)
    if not lora:
        d["lora"] = dict(plan["lora"], enabled=False)
    return compile_plan(d)


def optimize(
    table: DispatchTable,
    work: Workload,
    max_graphs: int,
    *,
    pins: dict[int, str] | tuple | list = (),
    max_size=None,
    memory_budget=None,
    capture_budget=None,
    profile=None,
    keep_small: bool = False,
    curve_graphs: int | None = None,
) -> Result:
    """Tuned capture sizes for ``table``'s plan over ``work``; see the module docstring."""
    r = table.settings
    if r.mode is CudagraphMode.NONE:
        raise OptimizeError(
            f"plan {table.settings.name}: mode NONE captures no graphs, so there "
            "are no sizes to optimize (pick a mode with graphs)"
        )
    q, seqs, limit = r.decode_query_len, r.max_num_seqs, r.max_num_batched_tokens
    step = q if r.decode_mode is RuntimeMode.FULL and q > 1 else 1
    notes: list[str] = []
    given = pins.items() if isinstance(pins, dict) else ((p, "--pin") for p in pins)
    reason = {int(p): str(w) for p, w in given}  # size -> why it is kept
    pins = sorted(reason)
    legal = f"multiples of decode_query_len={q} " if step > 1 else ""
    for p in pins:
        if not 1 <= p <= limit or p % step:
            flag = "--pin" if reason[p] == "--pin" else "cudagraph.pinned_sizes:"
            raise OptimizeError(
                f"{flag} {p}: this plan's capture sizes are {legal}in 1..{limit} "
                "(max_num_batched_tokens); pin a size that is"
            )
    top = (
        max_size
        if max_size is not None
        else (table.capture_sizes[-1] if table.capture_sizes else 0)
    )
    if max_size is not None and not step <= max_size <= limit:
        raise OptimizeError(
            f"--max-size {max_size}: must be in {step}..{limit} (max_num_batched_tokens)"
        )
    if top < 1:
        raise OptimizeError("the plan has no capture sizes; give --max-size N for the largest size")
    top = int(_ceil_to(top, step)) if int(_ceil_to(top, step)) <= limit else top - top % step
    if pins and pins[-1] > top:
        notes.append(f"the largest size is the pinned {pins[-1]} (above {top})")
        top = pins[-1]
    extra: list[int] = []
    decode_top = decode_token_range(q, seqs)[-1]
    if r.mixed_mode is RuntimeMode.NONE and top > decode_top:  # no graph above the decode range
        extra = [p for p in pins if p > decode_top]
        notes.append(
            f"mode {r.mode.name} has no mixed graphs: sizes stop at q*max_num_seqs="
            f"{decode_top}" + (f"; pinned {extra} kept, capturing nothing" if extra else "")
        )
        top = decode_top
    pins = [p for p in pins if p <= top]
    if keep_small and len(work.tokens):
        smallest = int(work.tokens.min())
        small = [s for s in table.capture_sizes if s < smallest and s <= top and s % step == 0]
        if small:
            from .summary import compact_sizes

            pins = sorted(set(pins) | set(small))
            for s in small:
                reason.setdefault(s, f"below the trace's smallest step ({smallest} tokens)")
            notes.append(
                f"kept the plan's {len(small)} size(s) below the trace's smallest step "
                f"({smallest} tokens): {compact_sizes(small)}, so smaller batches pad "
                "as before (--no-small lets them go)"
            )

    # -- candidates ---------------------------------------------------------------------------
    observed = work.tokens[work.tokens <= top]
    ub = r.ubatch
    starts = [step, q, decode_top + 1] + ([ub.decode_token_threshold] if ub.enabled else [])
    fixed = set(int(s) for s in _ceil_to(starts, step) if s <= top) | set(pins) | {top}
    grid = step
    cand = np.union1d(_ceil_to(observed, grid), list(fixed))
    while len(cand) > MAX_CANDIDATES and grid < top:
        grid += step
        cand = np.union1d(np.minimum(_ceil_to(observed, grid), top), list(fixed))
    if len(cand) > MAX_CANDIDATES:
        raise OptimizeError(
            f"{len(pins)} pinned sizes: at most {MAX_CANDIDATES} candidates (pin fewer sizes)"
        )
    if grid != step:
        notes.append(
            f"{len(np.unique(observed))} distinct token counts: candidates rounded up to "
            f"multiples of {grid}; the optimum is exact over that grid"
        )
    cand = cand.astype(np.int64)
    D = len(cand)

    # -- what each candidate costs and which routines land on it --------------------------------
    probe = _with_sizes(table.plan, cand, lora=False)
    n_cases = len(r.lora_cases)
    weight = np.bincount(
        np.searchsorted(cand, [g.key.num_tokens for g in probe.graphs]), minlength=D
    ).astype(np.int64)
    if weight.min() < 1:  # sizes outside every routine were cut above; this cannot happen
        raise GraphplanError(
            f"internal: capture size {cand[np.argmin(weight)]} would capture no "
            "graph; please report this with the plan"
        )
    keep = work.tokens <= top
    n, u, cnt = work.tokens[keep], work.uniform[keep], work.count[keep]
    reqs, mql = work.reqs[keep], work.query_len[keep]
    thr = np.where(u, ub.decode_token_threshold, ub.prefill_token_threshold)
    klass = u * 2 + (ub.enabled & (n >= thr))
    at = np.searchsorted(cand, n)  # smallest candidate >= n
    best = np.zeros(len(n), dtype=np.int64)  # the strongest mode a step can get (0: always eager)
    m_bad = np.zeros(D, dtype=np.int64)  # largest n <= c_j that would get less than its best
    for k in np.unique(klass):
        g = np.flatnonzero(klass == k)
        rep = g[0]  # the mode depends on the class and the size only
        quality = np.array(
            [
                int(
                    step_route(
                        probe, int(n[rep]), int(reqs[rep]), int(mql[rep]), pad_to=int(c)
                    ).mode
                )
                if c >= n[rep]
                else 0
                for c in cand
            ]
        )
        best[g] = np.maximum.accumulate(quality[::-1])[::-1][at[g]]
        for v in np.unique(quality):
            ns = np.sort(n[g][best[g] > v])
            if len(ns):
                below = np.searchsorted(ns, cand, side="right") - 1
                worst = np.where(below >= 0, ns[np.maximum(below, 0)], 0)
                m_bad = np.maximum(m_bad, np.where(quality == v, worst, 0))
    graphable = best > 0
    if not graphable.any():
        notes.append(
            f"no step at or below {top} tokens can land on a graph of this plan (mode "
            f"{r.mode.name}, q={q}): the fewest sizes are kept"
        )
    full = np.concatenate(([0], cand))
    lo = np.concatenate(([0], np.searchsorted(full, m_bad, side="left")))
    pin_at = np.concatenate(([0], np.searchsorted(full, pins)))  # a link may not skip a pin
    lo = np.maximum(lo, pin_at[np.maximum(np.searchsorted(pin_at, np.arange(D + 1)) - 1, 0)])
    W = np.cumsum(np.bincount(at[graphable] + 1, weights=cnt[graphable], minlength=D + 1))
    S = np.cumsum(np.bincount(at[graphable] + 1, weights=(cnt * n)[graphable], minlength=D + 1))
    W, S = np.rint(W).astype(np.int64), np.rint(S).astype(np.int64)

    # -- budget ----------------------------------------------------------------------------------
    limits = {"--max-graphs": max_graphs}
    if memory_budget is not None:
        prof = DEFAULT_PROFILE if profile is None else check_profile(profile)
        per_graph = prof["per_graph_bytes"]
        room = memory_budget - prof.get("base_bytes", 0.0) - prof["per_token_bytes"] * top
        # what the graphs' overhead may use
        if room < 0:
            raise OptimizeError(
                f"--memory-budget {memory_budget / 2**20:.1f} MiB: the activations "
                f"of a {top}-token graph alone need "
                f"{prof['per_token_bytes'] * top / 2**20:.1f} MiB"
            )
        if per_graph > 0:
            limits["--memory-budget"] = int(room // per_graph)
    if capture_budget is not None:
        base, per_graph_s, source = capture_model(profile)
        if not 0 < capture_budget < float("inf"):
            raise OptimizeError(
                f"--budget-capture-seconds {capture_budget:g}: give a number of seconds > 0"
            )
        if capture_budget < base:
            raise OptimizeError(
                f"--budget-capture-seconds {capture_budget:g}: capturing anything takes "
                f"{base:g} s ({source})"
            )
        if per_graph_s > 0:
            limits["--budget-capture-seconds"] = int((capture_budget - base) / per_graph_s + 1e-9)
    why = min(limits, key=limits.__getitem__)
    budget = limits[why]
    units = budget // n_cases
    need = min_units(weight, lo, units)
    if need is None:
        least = min_units(weight, lo, 1 << 62)
        raise OptimizeError(
            f"{why} allows {budget} graphs; the largest size {top}"
            + (", the pinned sizes" if pins else "")
            + " and keeping every step on its best graph "
            + (
                f"need at least {least * n_cases} (raise it)"
                if least is not None
                else "need more graphs than any budget allows"
            )
        )
    best, costs = solve_with_curve(cand, weight, lo, W, S, units, (curve_graphs or 0) // n_cases)
    cost, _, chosen = best
    curve = tuple((k * n_cases, c) for k, c in enumerate(costs) if c is not None and k)
    sizes = sorted(set(int(cand[j - 1]) for j in chosen) | set(extra))
    after_table = _with_sizes(table.plan, sizes)
    return Result(
        sizes=tuple(sizes),
        top=top,
        graphs=len(after_table.graphs),
        budget_graphs=budget,
        limits=limits,
        padded_tokens=cost,
        before=padding(table, work),
        after=padding(after_table, work),
        table=after_table,
        grid=grid,
        notes=tuple(notes),
        kept=tuple((p, reason[p]) for p in sorted(reason) if p in sizes),
        curve=curve if curve_graphs else (),
    )
