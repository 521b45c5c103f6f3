"""Capture sizes (docs/semantics.md §3, §4): presets, explicit lists, ranges, spec-decode rounding.

Pure functions over ints. Sizes count tokens; the sglang and trtllm presets count requests in their
own systems, so their lists are multiplied by q here.
"""

from __future__ import annotations

import math

from .errors import Diagnostic, plan_error
from .spec import CaptureSizesSpec, SchedulerSpec

MAX_SIZES = 4096
"""More capture sizes than this is a mistake (each one is a graph per LoRA case and routine); the
bound applies to lists, ranges and presets alike. ``limits.max_graphs`` bounds the graphs."""

_PATH = "cudagraph.capture_sizes"


def _grid(limit: int) -> list[int]:
    """vLLM's step grid ``[1, 2, 4] + range(8, .., 8) + range(256, .., 16)`` up to ``limit``."""
    return (
        [s for s in (1, 2, 4) if s <= limit]
        + list(range(8, min(limit + 1, 256), 8))
        + list(range(256, limit + 1, 16))
    )


def vllm_max(sched: SchedulerSpec, ceiling: int) -> int:
    """The vllm preset's max: ``min(max_num_seqs * q * 2, ceiling, max_num_batched_tokens)``."""
    return min(
        sched.max_num_seqs * sched.decode_query_len * 2, ceiling, sched.max_num_batched_tokens
    )


def vllm_sizes(sched: SchedulerSpec, ceiling: int) -> list[int]:
    """vLLM's default list (its ``CompilationConfig`` capture-size generation)."""
    q, seqs, tokens = sched.decode_query_len, sched.max_num_seqs, sched.max_num_batched_tokens
    top = vllm_max(sched, ceiling)
    sizes = set(_grid(top))
    if tokens <= top:
        sizes.add(tokens)
    if q == 1:
        if seqs <= top:
            sizes.add(seqs)
    else:
        sizes.update(n * q for n in set(_grid(seqs)) | {seqs} if n * q <= top)
    return sorted(sizes)


def sglang_sizes(sched: SchedulerSpec, max_bs: int) -> list[int]:
    """SGLang's ``_generate_decode_cuda_graph_batch_sizes`` (server_args.py, 2026); default
    max_bs 256 (its H100/H200 default at tp < 4), capped at max_num_seqs. Batch sizes are requests;
    each is multiplied by q to count tokens."""
    q, seqs = sched.decode_query_len, sched.max_num_seqs
    top = min(max_bs or 256, seqs, sched.max_num_batched_tokens // q)
    if q == 1:
        bs = (
            [1, 2, 4, 8, 12]
            + list(range(16, 257, 8))
            + list(range(272, 512, 16))
            + list(range(512, top + 1, 32))
        )
    else:  # SGLang's denser list for speculative decoding
        bs = (
            list(range(1, 9))
            + list(range(10, 33, 2))
            + list(range(40, 65, 4))
            + list(range(72, 257, 8))
            + list(range(272, top + 1, 16))
        )
    bs = [b for b in bs if b <= top]
    if top >= 1 and top not in bs:
        bs.append(top)
    return sorted(b * q for b in bs)


TRTLLM_RULES = ("pow2-floor", "pow2-ceil", "step64")
"""The three ways TensorRT-LLM releases generate a default ``cuda_graph_config`` list
(``CudaGraphConfig._generate_cuda_graph_batch_sizes``, tensorrt_llm/llmapi/llm_args.py; which
release uses which: ``engines.trtllm.size_rule`` and docs/engines.md)."""


def trtllm_generated(max_bs: int, padding: bool, rule: str = "step64") -> list[int]:
    """TensorRT-LLM's generated batch sizes (requests) for ``max_batch_size`` ``max_bs`` >= 1.

    Base: with padding ``[1, 2, 4] + [8, 16, ..., 128]``, without ``range(1, 32) + [32, 64, 128]``.
    ``pow2-floor`` (v1.0.0) adds ``2**i for i in range(8, floor(log2(max)))``; ``pow2-ceil``
    (v1.1.0rc0 .. v1.3.0rc11) the same up to ``ceil(log2(max))``; ``step64`` (v1.3.0rc13 and main,
    PR #12895) steps the padded list by 64 while ``<= max`` and keeps ``pow2-ceil`` unpadded. Then
    entries above max go and max is appended if not last. ``log2`` is ``math.log(max, 2)`` as
    TensorRT-LLM computes it (a float)."""
    if rule not in TRTLLM_RULES:
        raise ValueError(f"unknown TensorRT-LLM size rule {rule!r}")
    if padding:
        bs = [1, 2, 4] + list(range(8, 129, 8))
    else:
        bs = list(range(1, 32)) + [32, 64, 128]
    if padding and rule == "step64":
        while bs[-1] + 64 <= max_bs:
            bs.append(bs[-1] + 64)
    else:
        log = math.log(max_bs, 2)
        bs += [2**i for i in range(8, math.floor(log) if rule == "pow2-floor" else math.ceil(log))]
    bs = sorted(b for b in bs if b <= max_bs)
    return bs if bs and bs[-1] == max_bs else bs + [max_bs]


def trtllm_filtered(
    batch_sizes: list[int], max_batch_size: int, max_num_tokens: int, q: int, padding: bool
) -> list[int]:
    """TensorRT-LLM's ``_filter_cuda_graph_batch_sizes`` (pyexecutor/model_engine.py): keep the
    sizes up to ``min(max_batch_size, max_num_tokens // q)`` (the largest all-decode batch); with
    padding, a size above that cap adds the cap itself (PR #4843), without padding it is dropped."""
    cap = min(max_batch_size, max_num_tokens // q)
    if cap < 1:
        return []
    out: list[int] = []
    for b in sorted(batch_sizes):
        if b <= cap:
            out.append(b)
            continue
        if padding and (not out or out[-1] != cap):
            out.append(cap)
        break
    return out


def trtllm_sizes(sched: SchedulerSpec, max_bs: int, padding: bool) -> list[int]:
    """The ``trtllm`` preset: TensorRT-LLM's newest default list (``step64``) for
    ``max_batch_size`` ``max_bs`` (0: its default 128), cut by its own filter at max_num_seqs and
    ``max_num_batched_tokens // q``. Batch sizes are requests, multiplied by q (tokens)."""
    q = sched.decode_query_len
    generated = trtllm_generated(max_bs or 128, padding)
    kept = trtllm_filtered(generated, sched.max_num_seqs, sched.max_num_batched_tokens, q, padding)
    return [b * q for b in kept]


def requested_sizes(cs: CaptureSizesSpec, sched: SchedulerSpec) -> list[tuple[int, str]]:
    """The sizes a plan asks for, each with the plan path that asked for it."""
    if cs.kind == "list":
        if len(cs.sizes) > MAX_SIZES:
            raise plan_error(
                "too-many-sizes",
                _PATH,
                f"{len(cs.sizes)} sizes; at most {MAX_SIZES}",
                "use {preset: vllm} or ranges with a larger step",
            )
        return [(s, f"{_PATH}[{i}]") for i, s in enumerate(cs.sizes)]
    if cs.kind == "ranges":
        out: list[tuple[int, str]] = []
        for j, r in enumerate(cs.ranges):
            where = f"{_PATH}.ranges[{j}]"
            if r.to < r.start:
                raise plan_error(
                    "bad-range", where, f"to ({r.to}) is below from ({r.start})", "swap them"
                )
            count = (r.to - r.start) // r.step + 1
            if len(out) + count > MAX_SIZES:
                raise plan_error(
                    "too-many-sizes",
                    where,
                    f"the ranges generate more than {MAX_SIZES} sizes",
                    "use a larger step",
                )
            out += [(s, where) for s in range(r.start, r.to + 1, r.step)]
        return out + [(s, f"{_PATH}.include[{i}]") for i, s in enumerate(cs.include)]
    if cs.preset == "vllm":
        sizes = vllm_sizes(sched, cs.ceiling)
    elif cs.preset == "sglang":
        sizes = sglang_sizes(sched, cs.max_size)
    else:
        sizes = trtllm_sizes(sched, cs.max_size, cs.enable_padding)
    if len(sizes) > MAX_SIZES:  # the same bound as lists and ranges
        raise plan_error(
            "too-many-sizes",
            _PATH,
            f"preset {cs.preset} generates {len(sizes)} sizes here; at most {MAX_SIZES}",
            "lower the preset's ceiling or max_size, or use ranges with a larger step",
        )
    return [(s, _PATH) for s in sizes]


def resolve_sizes(
    cs: CaptureSizesSpec, sched: SchedulerSpec, round_to_q: bool
) -> tuple[list[int], list[Diagnostic]]:
    """De-duplicate, sort, drop sizes above max_num_batched_tokens, then (FULL decode, q > 1)
    round up to multiples of q and drop those above the max: the vllm preset's computed max (a
    generated list can stop below it, e.g. q=3, max_num_seqs=1: sizes 1-4, max 6 -> [3, 6]), else
    the largest size."""
    limit, q = sched.max_num_batched_tokens, sched.decode_query_len
    diags: list[Diagnostic] = []
    seen: dict[int, str] = {}
    for size, where in requested_sizes(cs, sched):
        if size > limit:
            diags.append(
                Diagnostic(
                    code="size-dropped",
                    path=where,
                    message=f"size {size} is "
                    f"above scheduler.max_num_batched_tokens={limit}; dropped",
                    hint="remove it or raise max_num_batched_tokens",
                )
            )
        elif size in seen:
            diags.append(
                Diagnostic(
                    code="size-duplicate",
                    path=where,
                    message=f"size {size} repeats {seen[size]}",
                    hint="remove the duplicate",
                )
            )
        else:
            seen[size] = where
    sizes = sorted(seen)
    if not (round_to_q and q > 1 and sizes):
        return sizes, diags
    top = vllm_max(sched, cs.ceiling) if cs.kind == "preset" and cs.preset == "vllm" else sizes[-1]
    rounded: set[int] = set()
    for s in sizes:
        r = -(-s // q) * q
        if r > top:
            diags.append(
                Diagnostic(
                    code="size-dropped",
                    path=seen[s],
                    message=f"size {s} rounds "
                    f"up to {r} (a multiple of decode_query_len={q}), above the "
                    f"max size {top}; dropped",
                    hint=f"use multiples of {q}",
                )
            )
        else:
            if r != s:
                diags.append(
                    Diagnostic(
                        code="size-rounded",
                        path=seen[s],
                        message=f"size {s} moved to {r}, a multiple of decode_query_len={q}",
                        hint=f"use multiples of {q}",
                    )
                )
            rounded.add(r)
    if cs.kind == "preset":
        diags = _merge_preset(diags, cs.preset, q)
    if not rounded:
        if q > top:
            raise plan_error(
                "no-sizes",
                _PATH,
                f"no capture size is >= decode_query_len={q}",
                f"add a size that is a multiple of {q}",
            )
        rounded = {q}
    return sorted(rounded), diags


def _merge_preset(diags: list[Diagnostic], preset: str, q: int) -> list[Diagnostic]:
    """One diagnostic per code for a preset's generated sizes (the user wrote none of them)."""
    out: list[Diagnostic] = []
    by_code: dict[str, list[Diagnostic]] = {}
    for d in diags:
        by_code.setdefault(d.code, []).append(d)
    for code, group in by_code.items():
        if len(group) == 1:
            out += group
            continue
        verb = {
            "size-rounded": "moved to multiples of",
            "size-dropped": "dropped after rounding to",
        }
        words = ", ".join(g.message.split(" ")[1] for g in group[:8]) + (
            ", ..." if len(group) > 8 else ""
        )
        out.append(
            Diagnostic(
                code=code,
                path=_PATH,
                message=f"preset {preset}: {len(group)} sizes "
                f"{verb.get(code, code)} decode_query_len={q} ({words})",
                hint=group[0].hint,
            )
        )
    return out
