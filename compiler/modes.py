"""Mode resolution against the attention backend's graph support (docs/semantics.md §2)."""

from __future__ import annotations

from .errors import Diagnostic, plan_error
from .records import AttentionSupport as S
from .records import CudagraphMode, RuntimeMode
from .spec import CudagraphSpec

_PATH = "cudagraph.mode"


def resolve_mode(cg: CudagraphSpec, q: int) -> tuple[CudagraphMode, list[Diagnostic]]:
    """Apply rules 0-4 in order; each downgrade is a diagnostic naming rule, request and result."""
    mode, support, diags = cg.mode, cg.attention_support, []
    attention_splits = "attention" in cg.splitting_ops

    def lower(to: CudagraphMode, rule: int, why: str) -> None:
        nonlocal mode
        diags.append(
            Diagnostic(
                code="mode-downgrade",
                path=_PATH,
                message=f"{mode.name} -> {to.name} (rule {rule}): {why}",
                hint=f"write mode: {to.name} to accept it, or use a backend with stronger support",
            )
        )
        mode = to

    decode_fallback = CudagraphMode.PIECEWISE if attention_splits else CudagraphMode.NONE
    if not cg.splitting_ops and mode in (CudagraphMode.PIECEWISE, CudagraphMode.FULL_AND_PIECEWISE):
        lower(
            CudagraphMode.NONE if mode is CudagraphMode.PIECEWISE else CudagraphMode.FULL,
            0,
            "splitting_ops is empty, so no piecewise graphs are possible",
        )
    if mode.mixed_mode is RuntimeMode.FULL and support < S.ALWAYS:
        if support is S.NEVER:
            raise plan_error(
                "full-attention-never",
                _PATH,
                f"mode {mode.name} needs FULL graphs but cudagraph.attention_support is NEVER",
                "use mode: PIECEWISE (with splitting_ops: [attention]) or NONE",
            )
        lower(
            CudagraphMode.FULL_AND_PIECEWISE
            if attention_splits
            else CudagraphMode.FULL_DECODE_ONLY,
            1,
            f"attention support {support.name} cannot run mixed batches in a FULL graph",
        )
    if mode.decode_mode is RuntimeMode.FULL and support is S.NEVER:
        lower(decode_fallback, 2, "attention support NEVER allows no FULL graphs")
    if mode.decode_mode is RuntimeMode.FULL and q > 1 and support < S.UNIFORM_BATCH:
        lower(
            decode_fallback,
            3,
            f"decode_query_len={q} > 1 needs attention support "
            f"UNIFORM_BATCH or ALWAYS, not {support.name}",
        )
    if mode.has_full and support is S.NEVER:  # unreachable after rules 1-3; kept as the invariant
        raise plan_error("full-attention-never", _PATH, "FULL graphs remain with support NEVER")
    return mode, diags
