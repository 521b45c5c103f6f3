"""The attention function transformers calls for an adapted model: write the step's K/V into the
paged cache, then attend each token over its own request's blocks, reading only the keys up to its
own position (never ``max_model_len`` slots).

Registered once with ``transformers.AttentionInterface`` under ``ATTN_IMPLEMENTATION``; the model's
attention modules call it as ``fn(module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs)`` with query ``[1, H, T, D]``, key/value ``[1, KvH, T, D]`` (rotary and any
q/k norms already applied) and expect ``(out [1, T, H, D], weights)``. The per-step metadata
arrives as the ``graphplan`` keyword (a ``PagedBatch``), which the model's forward hands down to
every attention call.

Where a token's keys are: request r owns token rows ``query_start_loc[r] .. query_start_loc[r + 1]
- 1``, the last at position ``seq_lens[r] - 1``; its keys are the slots of its block table at
positions 0..seq_lens[r] - 1, each row seeing those at positions <= its own. Rows past
``query_start_loc[R]`` (padded tokens) belong to no request and get zeros.

- CUDA: the Triton kernels of ``triton_attention.py`` (split-KV decode when T == R, the varlen
  prefill kernel otherwise). Their grids depend only on (T, R) and they read every length and
  offset on the device, so a step can be captured in a CUDA graph and replayed with new metadata.
- Elsewhere (the CPU; CUDA without Triton, eagerly only): ``attend_torch``, one SDPA call per
  request over its own ``seq_lens[r]`` keys, with the offsets read on the host.
- Under ``torch.compile`` both run as one opaque custom op, ``graphplan::paged_attend``: dynamo
  neither traces the kernels' launches nor the host reads of the CPU path.

Piecewise graphs (the run-time split, ``runtime/piecewise/graphs.py``): the registered function is
the ``attention`` split point, so it runs eagerly between the graph segments. The forward then
hands it a ``StepInputs`` (the runner's static input buffers, nothing derived from them) and the
first attention call of each step builds the ``PagedBatch`` from what the buffers hold now and from
``breakable.current_step()`` (the real request count): nothing of the step is baked in at capture.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphplan.runtime.piecewise.breakable import current_step, split_point

from .kv_write import write_kv, write_kv_into

ATTN_IMPLEMENTATION = "graphplan_paged"
SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA kernels of the torch path on CUDA. Not cuDNN: it builds an execution plan per new shape
(~29 ms of host time per call on an H100, measured), and every prompt length is a new shape."""
HAVE_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One step's view of the cache and its metadata, made once per forward (every layer reads
    it). Shapes depend only on the token count T and the request count R."""

    kv: torch.Tensor
    """[layers, 2, blocks + 1, block_size, KvH, D]: written in place."""
    slot_mapping: torch.Tensor
    """[T] int64: where each token's K/V goes (padded tokens: the padding slot)."""
    block_tables: torch.Tensor
    """[R, max_blocks_per_seq] int32 (padded entries: the padding block)."""
    seq_lens: torch.Tensor
    """[R] int32: each request's length after this step (padded requests: 0)."""
    query_start_loc: torch.Tensor
    """[R + 1] int32: its first token row (padded requests repeat the last offset)."""


def make_paged_batch(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> PagedBatch:
    """positions/slot_mapping [T], block_tables [R, B] (padded with the padding block), seq_lens
    [R], query_start_loc [R + 1] (padded requests repeat the last offset, so they are empty).
    ``positions`` is not read: a token's position follows from seq_lens and query_start_loc."""
    del positions
    return PagedBatch(kv, slot_mapping, block_tables, seq_lens, query_start_loc)


@dataclass(eq=False)
class StepInputs:
    """What a piecewise step's attention reads: the runner's static input views at the graph's
    padded counts (token rows, and ``min(tokens, max_num_seqs)`` request rows). ``batch()`` slices
    them at the real request count of ``current_step()`` and builds the step's ``PagedBatch`` once
    per step (every layer shares it)."""

    kv: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    _memo: tuple = field(default=(None, None), repr=False)

    def batch(self) -> PagedBatch:
        step = current_step()
        if step is not None and self._memo[0] is step:
            return self._memo[1]
        reqs = (
            self.block_tables.shape[0]
            if step is None
            else min(step.num_reqs, self.block_tables.shape[0])
        )
        made = make_paged_batch(
            self.kv,
            self.positions,
            self.slot_mapping,
            self.block_tables[:reqs],
            self.seq_lens[:reqs],
            self.query_start_loc[: reqs + 1],
        )
        self._memo = (step, made)
        return made


def attend_torch(q, cache, block_tables, seq_lens, query_start_loc, scale) -> torch.Tensor:
    """q [T, H, D] over cache [2, blocks + 1, block_size, KvH, D] -> [T, H, D]: per request, one
    SDPA call over its own ``seq_lens[r]`` keys (offsets read on the host: eager steps only)."""
    num_tokens, num_heads, head_dim = q.shape
    page = cache.shape[2]
    keys, values = cache[0].flatten(0, 1), cache[1].flatten(0, 1)  # [slots, KvH, D]
    out = q.new_zeros(num_tokens, num_heads, head_dim)  # padded rows stay zero
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    span = torch.arange(page, device=q.device)
    for r in range(block_tables.shape[0]):
        a, b, length = starts[r], starts[r + 1], lens[r]
        if b <= a:
            continue
        blocks = block_tables[r, : -(-length // page)].long()
        slots = (blocks[:, None] * page + span).flatten()[:length]  # [S]
        keys_at = torch.arange(length, device=q.device)
        allowed = keys_at[None, :] <= keys_at[length - (b - a) :, None]  # [n, S]: causal
        with sdpa_kernel(SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            o = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1)[None],  # [1, H, n, D]
                keys[slots].transpose(0, 1)[None],  # [1, KvH, S, D]
                values[slots].transpose(0, 1)[None],
                attn_mask=allowed,
                scale=scale,
                enable_gqa=True,
            )
        out[a:b] = o[0].transpose(0, 1)
    return out


def _attend(q, cache, block_tables, seq_lens, query_start_loc, scale) -> torch.Tensor:
    if q.is_cuda and HAVE_TRITON:
        from .triton_attention import paged_attention as triton_paged_attention

        return triton_paged_attention(q, cache, block_tables, seq_lens, query_start_loc, scale)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "paged attention in a CUDA graph needs Triton (it ships with torch's CUDA wheels): "
            "install triton, or run this plan's steps eagerly"
        )
    return attend_torch(q, cache, block_tables, seq_lens, query_start_loc, scale)


@torch.library.custom_op("graphplan::paged_attend", mutates_args=())
def paged_attend(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``_attend`` as one op that torch.compile does not look into."""
    return _attend(q, cache, block_tables, seq_lens, query_start_loc, scale)


@paged_attend.register_fake
def _(q, cache, block_tables, seq_lens, query_start_loc, scale):
    return q.new_empty(q.shape)


def paged_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    graphplan: "PagedBatch | StepInputs | None" = None,
    **kwargs,
):
    if graphplan is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs the step's "
            "paged metadata: run the model through "
            "graphplan.models.hf.PagedCausalLM"
        )
    _, num_heads, num_tokens, head_dim = query.shape
    if scaling is None:
        scaling = head_dim**-0.5
    b = graphplan.batch() if isinstance(graphplan, StepInputs) else graphplan
    cache = b.kv[module.layer_idx]  # [2, blocks + 1, block_size, KvH, D]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KvH, D]
    # compiled: one op that inductor keeps in place (models/hf/kv_write.py); eager and in graphs
    # the same two copies without a custom op's dispatch
    write = write_kv if torch.compiler.is_compiling() else write_kv_into
    write(cache, b.slot_mapping, k_new, v_new)
    q = query[0].transpose(0, 1)  # [T, H, D]
    if q.stride(-1) != 1:
        q = q.contiguous()
    attend = paged_attend if torch.compiler.is_compiling() else _attend
    out = attend(q, cache, b.block_tables, b.seq_lens, b.query_start_loc, float(scaling))
    return out[None], None


def register() -> None:
    """Make ``ATTN_IMPLEMENTATION`` a valid ``attn_implementation`` (idempotent), marked as the
    ``attention`` splitting op of piecewise plans."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, split_paged_attention)


split_paged_attention = split_point("attention", paged_attention)
