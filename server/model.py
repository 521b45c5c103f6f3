"""What the server serves: a dispatch table (a compiled ``table.json``, or a plan compiled at
start-up) and the tiny Llama sized to it (one KV-cache row per ``scheduler.max_num_seqs``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphplan.compiler.errors import TableError, UsageError
from graphplan.compiler.plan_or_table import load_table_or_plan
from graphplan.compiler.table import DispatchTable
from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, make_batch, static_inputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    def config(self, num_cache_rows: int) -> TinyLlamaConfig:
        return TinyLlamaConfig.sized(
            hidden=self.hidden,
            layers=self.layers,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            num_cache_rows=num_cache_rows,
        )


def build_model(spec: ModelSpec, table: DispatchTable, device: str | torch.device) -> TinyLlama:
    if not isinstance(spec, ModelSpec):  # a Hugging Face checkpoint (hf_model.HFSpec)
        return spec.build(table, device)
    if spec.dtype not in DTYPES:
        raise UsageError(f"dtype {spec.dtype!r} is not one of {sorted(DTYPES)}")
    return TinyLlama(
        spec.config(table.max_num_seqs), seed=spec.seed, device=device, dtype=DTYPES[spec.dtype]
    )


def model_batch(model, reqs) -> dict:
    """The step's inputs for ``(row, start_pos, token_ids)`` requests, for either kind of model."""
    return model.make_batch(reqs) if hasattr(model, "make_batch") else make_batch(model, reqs)


def model_inputs(model) -> list:
    return model.static_inputs() if hasattr(model, "static_inputs") else static_inputs(model)


def compiled_model(spec, model):
    """One CompiledModel for the server's life (table swaps reuse it: one compile), or None;
    ``spec`` is a ModelSpec or an HFSpec (both carry ``compile``)."""
    if not spec.compile:
        return None
    from graphplan.runtime import CompiledModel

    return CompiledModel(model, spec.compile)


def load_table(path: str, overrides: dict | None = None) -> DispatchTable:
    """A compiled table (``.json``; overrides not allowed) or a plan compiled now
    (graphplan.compiler.plan_or_table; the YAML stack only when a plan is given)."""
    return load_table_or_plan(str(path), overrides)[0]


def parse_sets(pairs: list[str] | None) -> dict:
    """``["cudagraph.mode=NONE", ...]`` -> overrides, exactly as ``plan --set`` reads them."""
    from graphplan.compiler.cli.inputs import (
        parse_overrides,  # the YAML stack only when overrides are given
    )

    return parse_overrides(pairs or [])


def check_fits(table: DispatchTable, model: TinyLlama) -> None:
    """A new table must fit the model built at start-up (its KV cache is kept across swaps)."""
    rows = model.cfg.num_cache_rows
    if table.max_num_seqs > rows:
        raise TableError(
            f"plan {table.settings.name!r} has scheduler.max_num_seqs="
            f"{table.max_num_seqs}, but this server's KV cache has {rows} rows "
            f"(sized to the start-up plan): lower max_num_seqs to <= {rows}, or "
            "restart the server with the new plan"
        )
