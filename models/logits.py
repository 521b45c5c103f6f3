"""``Model.logits`` of a step that returned every token's logits: the rows asked for, as float32
(``graphplan.models.Model``). TinyLlama, ``PagedCausalLM(logits="all")`` and the server's
``StepLogits.every`` (a tensor of logits handed to the sampler by tests and benches) read them so."""

from __future__ import annotations

import torch


def every_token_rows(
    out: torch.Tensor, rows: torch.Tensor, *, into: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``rows`` of ``out`` [num_tokens (or more), vocab] as float32, written into ``into``
    when given (one gather straight into it when the dtypes agree)."""
    if into is None:
        return out.index_select(0, rows).float()
    if out.dtype == into.dtype:
        return torch.index_select(out, 0, rows, out=into)
    return into.copy_(out.index_select(0, rows))
