"""The ``Model`` protocol: what the runner and the server need from a model, and nothing else.

A model is stepped over fixed-shape inputs: ``static_inputs()`` names them (the runner keeps one
static buffer per input, ``graphplan.runtime.StaticInput``), ``make_batch(reqs)`` builds them for
``(seat, start_pos, token_ids)`` requests, and calling the model with them as keywords returns the
logits ``[num_tokens, vocab_size]`` (float32), or the last hidden states of a model that applies
its LM head in ``logits(out, rows)``, reading nothing back to the host inside a graph; consumers
read a step's logits by rows through ``logits``. The model owns its KV cache (``kv_cache``), one
seat per sequence, ``cfg.num_cache_rows`` of them; a chunk that starts at position 0 begins a new
sequence on its seat, and ``release(seat)`` hands a finished sequence's cache back early. ``cfg`` carries the limits a scheduler and a request
validator read; ``tokenizer`` (or None: token ids only) and ``stop_token_ids()`` (its EOS) are what
the server's text and stopping rules need.

``graphplan.models.tiny_llama.TinyLlama`` and ``graphplan.models.hf.PagedCausalLM`` implement it
(``tests/test_model_protocol.py`` checks every member on both). The runtime never imports this
module: the runner takes any callable over named inputs, and this protocol is that contract written
down for the models that the server serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # the protocol itself needs neither torch nor the runtime
    import torch

    from graphplan.runtime.buffers import StaticInput

__all__ = ["BlockPool", "Model", "ModelLimits", "Request", "Tokenizer"]

Request = tuple[int, int, Sequence[int]]
"""``(seat, start_pos, token_ids)``: a request's next chunk, written at positions
``start_pos .. start_pos + len(token_ids) - 1`` of the sequence on cache seat ``seat``."""


@runtime_checkable
class ModelLimits(Protocol):
    """A model's ``cfg``: the limits a scheduler and a request validator read."""

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``; logits have this many columns."""
        ...

    @property
    def max_model_len(self) -> int:
        """Prompt plus generated tokens of one request."""
        ...

    @property
    def num_cache_rows(self) -> int:
        """KV-cache seats: sequences that can be live at once (``scheduler.max_num_seqs``)."""
        ...


@runtime_checkable
class BlockPool(Protocol):
    """A paged KV cache's blocks as a scheduler sees them (``paged_kv.BlockTables`` is one): a step
    that writes positions ``[start, start + n)`` of a seat's sequence holds
    ``ceil((start + n) / block_size)`` blocks for it, and ``release(seat)`` gives them all back;
    ``truncate(seat, n)`` gives back those past its first ``n`` positions (rejected drafts)."""

    block_size: int

    def num_free(self) -> int: ...

    def release(self, seat: int) -> None: ...

    def truncate(self, seat: int, num_tokens: int) -> None: ...


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a transformers tokenizer the server uses."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@runtime_checkable
class Model(Protocol):
    """What ``GraphRunner`` steps and the server serves (see the module docstring). Check a model
    by its members, not ``isinstance``: since Python 3.12 that finds members statically only,
    and an ``nn.Module``'s buffers (TinyLlama's ``kv_cache``) are reached through its
    ``__getattr__``."""

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        """The step: ``make_batch``'s tensors (or the runner's static buffers) as keywords ->
        logits ``[num_tokens, vocab_size]`` float32, or, for a model that applies its LM head in
        ``logits`` (``PagedCausalLM(logits="rows")``), its last hidden states ``[num_tokens,
        hidden]``. Shapes depend only on the token and request counts, so the runner can
        capture it."""
        ...

    def logits(
        self, out: torch.Tensor, rows: torch.Tensor, *, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The float32 logits ``[len(rows), vocab_size]`` of the step's token rows ``rows`` (int64,
        on the device) from ``out``, what the step returned; written into ``into`` when given (a
        float32 tensor of that shape) and returned. No host reads."""
        ...

    @property
    def cfg(self) -> ModelLimits: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def kv_cache(self) -> torch.Tensor:
        """The cache tensor the model owns (written in place by every step)."""
        ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """Text <-> ids, or None when the model has no tokenizer (token ids only)."""
        ...

    def static_inputs(self) -> list[StaticInput]:
        """The step's inputs as the runner's buffers: names, rows, dtypes, safe padding."""
        ...

    def make_batch(
        self, reqs: Sequence[Request], *, non_blocking: bool = False
    ) -> dict[str, torch.Tensor]:
        """The step's keyword tensors for these requests, in order (token rows concatenated).
        ``non_blocking``: without waiting for steps already launched on the device
        (``graphplan.runtime.buffers.to_device``; the server's async scheduling)."""
        ...

    def release(self, seat: int) -> None:
        """The sequence on ``seat`` is finished: its cache may be reused now."""
        ...

    @property
    def kv_pool(self) -> BlockPool | None:
        """The KV blocks a scheduler admits and preempts by (``server.batching``), or None when
        every seat holds a whole ``max_model_len`` sequence of its own."""
        ...

    def stop_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids that stop a generation (empty: none)."""
        ...
