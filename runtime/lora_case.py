"""The LoRA case of the graph being captured or the step being run eagerly (docs/semantics.md §6).

A model that applies LoRA adapters (``models/hf/lora_slots.py``) reads ``current_lora_case()`` when
its forward runs: 0 means a graph of a no-adapter case (``has_lora`` false), so the forward records
no LoRA kernels; a count above 0 means LoRA kernels; None means no runner said (a direct call of the
model, or a table with LoRA off), and the model applies its adapters whenever it has any.

The runner sets it around each FULL graph's warm-up and body (a CPU stand-in graph re-runs its body
at every replay, so the body sets it itself), around each PIECEWISE capture, and around eager steps
(the step's own count of active adapters).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

_case: list[int | None] = [None]


def current_lora_case() -> int | None:
    return _case[0]


@contextmanager
def lora_case(case: int | None) -> Iterator[None]:
    before, _case[0] = _case[0], case
    try:
        yield
    finally:
        _case[0] = before


def in_lora_case(case: int | None, body: Callable[[], None]) -> Callable[[], None]:
    """``body`` run under ``lora_case(case)`` (a graph body records the case's kernels)."""
    if case is None:
        return body

    def fn() -> None:
        with lora_case(case):
            body()

    return fn
