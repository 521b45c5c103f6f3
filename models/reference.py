"""Eager ground truth for any ``Model``: greedy generation (prefill all prompts, then decode them
together; teacher forcing on request), and the tolerances within which two computations of the
same logits (graphs vs eager, batched vs alone, padded vs not) must agree."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .protocol import Model


LOGIT_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""atol = rtol for logits of the same tokens computed two ways (graphs vs eager, batched vs alone,
padded vs not): float32 differs by summation order only; bf16 by its 8-bit mantissa through the
layers (logits reach ~20, where one bf16 step is 0.125)."""


def logits_mismatch(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None when ``got`` matches ``want`` within LOGIT_TOL[dtype], else what differs."""
    tol = LOGIT_TOL[dtype]
    if got.shape != want.shape:
        return f"logits shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
    got, want = got.float().cpu(), want.float().cpu()
    bad = (got - want).abs() > tol + tol * want.abs()
    if not bad.any():
        return None
    i = tuple(int(v) for v in bad.nonzero()[0])
    return (
        f"{int(bad.sum())} of {bad.numel()} logits differ beyond atol=rtol={tol:g} "
        f"(first at {i}: {got[i].item():.5f} vs {want[i].item():.5f}; max |diff| "
        f"{(got - want).abs().max().item():.4g})"
    )


def greedy_mismatch(
    tokens: list[list[int]], got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype
) -> str | None:
    """Compare a generation (``tokens`` and the logits ``got`` they were picked from) with a
    reference run teacher-forced over the same tokens (``want``): every logit within
    LOGIT_TOL[dtype], every token the reference's argmax or a near-tie within that tolerance.
    None when they agree, else what differs first."""
    tol = LOGIT_TOL[dtype]
    for i, (toks, g, w) in enumerate(zip(tokens, got, want)):
        bad = logits_mismatch(g, w, dtype)
        if bad:
            return f"prompt {i}: {bad}"
        for t, (tok, row) in enumerate(zip(toks, w.float())):
            top = row.max().item()
            if row[tok].item() < top - 2 * (tol + tol * abs(top)):
                return (
                    f"prompt {i}, new token {t}: picked {tok} (reference logit "
                    f"{row[tok].item():.4f}), the reference's argmax {int(row.argmax())} "
                    f"has {top:.4f}"
                )
    return None


@torch.no_grad()
def greedy(
    model: Model,
    prompts: list[list[int]],
    max_new_tokens: int,
    step=None,
    forced: list[list[int]] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy: prefill all prompts in one batch (prompt i in cache row i), then decode all
    requests together one token per step. Returns each prompt's new tokens and the logits they
    were chosen from ([max_new_tokens, vocab] float32 on the CPU per prompt).

    ``step(batch, num_reqs, max_query_len) -> logits`` runs a batch (default: the model, eagerly;
    examples/generate.py passes a GraphRunner). ``forced`` (new tokens per prompt) feeds those
    tokens back instead of the argmax (teacher forcing): two ways of computing can then be
    compared logit by logit over the same token sequence, even where a near-tie flips an argmax."""
    assert len(prompts) <= model.cfg.num_cache_rows
    step = step or (lambda batch, num_reqs, max_query_len: model(**batch))
    reqs = [(row, 0, list(p)) for row, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for i in range(max_new_tokens):
        batch = model.make_batch(reqs)
        last = batch["query_start_loc"][1:].long() - 1  # [R] each request's last token
        logits = step(batch, len(reqs), max(len(toks) for _, _, toks in reqs))[last].float()
        next_ids = logits.argmax(dim=-1).tolist() if forced is None else [f[i] for f in forced]
        for tokens, kept, tok, row in zip(out, rows, next_ids, logits.cpu()):
            tokens.append(tok)
            kept.append(row)
        reqs = [(row, start + len(toks), [tok]) for (row, start, toks), tok in zip(reqs, next_ids)]
    return out, [torch.stack(r) if r else torch.empty(0) for r in rows]


def reference_generate(
    model: Model, prompts: list[list[int]], max_new_tokens: int, step=None
) -> list[list[int]]:
    """The new tokens of ``greedy`` (see there)."""
    return greedy(model, prompts, max_new_tokens, step)[0]
