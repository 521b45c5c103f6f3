"""PlanSpec -> DispatchTable: rules that span fields, modes, sizes, LoRA cases, keys, routes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .errors import Diagnostic, PlanError
from .modes import resolve_mode
from .records import (
    ROUTINES,
    BatchDescriptor,
    CudagraphMode,
    Graph,
    RuntimeMode,
    TableSettings,
    UbatchSettings,
    decode_token_range,
    padded_num_reqs,
)
from .sizes import resolve_sizes
from .spec import LoraSpec, PlanSpec, plan_from_dict

MAX_WORLD = 1024
"""Most ranks (data_parallel_size x tensor_parallel_size) a plan may ask for."""
STRICT_CODES = frozenset({"mode-downgrade", "size-dropped", "size-rounded"})
"""Diagnostics that ``strict: true`` turns into errors: each loses throughput silently."""


def check_rules(spec: PlanSpec) -> list[Diagnostic]:
    """Rules that span fields; returns warnings, raises one PlanError listing every error."""
    s, ub = spec.scheduler, spec.parallel.ubatch
    errors: list[Diagnostic] = []
    warnings: list[Diagnostic] = []

    def error(code: str, path: str, message: str, hint: str) -> None:
        errors.append(
            Diagnostic(code=code, path=path, message=message, hint=hint, severity="error")
        )

    if s.max_num_batched_tokens < s.max_num_seqs:
        error(
            "tokens-below-seqs",
            "scheduler.max_num_batched_tokens",
            f"{s.max_num_batched_tokens} is below max_num_seqs={s.max_num_seqs}; every request "
            "needs at least one token per step",
            f"raise it to at least {s.max_num_seqs}",
        )
    largest_decode = decode_token_range(s.decode_query_len, s.max_num_seqs)[-1]
    if s.decode_query_len > s.max_num_batched_tokens:
        error(
            "query-len-above-tokens",
            "scheduler.decode_query_len",
            f"{s.decode_query_len} exceeds max_num_batched_tokens={s.max_num_batched_tokens}",
            "lower the number of speculative tokens",
        )
    elif largest_decode > s.max_num_batched_tokens:
        warnings.append(
            Diagnostic(
                code="decode-capped",
                path="scheduler.decode_query_len",
                message=f"a decode step of all max_num_seqs={s.max_num_seqs} requests needs "
                f"{largest_decode} tokens > max_num_batched_tokens="
                f"{s.max_num_batched_tokens}; at most {s.max_num_batched_tokens // s.decode_query_len}"
                " requests decode together",
                hint="raise max_num_batched_tokens or lower max_num_seqs",
            )
        )
    if ub.enabled:
        if spec.parallel.data_parallel_size < 2:
            error(
                "ubatch-needs-dp",
                "parallel.ubatch.enabled",
                "micro-batching (DBO) overlaps the communication between DP ranks, and "
                "data_parallel_size is 1",
                "set parallel.data_parallel_size >= 2 or disable ubatch",
            )
        for name in ("decode_token_threshold", "prefill_token_threshold"):
            value = getattr(ub, name)
            if value < ub.num_ubatches:
                error(
                    "ubatch-threshold",
                    f"parallel.ubatch.{name}",
                    f"{value} is below num_ubatches={ub.num_ubatches}: a micro-batch would be "
                    "empty",
                    f"set it to at least {ub.num_ubatches}",
                )
    dp, tp = spec.parallel.data_parallel_size, spec.parallel.tensor_parallel_size
    if dp * tp > MAX_WORLD:
        error(
            "world-too-large",
            "parallel.tensor_parallel_size",
            f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp} ranks, above "
            f"{MAX_WORLD}",
            f"lower one of them so that their product is at most {MAX_WORLD}",
        )
    if errors:
        raise PlanError(errors)
    return warnings


def lora_cases(lora: LoraSpec) -> tuple[list[int], list[int]]:
    """Captured active-adapter counts, and for each count 0..max_loras+1 the case it rounds up to."""
    if not lora.enabled:
        return [0], [0]
    top = lora.max_loras + 1
    if lora.specialize_count:
        cases = [n for n in range(1, top + 1) if n & (n - 1) == 0 or n == top]
    else:
        cases = [top]
    if lora.separate_base:
        cases = [0] + cases
    of_count = [next(i for i, c in enumerate(cases) if c >= n) for n in range(top + 1)]
    return cases, of_count


def graph_keys(
    spec: PlanSpec, mode: CudagraphMode, sizes: list[int], cases: list[int]
) -> list[tuple[str, RuntimeMode, BatchDescriptor]]:
    """Every graph to capture, unordered: (routine, mode, key)."""
    q, seqs = spec.scheduler.decode_query_len, spec.scheduler.max_num_seqs
    ub = spec.parallel.ubatch
    out = []
    decode_range = decode_token_range(q, seqs)  # FULL decode sizes are multiples of q (sizes.py)
    decode_sizes = [s for s in sizes if s in decode_range]
    for lora in cases:
        has = lora > 0
        for s in sizes:
            if mode.mixed_mode is RuntimeMode.FULL:
                out.append(
                    (
                        "full_mixed",
                        RuntimeMode.FULL,
                        BatchDescriptor(
                            num_tokens=s,
                            num_reqs=padded_num_reqs(s, seqs),
                            uniform=False,
                            has_lora=has,
                            num_active_loras=lora,
                        ),
                    )
                )
            elif mode.mixed_mode is RuntimeMode.PIECEWISE:
                out.append(
                    (
                        "piecewise",
                        RuntimeMode.PIECEWISE,
                        BatchDescriptor(
                            num_tokens=s,
                            num_reqs=None,
                            uniform=False,
                            has_lora=has,
                            num_active_loras=lora,
                        ),
                    )
                )
        if mode.decode_mode is not RuntimeMode.FULL:
            continue
        for s in decode_sizes:
            ubatched = ub.enabled and s >= ub.decode_token_threshold
            key = BatchDescriptor(
                num_tokens=s,
                num_reqs=padded_num_reqs(s, seqs, q),
                uniform=True,
                has_lora=has,
                num_active_loras=lora,
            )
            if mode.separate_routine and (ub.plain_twins or not ubatched):
                out.append(("full_decode", RuntimeMode.FULL, key))
            if ubatched:
                out.append(
                    (
                        "full_decode_ubatched",
                        RuntimeMode.FULL,
                        replace(key, num_ubatches=ub.num_ubatches),
                    )
                )
    return out


def check_graph_count(
    spec: PlanSpec, mode: CudagraphMode, sizes: list[int], cases: list[int]
) -> None:
    """Refuse a plan whose graphs would exceed ``limits.max_graphs``, whatever produced them
    (presets with large ceilings, ranges, lists, many LoRA cases)."""
    limit = spec.limits.max_graphs
    # every LoRA case captures the same keys: count one case, multiply
    count = len(graph_keys(spec, mode, sizes, cases[:1])) * len(cases) if sizes else 0
    if count > limit:
        raise PlanError(
            [
                Diagnostic(
                    code="too-many-graphs",
                    path="limits.max_graphs",
                    severity="error",
                    message=f"the plan compiles to {count} graphs ({len(sizes)} capture sizes x "
                    f"{len(cases)} LoRA case(s) x routines); the limit is {limit}",
                    hint=f"use fewer capture sizes (a smaller preset ceiling, ranges with a larger "
                    f"step) or fewer LoRA cases; to capture this many on purpose, set "
                    f"limits.max_graphs: {count}",
                )
            ]
        )


def capture_order(keys):
    """PIECEWISE first, then FULL; each largest (num_tokens, num_active_loras) first."""
    return sorted(
        keys,
        key=lambda k: (
            k[1] is RuntimeMode.FULL,
            -k[2].num_tokens,
            -k[2].num_active_loras,
            -k[2].num_ubatches,
            not k[2].uniform,
        ),
    )


def resolve(spec: PlanSpec, plan: dict) -> tuple[dict, list[Diagnostic]]:
    """Resolve a validated plan. ``plan`` is the normalized dict (defaults filled) it came from.
    Returns DispatchTable's constructor arguments and the diagnostics."""
    diags = check_rules(spec)
    q = spec.scheduler.decode_query_len
    mode, mode_diags = resolve_mode(spec.cudagraph, q)
    diags += mode_diags
    sizes: list[int] = []
    if mode is not CudagraphMode.NONE:
        sizes, size_diags = resolve_sizes(
            spec.cudagraph.capture_sizes,
            spec.scheduler,
            round_to_q=mode.decode_mode is RuntimeMode.FULL,
        )
        diags += size_diags
        decode_top = decode_token_range(q, spec.scheduler.max_num_seqs)[-1]
        if mode.mixed_mode is RuntimeMode.NONE and sizes and sizes[-1] > decode_top:
            unused = [s for s in sizes if s > decode_top]
            diags.append(
                Diagnostic(
                    code="size-unused",
                    path="cudagraph.capture_sizes",
                    message=f"{len(unused)} size(s) above q*max_num_seqs={decode_top} capture nothing "
                    f"in mode {mode.name} (no mixed routine): {unused[0]}..{unused[-1]}",
                    hint=f"lower the preset ceiling to {decode_top}",
                )
            )
        missing = [p for p in spec.cudagraph.pinned_sizes if p not in sizes]
        if missing:
            diags.append(
                Diagnostic(
                    code="pinned-size-not-captured",
                    path="cudagraph.pinned_sizes",
                    message=f"{len(missing)} pinned size(s) are not capture sizes of this plan: "
                    f"{sorted(missing)[:16]}; plan optimize adds them to the list it writes",
                    hint="list them in capture_sizes too, or drop them from pinned_sizes",
                )
            )
        if not sizes:
            diags.append(
                Diagnostic(
                    code="no-sizes",
                    path="cudagraph.capture_sizes",
                    message="no capture sizes remain: every batch runs eager",
                    hint="add sizes <= max_num_batched_tokens",
                )
            )
    ub = spec.parallel.ubatch
    if ub.enabled and mode.decode_mode is not RuntimeMode.FULL:
        diags.append(
            Diagnostic(
                code="ubatch-no-graphs",
                path="parallel.ubatch.enabled",
                message=f"mode {mode.name} has no FULL decode graphs, so "
                "micro-batched steps run eager",
                hint="use a FULL decode mode",
            )
        )
    if spec.cudagraph.strict:
        strict = [d for d in diags if d.code in STRICT_CODES]
        if strict:
            raise PlanError(
                [
                    Diagnostic(
                        **{
                            **_fields(d),
                            "severity": "error",
                            "hint": d.hint + "; or set strict: false",
                        }
                    )
                    for d in strict
                ]
            )
    cases, of_count = lora_cases(spec.lora)
    check_graph_count(spec, mode, sizes, cases)  # before any graph is built
    ordered = capture_order(graph_keys(spec, mode, sizes, cases))
    graphs = tuple(Graph(id=i, mode=m, key=k, routine=r) for i, (r, m, k) in enumerate(ordered))
    size_pos = {s: i for i, s in enumerate(sizes)}
    case_pos = {c: i for i, c in enumerate(cases)}
    routes = {r: np.full((len(cases), len(sizes)), -1, dtype=np.int32) for r in ROUTINES}
    for g in graphs:
        routes[g.routine][case_pos[g.key.num_active_loras], size_pos[g.key.num_tokens]] = g.id
    settings = TableSettings(
        name=spec.name,
        mode=mode,
        requested_mode=spec.cudagraph.mode,
        attention_support=spec.cudagraph.attention_support,
        splitting_ops=spec.cudagraph.splitting_ops,
        decode_query_len=q,
        max_num_seqs=spec.scheduler.max_num_seqs,
        max_num_batched_tokens=spec.scheduler.max_num_batched_tokens,
        capture_sizes=tuple(sizes),
        lora_enabled=spec.lora.enabled,
        lora_cases=tuple(cases),
        lora_case_of_count=tuple(of_count),
        ubatch=UbatchSettings(
            enabled=ub.enabled,
            num_ubatches=ub.num_ubatches,
            decode_token_threshold=ub.decode_token_threshold,
            prefill_token_threshold=ub.prefill_token_threshold,
            plain_twins=ub.plain_twins,
        ),
        data_parallel_size=spec.parallel.data_parallel_size,
        tensor_parallel_size=spec.parallel.tensor_parallel_size,
        dp_backend=spec.parallel.backend,
        sync_timeout_s=float(spec.parallel.sync_timeout_s),
        on_demand=spec.cudagraph.on_demand.enabled,
        start_sizes=start_sizes(spec.cudagraph.on_demand, sizes, diags),
    )
    parts = dict(
        plan=plan,
        settings=settings,
        graphs=graphs,
        routes=routes,
        diagnostics=tuple(d.to_json() for d in diags),
    )
    return parts, diags


def start_sizes(on_demand, sizes: list[int], diags: list[Diagnostic]) -> tuple[int, ...]:
    """The capture sizes captured at start with on-demand capture: the largest, and the size each
    start size pads to (a start size above the largest is dropped, with a warning)."""
    if not on_demand.enabled or not sizes:
        return ()
    out, above = {sizes[-1]}, []
    for s in on_demand.start_sizes:
        if s > sizes[-1]:
            above.append(s)
        else:
            out.add(next(c for c in sizes if c >= s))
    if above:
        diags.append(
            Diagnostic(
                code="start-size-dropped",
                path="cudagraph.on_demand.start_sizes",
                message=f"{len(above)} start size(s) above the largest capture size {sizes[-1]} "
                f"run eager and capture nothing: {sorted(above)}",
                hint="list sizes up to the largest capture size",
            )
        )
    return tuple(sorted(out))


def resolve_plan_dict(plan: dict) -> dict:
    """DispatchTable's constructor arguments for a plan dict with every default filled (as a
    table embeds it); no schema check, so a malformed dict raises what building it raises."""
    return resolve(plan_from_dict(plan), plan)[0]


def _fields(d: Diagnostic) -> dict:
    return {f: getattr(d, f) for f in Diagnostic.__slots__}
