"""A step's logits as its consumers read them: by rows. The sampler reads the rows of the tokens it
samples, prompt logprobs the rows of the prompt positions asked for. ``StepLogits.of(model, out)``
binds what the runner's step returned to ``model.logits`` (``graphplan.models.Model``): rows of
every token's float32 logits, or, for a model that keeps its LM head out of the step
(``PagedCausalLM(logits="rows")``), the head applied to those rows alone; ``StepLogits.every``
wraps a tensor of every token's logits (tests, benches)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from graphplan.models.logits import every_token_rows


@dataclass(frozen=True, slots=True)
class StepLogits:
    out: torch.Tensor
    """What the step returned (logits, or hidden states for ``logits``)."""
    logits: Callable[..., torch.Tensor]
    """``(out, rows, *, into=None) -> [len(rows), vocab]`` float32."""
    vocab: int

    @classmethod
    def of(cls, model: Any, out: torch.Tensor) -> StepLogits:
        return cls(out, model.logits, model.cfg.vocab_size)

    @classmethod
    def every(cls, logits: torch.Tensor) -> StepLogits:
        """``logits`` [num_tokens (or more), vocab]: every token row's logits."""
        return cls(logits, every_token_rows, logits.shape[-1])

    @property
    def device(self) -> torch.device:
        return self.out.device

    def rows(self, rows: torch.Tensor, *, into: torch.Tensor | None = None) -> torch.Tensor:
        """[len(rows), vocab] float32 for the token rows ``rows`` (int64, on ``device``)."""
        return self.logits(self.out, rows, into=into)


def step_logits(logits: StepLogits | torch.Tensor) -> StepLogits:
    """``logits`` as a StepLogits (a tensor: every token row's logits)."""
    return logits if isinstance(logits, StepLogits) else StepLogits.every(logits)
