"""PagedCausalLM: a stock transformers causal LM behind the runner's calling convention.

The model's own modules run as shipped; only attention is swapped, through transformers' attention
registry, for graphplan's paged cache (``attention.py``). One flattened batch of T tokens from R
requests (prefill chunks and decodes mixed) is the forward's input, all fixed-shape per (T, R):

    input_ids [T] int64, positions [T] int64, slot_mapping [T] int64 (padding: the padding slot),
    block_tables [R, max_blocks_per_seq] int32 (padding: the padding block),
    seq_lens [R] int32, query_start_loc [R + 1] int32   ->   logits [T, vocab] float32

or, with ``logits="rows"``, the last hidden states [T, hidden] (the model's dtype): the LM head then
runs in ``logits(out, rows)`` on the rows a step reads (its sampled tokens, prompt logprobs),
outside the captured graphs, as vLLM computes logits only at its ``logits_indices``.

A token attends to the slots of its request's block table at positions <= its own; eager batches
with prefill chunks read ``seq_lens`` and ``query_start_loc`` on the host to attend each prompt
chunk over its real length (graphs never read them back: see ``attention.make_paged_batch``).
Piecewise graphs (PIECEWISE, FULL_AND_PIECEWISE) split at the attention function, which runs
eagerly between the segments and reads the step's inputs from the runner's static buffers and the
real counts from ``breakable.current_step()`` (``attention.StepInputs``).
``make_batch`` turns a batcher's ``(seat, start_pos, token_ids)`` requests into those inputs,
allocating blocks as sequences grow.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property

import torch

from graphplan.runtime.buffers import StaticInput, to_device
from graphplan.runtime.piecewise.breakable import current_step

from ..logits import every_token_rows
from ..paged_batch import PagedBatchBuilder
from ..paged_kv import BlockTables, KVCacheShape, PagedKVCache, size_blocks
from .attention import ATTN_IMPLEMENTATION, StepInputs, make_paged_batch, register
from .fused_decoder import FusedDecoder, fuse, why_not_fused
from .load import eos_token_ids, load_config, load_model, load_tokenizer
from .lora_slots import LORA_SLOTS_INPUT, enable_lora
from .step_memory import DEFAULT_STEP_TOKENS, step_reserve_bytes

log = logging.getLogger("graphplan.models")

HEAD_ONLY = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
"""CausalLM classes whose logits are their LM head over the decoder's last hidden states and nothing
more (no soft-capping or scaling after it, unlike e.g. Gemma 2's or Granite's): ``logits="rows"``
applies to them."""


def why_not_rows(hf_model) -> str | None:
    """Why ``logits="rows"`` does not apply to ``hf_model``, or None when it does."""
    name = type(hf_model).__name__
    if name not in HEAD_ONLY:
        return (
            f"{name} is not one whose logits are its LM head alone ({', '.join(sorted(HEAD_ONLY))})"
        )
    return None


def kv_shape(config, dtype: torch.dtype, block_size: int) -> KVCacheShape:
    """What one token of ``config``'s model costs in the cache."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVCacheShape(
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_size=block_size,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PagedConfig:
    """What the server and batcher need to know (a ``graphplan.models.ModelLimits``; the names match ``TinyLlamaConfig``)."""

    vocab_size: int
    max_model_len: int
    """Prompt plus generated tokens of one request."""
    num_cache_rows: int
    """Sequence seats (max_num_seqs); each can grow to max_model_len."""
    block_size: int
    num_blocks: int


class PagedCausalLM(torch.nn.Module):
    """Owns the transformers model (``hf``), the paged KV cache and the block tables; a
    ``graphplan.models.Model``. ``source`` is the checkpoint directory it was loaded from (its
    tokenizer and end-of-sequence ids), or None.

    ``fused_ops`` (default: on for a model on CUDA): Llama-family models run a fused forward
    (``fused_decoder``: q/k/v and gate/up weights laid out as one GEMM each at load, RMSNorm with
    the residual add, rotary in place and SiLU x up as one Triton kernel each), calling the same
    attention as transformers' forward does. Other models, or True for a model it does not apply
    to, keep transformers' forward (logged; ``fused_reason`` says why). The ``fused_ops``
    attribute switches between the two on a fused model (the weights are shared: compare them
    on one model); set it before a runner captures. Code that torch.compile traces runs
    transformers' forward (inductor fuses it itself).

    ``logits``: ``"all"`` (the default) returns every token's float32 logits from ``forward``;
    ``"rows"`` returns the last hidden states, and ``logits(out, rows)`` applies the LM head to the
    rows a step reads: a mixed step of T tokens from R requests runs the head on R rows, not T,
    and no ``[T, vocab]`` float32 tensor is made (the graphs' static outputs are ``[T, hidden]``).
    A model it does not apply to (``why_not_rows``) keeps ``"all"`` (logged; ``logits_reason``
    says why). The server serves with ``"rows"``."""

    def __init__(
        self,
        hf_model,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int = 16,
        kv_cache_tokens: int | None = None,
        kv_memory_fraction: float | None = None,
        source: str | os.PathLike | None = None,
        fused_ops: bool | None = None,
        max_step_tokens: int | None = None,
        logits: str = "all",
        max_loras: int = 0,
        max_lora_rank: int = 16,
        tp=None,
    ):
        super().__init__()
        self.tp = tp
        """This rank's ``tp.TPGroup`` when ``hf_model`` is one rank's part (``tp_load``), else None."""
        if tp is not None and max_loras:  # their A/B weights are not sharded
            raise ValueError("LoRA with tensor parallelism is not built: use TP 1 for adapters")
        if logits not in ("all", "rows"):
            raise ValueError(f"logits must be 'all' or 'rows', not {logits!r}")
        self.source = source
        register()
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)  # transformers' public switch
        self.hf = hf_model
        c = hf_model.config
        param = next(hf_model.parameters())
        shape = kv_shape(c, param.dtype, block_size)
        self.fused: FusedDecoder | None = None
        self.fused_reason = "fused_ops=False" if fused_ops is False else why_not_fused(hf_model)
        if fused_ops is None and param.device.type != "cuda" and self.fused_reason is None:
            self.fused_reason = "fused_ops defaults to off on the CPU"
        if self.fused_reason is None:  # before the KV pool: it is sized from what is left
            positions = shape.blocks_per_seq(max_model_len) * block_size
            self.fused = (
                fuse(hf_model, positions) if tp is None else _tp_fuse(hf_model, positions, tp)
            )
        elif fused_ops:
            log.warning("fused_ops: %s; running transformers' forward", self.fused_reason)
        self.lora = None  # LoRA adapters (lora_slots.LoraManager) with max_loras > 0
        if max_loras:
            self.lora = enable_lora(self, max_loras, max_lora_rank, max_num_seqs)
        self._fused_on = self.fused is not None
        self.logits_reason = why_not_rows(hf_model) if logits == "rows" else None
        if self.logits_reason is not None:
            log.warning(
                "logits='rows': %s; every token's logits come from forward", self.logits_reason
            )
        self.logits_mode = "rows" if logits == "rows" and self.logits_reason is None else "all"
        limit = getattr(c, "max_position_embeddings", None)
        if limit and max_model_len > limit:
            from ..paged_kv import KVCacheSizeError

            raise KVCacheSizeError(
                f"max_model_len={max_model_len} is above the model's "
                f"max_position_embeddings={limit}"
            )
        reserve = 0
        self._step_tokens = max_step_tokens or DEFAULT_STEP_TOKENS  # make_batch's staging
        if param.device.type == "cuda" and kv_cache_tokens is None:
            step = self._step_tokens
            reserve = step_reserve_bytes(self, self._pool, shape, max_num_seqs, max_model_len, step)
        blocks = size_blocks(
            shape,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            tokens=kv_cache_tokens,
            memory_fraction=kv_memory_fraction,
            device=param.device,
            reserve_bytes=reserve,
        )
        self._pool(shape, blocks, max_num_seqs, max_model_len)
        self.cfg = PagedConfig(
            vocab_size=c.vocab_size,
            max_model_len=max_model_len,
            num_cache_rows=max_num_seqs,
            block_size=block_size,
            num_blocks=blocks,
        )

    @classmethod
    def load(
        cls,
        source,
        *,
        max_num_seqs: int,
        max_model_len: int,
        dtype=torch.float32,
        device="cpu",
        seed: int = 0,
        random_weights: bool = False,
        block_size: int = 16,
        kv_cache_tokens: int | None = None,
        kv_memory_fraction: float | None = None,
        fused_ops: bool | None = None,
        max_step_tokens: int | None = None,
        logits: str = "all",
        max_loras: int = 0,
        max_lora_rank: int = 16,
        tp=None,
    ) -> "PagedCausalLM":
        """From a local model directory's checkpoint (``load.load_model``: checked before
        anything is allocated, the weights and this KV cache against the free memory); with
        ``random_weights`` (a config object, benchmarks), weights drawn from ``seed``.
        ``max_step_tokens``: the most tokens a step runs (the scheduler's token budget; default
        ``DEFAULT_STEP_TOKENS``); on CUDA a step of that size is measured before the pool is
        sized (models/hf/step_memory.py). ``logits``: see the class docstring. ``tp``: a
        ``tp.TPGroup``: load only this rank's part of the model (models/hf/tp.py)."""
        register()
        config = load_config(source)
        if tp is not None:  # the rank's KV heads
            from .tp import rank_config, split_of

            config = rank_config(config, split_of(config, tp.size, tp.rank, str(source)))
        shape = kv_shape(config, dtype, block_size)
        tokens = kv_cache_tokens
        if tokens is None:  # the pool's least: one max_model_len sequence (blocks on demand)
            tokens = shape.blocks_per_seq(max_model_len) * block_size
        hf = (load_model if tp is None else _tp_loader(tp))(
            source,
            dtype=dtype,
            device=device,
            seed=seed,
            attn_implementation=ATTN_IMPLEMENTATION,
            random_weights=random_weights,
            reserve_bytes=(tokens // block_size + 1) * block_size * shape.bytes_per_token,
        )
        return cls(
            hf,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            source=source if isinstance(source, (str, os.PathLike)) else None,
            block_size=block_size,
            kv_cache_tokens=kv_cache_tokens,
            kv_memory_fraction=kv_memory_fraction,
            fused_ops=fused_ops,
            max_step_tokens=max_step_tokens,
            logits=logits,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            tp=tp,
        )

    def _pool(self, shape, blocks: int, max_num_seqs: int, max_model_len: int) -> None:
        self.cache = PagedKVCache(shape, blocks, self.hf.device)
        self.tables = BlockTables(
            num_blocks=blocks,
            block_size=shape.block_size,
            num_seats=max_num_seqs,
            max_blocks_per_seq=shape.blocks_per_seq(max_model_len),
        )
        self.batches = PagedBatchBuilder(
            self.tables,
            max_tokens=self._step_tokens,
            max_reqs=max_num_seqs,
            device=self.hf.device,
        )

    @property
    def fused_ops(self) -> bool:
        """Whether forward runs the fused decoder (see the class docstring)."""
        return self._fused_on

    @fused_ops.setter
    def fused_ops(self, on: bool) -> None:
        if on and self.fused is None:
            raise ValueError(f"fused_ops cannot be turned on for this model: {self.fused_reason}")
        self._fused_on = bool(on)

    @property
    def device(self) -> torch.device:
        return self.cache.kv.device

    @property
    def kv_cache(self) -> torch.Tensor:
        """``[layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]`` (``paged_kv``)."""
        return self.cache.kv

    @cached_property
    def tokenizer(self):
        """The source directory's tokenizer (read on first use), or None without one."""
        return None if self.source is None else load_tokenizer(self.source)

    def stop_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's end-of-sequence ids (``load.eos_token_ids``)."""
        return eos_token_ids(self.source if self.source is not None else self.hf.config)

    def forward(
        self,
        input_ids,
        positions,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        lora_slots=None,
    ):
        if current_step() is not None:  # a piecewise capture or replay: attention runs eagerly
            meta = StepInputs(
                self.cache.kv, positions, slot_mapping, block_tables, seq_lens, query_start_loc
            )
        else:
            meta = make_paged_batch(
                self.cache.kv, positions, slot_mapping, block_tables, seq_lens, query_start_loc
            )
        rows = self.logits_mode == "rows"
        if self._fused_on and self.fused is not None and not torch.compiler.is_compiling():
            out = self.fused.forward(
                input_ids, positions, meta, head=not rows, lora_slots=lora_slots
            )
            return out if rows else out.float()
        if self.lora is not None:
            raise ValueError("LoRA adapters run in the fused forward only: keep fused_ops on")
        kwargs = dict(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=False, graphplan=meta
        )
        if rows:
            return self.hf.model(**kwargs).last_hidden_state[0]
        return self.hf(**kwargs).logits[0].float()

    def logits(self, out, rows, *, into=None) -> torch.Tensor:
        """The float32 logits of token rows ``rows`` of a step that returned ``out``
        (``graphplan.models.Model.logits``): rows of ``out`` itself, or with ``logits="rows"``
        the LM head over those rows of the hidden states (transformers' own ``lm_head``)."""
        if self.logits_mode == "all":
            return every_token_rows(out, rows, into=into)
        head = self.hf.lm_head(out.index_select(0, rows))
        return head.float() if into is None else into.copy_(head)

    # -- batches ----------------------------------------------------------------------------
    def make_batch(self, reqs, *, non_blocking: bool = False) -> dict[str, torch.Tensor]:
        """reqs: ``(seat, start_pos, token_ids)`` per request -> forward's keyword arguments
        (``non_blocking``: ``graphplan.models.Model.make_batch``), built in staging buffers
        reused every step and moved in two copies (``paged_batch.PagedBatchBuilder``)."""
        batch = self.batches.build(reqs, non_blocking=non_blocking)
        if self.lora is not None:  # each token's adapter slot (lora_slots.py)
            batch["lora_slots"] = to_device(self.lora.token_slots(reqs), self.device)
        return batch

    def num_active_loras(self, reqs) -> int:
        """Distinct LoRA adapters among ``reqs``' sequences (the step's ``num_active_loras``)."""
        return 0 if self.lora is None else self.lora.num_active(r[0] for r in reqs)

    @property
    def kv_pool(self) -> BlockTables:
        """The blocks a batcher admits and preempts by (``server.batching.BlockPool``)."""
        return self.tables

    def release(self, seat: int) -> None:
        """Give a finished sequence's blocks back now (a new sequence on the seat also does)."""
        self.tables.release(seat)

    def static_inputs(self) -> list[StaticInput]:
        """The runner's buffers: dtypes and padding that only ever touches the padding block."""
        return [
            StaticInput(name="input_ids", per="token", dtype=torch.int64, pad=0),
            StaticInput(name="positions", per="token", dtype=torch.int64, pad=0),
            StaticInput(
                name="slot_mapping", per="token", dtype=torch.int64, pad=self.cache.pad_slot
            ),
            StaticInput(
                name="block_tables",
                per="req",
                dtype=torch.int32,
                pad=self.cache.pad_block,
                trailing=(self.tables.max_blocks,),
            ),
            StaticInput(name="seq_lens", per="req", dtype=torch.int32, pad=0),
            StaticInput(name="query_start_loc", per="req+1", dtype=torch.int32, pad="last"),
        ] + ([] if self.lora is None else [LORA_SLOTS_INPUT])


def _tp_fuse(hf_model, positions: int, tp) -> FusedDecoder:
    from .tp import tp_fuse

    return tp_fuse(hf_model, positions, tp)


def _tp_loader(tp):
    from functools import partial

    from .tp_load import load_tp_model

    return partial(load_tp_model, tp=tp)
