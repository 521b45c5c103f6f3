"""The attention function transformers calls for an adapted model: write the step's K/V into the
paged cache, then attend each token over its own sequence's blocks.

Registered once with ``transformers.AttentionInterface`` under ``ATTN_IMPLEMENTATION``; the model's
attention modules call it as ``fn(module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs)`` with query ``[1, H, T, D]``, key/value ``[1, KvH, T, D]`` (rotary and any
q/k norms already applied) and expect ``(out [1, T, H, D], weights)``. The per-step metadata
arrives as the ``graphplan`` keyword (a ``PagedBatch``), which the model's forward hands down to
every attention call. Shapes depend only on the token and request counts and nothing reads a value
back to the host, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTN_IMPLEMENTATION = "graphplan_paged"


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One step's view of the cache, computed once per forward (not per layer)."""

    kv: torch.Tensor
    """[layers, 2, blocks + 1, block_size, KvH, D]: written in place."""
    slot_mapping: torch.Tensor
    """[T] int64: where each token's K/V goes (padded tokens: the padding slot)."""
    key_slots: torch.Tensor
    """[T, L] int64: the flat slot of each position 0..L-1 of the token's own sequence."""
    future: torch.Tensor
    """[T, L] bool: positions after the token's own (stale or unwritten slots): masked."""


def make_paged_batch(kv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, query_start_loc: torch.Tensor) -> PagedBatch:
    """positions/slot_mapping [T], block_tables [R, B] (padded with the padding block),
    query_start_loc [R + 1] (padded requests repeat the last offset, so they are empty)."""
    block_size = kv.shape[3]
    num_tokens, num_reqs = positions.shape[0], block_tables.shape[0]
    token = torch.arange(num_tokens, device=positions.device, dtype=query_start_loc.dtype)
    # request of each token; padded tokens past the last offset land on the last row
    req = torch.searchsorted(query_start_loc[1:].contiguous(), token, right=True)
    req = req.clamp_(max=num_reqs - 1)                                        # [T]
    span = torch.arange(block_tables.shape[1] * block_size, device=positions.device)  # [L]
    blocks = block_tables.long()[req]                                         # [T, B]
    key_slots = blocks[:, span // block_size] * block_size + span % block_size  # [T, L]
    future = span[None, :] > positions[:, None]                               # [T, L]
    return PagedBatch(kv, slot_mapping, key_slots, future)


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, scaling: float | None = None, dropout: float = 0.0,
                    graphplan: PagedBatch | None = None, **kwargs):
    if graphplan is None:
        raise RuntimeError(f"attention implementation {ATTN_IMPLEMENTATION!r} needs the step's "
                           "paged metadata: run the model through "
                           "graphplan.runtime.hf.PagedCausalLM")
    _, num_heads, num_tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    if scaling is None:
        scaling = head_dim ** -0.5
    cache = graphplan.kv[module.layer_idx].view(2, -1, kv_heads, head_dim)  # [2, slots, KvH, D]
    cache[0].index_copy_(0, graphplan.slot_mapping, key[0].transpose(0, 1))
    cache[1].index_copy_(0, graphplan.slot_mapping, value[0].transpose(0, 1))
    keys = cache[0][graphplan.key_slots]                                     # [T, L, KvH, D]
    values = cache[1][graphplan.key_slots]
    q = query[0].transpose(0, 1).reshape(num_tokens, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.einsum("tkgd,tlkd->tkgl", q, keys).float() * scaling      # [T, KvH, G, L]
    scores = scores.masked_fill(graphplan.future[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    out = torch.einsum("tkgl,tlkd->tkgd", probs, values)                     # [T, KvH, G, D]
    return out.reshape(1, num_tokens, num_heads, head_dim), None


def register() -> None:
    """Make ``ATTN_IMPLEMENTATION`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
