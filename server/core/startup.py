"""The engine's start-up, on its thread (server/core/engine.py): the model, its captured runner,
the step sampler and a speculative proposer (``build_parts``), then the continuous batcher over
the model's KV blocks (``make_batcher``: with speculative decoding, its SpecBatcher)."""

from __future__ import annotations

from typing import Any

from . import lora_serving
from .batching import ContinuousBatcher
from .model import build_model, compiled_model
from .step_sampler import StepSampler


def build_parts(e: Any) -> None:
    """``e``'s model, runner, sampler (its graphs in their own pool) and proposer."""
    e.model = build_model(e.spec, e.table, e.device)
    e.compiled = compiled_model(e.spec, e.model)  # None unless --compile
    e.runner = e.capture(e.table)
    cfg = e.model.cfg
    fused = e.fused_sampler
    if fused is None:
        fused = e.model.device.type == "cuda"
    e.sampler = StepSampler(cfg.num_cache_rows, cfg.vocab_size, e.model.device, fused=fused)
    if e.speculative is not None:  # its proposer (a draft model loads here)
        from .spec.proposer import build_proposer

        e.proposer = build_proposer(e.speculative, e)


def checked_speculation(speculative: Any, table: Any) -> bool:
    """Check a speculative config against the plan's ``decode_query_len`` (a SpecConfigError
    names both); False: speculative steps run synchronously, without async scheduling."""
    from .spec.config import check_plan

    check_plan(speculative, table.q, f"plan {table.settings.name!r}")
    return False


def make_batcher(e: Any) -> ContinuousBatcher:
    """The batcher of ``e``'s plan and model: seats, token budget, KV blocks, prefix caching,
    LoRA's adapter limit; a SpecBatcher (setting ``e.spec_step``) with speculative decoding."""
    cfg, t = e.model.cfg, e.table
    kw = dict(
        max_num_seqs=t.max_num_seqs,
        token_budget=t.max_tokens,
        max_model_len=cfg.max_model_len,
        num_cache_rows=cfg.num_cache_rows,
        # with tensor parallelism, each seat released also goes to the worker ranks
        kv_pool=e.model.kv_pool if e.pipeline.tp is None else e.pipeline.tp.pool(e.model.kv_pool),
        prefix_caching=e.enable_prefix_caching,
    )
    batcher: ContinuousBatcher
    if e.speculative is not None:
        from .spec.engine import spec_batcher

        batcher, e.spec_step = spec_batcher(e, kw)
    else:
        batcher = ContinuousBatcher(**kw)
    batcher.max_loras = lora_serving.max_loras(e.model)
    return batcher
