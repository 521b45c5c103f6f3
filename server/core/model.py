"""What the server serves: a dispatch table (a compiled ``table.json``, or a plan compiled at
start-up) and a model sized to it (one KV-cache seat per ``scheduler.max_num_seqs``), described
by a ``ServingSpec``: ``ModelSpec`` (the tiny Llama, here) or ``hf_model.HFSpec`` (a transformers
checkpoint). The server reads a spec and the model it builds only through their protocols
(``ServingSpec``, ``graphplan.models.Model``), never by probing which kind it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from graphplan.compiler.errors import TableError, UsageError
from graphplan.compiler.plan_or_table import load_table_or_plan
from graphplan.compiler.table import DispatchTable
from graphplan.models import Model, Tokenizer
from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig

from ..frontend.chat import ChatTemplateSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ServingSpec(Protocol):
    """What the server needs to know of a model before and while it serves it."""

    @property
    def name(self) -> str:
        """The model's name on /v1 (``model`` in requests and /v1/models)."""
        ...

    @property
    def compile(self) -> str:
        """torch.compile backend of the compiled path, or "" to run the model as written."""
        ...

    def limits(self) -> dict:
        """``{"vocab_size": ..., "max_model_len": ...}``, known before the model is built."""
        ...

    def stop_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence ids (empty: none), known before the model is built."""
        ...

    def check(self) -> None:
        """Raise a GraphplanError now for a model that cannot be served (before capture)."""
        ...

    def load_tokenizer(self) -> Tokenizer | None:
        """Text <-> ids for /v1, or None (token ids only)."""
        ...

    def chat_template(self) -> ChatTemplateSource | None:
        """The model's chat template for /v1/chat/completions, or None (no chat)."""
        ...

    def build(self, table: DispatchTable, device: str | torch.device, tp=None) -> Model:
        """The model, its KV cache sized to the table's ``max_num_seqs``; ``tp``: this rank's
        ``TPGroup`` (tensor-parallel serving builds only the rank's shard)."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """The tiny Llama's shape and weights; the cache rows come from the table. The load test
    builds its offline reference from the same spec, so the two always agree."""

    layers: int = 2
    hidden: int = 256
    """The rest of the shape follows from it (TinyLlamaConfig.sized)."""
    vocab_size: int = 2048
    max_model_len: int = 128
    """Prompt plus generated tokens of one request."""
    seed: int = 0
    """Weights are drawn from this seed: the same on every device and dtype."""
    dtype: str = "float32"
    """float32 by default, also on CUDA: exact equality with a per-prompt reference needs
    kernels whose rounding does not depend on the batch size; bfloat16 is faster but near-tie
    argmaxes can flip when a request is batched with others."""
    compile: str = ""
    """torch.compile backend of the compiled path (``--compile``, e.g. "inductor"): the model is
    compiled once, and graphs are captured of the compiled model; "" runs it as written."""

    name = "tiny-llama"

    def limits(self) -> dict:
        return {"vocab_size": self.vocab_size, "max_model_len": self.max_model_len}

    def stop_token_ids(self) -> tuple[int, ...]:
        return ()

    def check(self) -> None:
        dtype_of(self.dtype)

    def load_tokenizer(self) -> None:
        return None  # the tiny Llama serves token ids only

    def chat_template(self) -> None:
        return None

    def config(self, num_cache_rows: int) -> TinyLlamaConfig:
        return TinyLlamaConfig.sized(
            hidden=self.hidden,
            layers=self.layers,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            num_cache_rows=num_cache_rows,
        )

    def build(self, table: DispatchTable, device: str | torch.device, tp=None) -> TinyLlama:
        if tp is not None:
            from graphplan.compiler.errors import GraphplanError

            raise GraphplanError(
                "parallel.tensor_parallel_size > 1 serves a Hugging Face checkpoint (--model DIR): "
                "the tiny Llama has no sharded form; use --set parallel.tensor_parallel_size=1"
            )
        return TinyLlama(
            self.config(table.max_num_seqs),
            seed=self.seed,
            device=device,
            dtype=dtype_of(self.dtype),
        )


def dtype_of(name: str) -> torch.dtype:
    """A ``--dtype`` name as a torch dtype (UsageError naming the choices otherwise)."""
    if name not in DTYPES:
        raise UsageError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def build_model(spec: ServingSpec, table: DispatchTable, device: str | torch.device) -> Model:
    """The spec's model for this table (``spec.build``)."""
    return spec.build(table, device)


def compiled_model(spec: ServingSpec, model: Model):
    """One CompiledModel for the server's life (table swaps reuse it: one compile), or None."""
    if not spec.compile:
        return None
    from graphplan.runtime import CompiledModel

    return CompiledModel(model, spec.compile)


def load_table(path: str, overrides: dict | None = None) -> DispatchTable:
    """A compiled table (``.json``; overrides not allowed) or a plan compiled now
    (graphplan.compiler.plan_or_table; the YAML stack only when a plan is given). A plan with
    ``tensor_parallel_size`` > 1 is served by one process per rank (server/core/tp_serving.py)."""
    return load_table_or_plan(str(path), overrides)[0]


def parse_sets(pairs: list[str] | None) -> dict:
    """``["cudagraph.mode=NONE", ...]`` -> overrides, exactly as ``plan --set`` reads them."""
    from graphplan.compiler.cli.inputs import (
        parse_overrides,  # the YAML stack only when overrides are given
    )

    return parse_overrides(pairs or [])


def check_fits(table: DispatchTable, model: Model) -> None:
    """A new table must fit the model built at start-up (its KV cache is kept across swaps)."""
    tp = table.settings.tensor_parallel_size
    if tp > 1:
        raise TableError(
            f"plan {table.settings.name!r} has parallel.tensor_parallel_size={tp}: a reload "
            "cannot start tensor-parallel ranks; restart the server with the new plan"
        )
    dp = table.settings.data_parallel_size
    if dp > 1:
        raise TableError(
            f"plan {table.settings.name!r} has parallel.data_parallel_size={dp}: a reload "
            "cannot start data-parallel engines; restart the server with the new plan"
        )
    rows = model.cfg.num_cache_rows
    if table.max_num_seqs > rows:
        raise TableError(
            f"plan {table.settings.name!r} has scheduler.max_num_seqs="
            f"{table.max_num_seqs}, but this server's KV cache has {rows} rows "
            f"(sized to the start-up plan): lower max_num_seqs to <= {rows}, or "
            "restart the server with the new plan"
        )
