"""The attention function transformers calls for an adapted model: write the step's K/V into the
paged cache, then attend each token over its own sequence's blocks.

Registered once with ``transformers.AttentionInterface`` under ``ATTN_IMPLEMENTATION``; the model's
attention modules call it as ``fn(module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs)`` with query ``[1, H, T, D]``, key/value ``[1, KvH, T, D]`` (rotary and any
q/k norms already applied) and expect ``(out [1, T, H, D], weights)``. The per-step metadata
arrives as the ``graphplan`` keyword (a ``PagedBatch``), which the model's forward hands down to
every attention call. Shapes depend only on the token and request counts and nothing reads a value
back to the host, so a step can be captured in a CUDA graph.

Piecewise graphs (the run-time split, ``runtime/piecewise/graphs.py``): the registered function is
the ``attention`` split point, so it runs eagerly between the graph segments. The forward then
hands it a ``StepInputs`` (the runner's static input buffers, nothing derived from them) and the
first attention call of each step builds the ``PagedBatch`` from what the buffers hold now and from
``breakable.current_step()`` (the real token and request counts): nothing of the step is baked in
at capture, and prefill chunks attend over their real lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphplan.runtime.piecewise.breakable import current_step, split_point

ATTN_IMPLEMENTATION = "graphplan_paged"
FUSED_MIN_ROWS = 128
"""Above this many query rows, gathered attention runs as one fused SDPA kernel (256-token mixed
steps of the HF Llama: 3.11x eager instead of 1.99x, H100); at or below it the einsum form,
which was faster for decode batches of up to 64 rows (same H100 runs)."""
GATHER_BUDGET = 1 << 26
"""Largest K (and V) gather, in elements, that an eager step with prefill chunks still attends
in one batched kernel (128 MiB in bf16); above it each prefill chunk attends over its own
sequence (a loop over requests, with host reads of the offsets)."""
PREFILL_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA kernels for prefill chunks. Not cuDNN: it builds an execution plan per new shape (~29 ms
of host time per call on an H100, measured), and every prompt length is a new shape."""


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """One request with more than one query token in an eager batch."""

    start: int
    end: int
    """Its token rows [start, end) in the batch."""
    slots: torch.Tensor
    """[S] int64: the flat slots of its positions 0..S-1 (S = its sequence length)."""
    allowed: torch.Tensor
    """[end - start, S] bool: causal by position."""


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One step's view of the cache, computed once per forward (not per layer).

    Graph-safe path (every batch inside a graph, and uniform decode): every token gathers its own
    sequence's slots, ``key_slots [T, L]`` with L = max_blocks_per_seq x block_size. Eager batches
    with prefill chunks gather only for their single-token rows (``rows``) and attend each
    multi-token request over its own S slots (``prefill``), so memory and work follow the real
    sequence lengths rather than T x L."""

    kv: torch.Tensor
    """[layers, 2, blocks + 1, block_size, KvH, D]: written in place."""
    slot_mapping: torch.Tensor
    """[T] int64: where each token's K/V goes (padded tokens: the padding slot)."""
    key_slots: torch.Tensor
    """[T', L] int64: the flat slot of each position 0..L-1 of the row's own sequence."""
    future: torch.Tensor
    """[T', L] bool: positions after the row's own (stale or unwritten slots): masked."""
    rows: torch.Tensor | None = None
    """[T'] token rows that ``key_slots`` covers; None: all T rows."""
    prefill: tuple[PrefillSpan, ...] = ()
    padded: bool = False
    """Some token rows belong to no request (their output is zeros)."""


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def make_paged_batch(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> PagedBatch:
    """positions/slot_mapping [T], block_tables [R, B] (padded with the padding block), seq_lens
    [R], query_start_loc [R + 1] (padded requests repeat the last offset, so they are empty)."""
    block_size = kv.shape[3]
    num_tokens, num_reqs = positions.shape[0], block_tables.shape[0]
    device = positions.device
    span = torch.arange(block_tables.shape[1] * block_size, device=device)  # [L]
    gathered = num_tokens * span.numel() * kv.shape[-2] * kv.shape[-1]  # elements of K gathered
    if num_tokens == num_reqs or _capturing() or gathered <= GATHER_BUDGET:
        # no host reads (a graph may record this), one kernel per layer for every request
        token = torch.arange(num_tokens, device=device, dtype=query_start_loc.dtype)
        # request of each token; padded tokens past the last offset land on the last row
        # (offsets <= token) - 1, over every offset: no slice of query_start_loc, which torch
        # 2.11's inductor cannot lower with a size-oblivious dynamic length
        req = torch.searchsorted(query_start_loc.contiguous(), token, right=True) - 1
        req = req.clamp_(min=0, max=num_reqs - 1)  # [T]
        blocks = block_tables.long()[req]  # [T, B]
        key_slots = blocks[:, span // block_size] * block_size + span % block_size  # [T, L]
        return PagedBatch(kv, slot_mapping, key_slots, span[None, :] > positions[:, None])
    # eager with prefill chunks: host offsets are free here (nothing is being recorded); tokens past
    # the last offset (a padded piecewise step) belong to no request and get zeros
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    single, single_reqs, spans = [], [], []
    for r in range(num_reqs):
        a, b = starts[r], starts[r + 1]
        if b - a == 1:
            single.append(a)
            single_reqs.append(r)
        elif b - a > 1:
            n_blocks = -(-lens[r] // block_size)
            base = block_tables[r, :n_blocks].long()[:, None] * block_size  # [nb, 1]
            slots = (base + span[:block_size]).flatten()[: lens[r]]  # [S]
            allowed = span[None, : lens[r]] <= positions[a:b, None]  # [n, S]
            spans.append(PrefillSpan(a, b, slots, allowed))
    rows = torch.tensor(single, dtype=torch.long, device=device)
    blocks = block_tables.long()[torch.tensor(single_reqs, dtype=torch.long, device=device)]
    key_slots = blocks[:, span // block_size] * block_size + span % block_size  # [T', L]
    future = span[None, :] > positions[rows][:, None]
    return PagedBatch(
        kv,
        slot_mapping,
        key_slots,
        future,
        rows,
        tuple(spans),
        padded=starts[num_reqs] < num_tokens,
    )


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


def _gathered(q, cache, key_slots, future, scaling):
    """q [T', KvH, G, D] over each row's gathered slots -> [T', KvH, G, D]."""
    keys, values = cache[0][key_slots], cache[1][key_slots]  # [T', L, KvH, D]
    # one fused kernel for many rows (tokens x K/V heads as the batch); not in compiled code, where
    # inductor fuses the masked softmax itself and a branch on the token count would be a guard
    # on it (recompiling at sizes the warm-up did not take)
    if not torch.compiler.is_compiling() and q.shape[0] > FUSED_MIN_ROWS:
        with sdpa_kernel(PREFILL_BACKENDS):
            return torch.nn.functional.scaled_dot_product_attention(
                q,
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=~future[:, None, None, :],
                scale=scaling,
            )
    scores = torch.einsum("tkgd,tlkd->tkgl", q, keys).float() * scaling  # [T', KvH, G, L]
    scores = scores.masked_fill(future[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.einsum("tkgl,tlkd->tkgd", probs, values)


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
    kv_heads = key.shape[1]
    if scaling is None:
        scaling = head_dim**-0.5
    b = graphplan.batch() if isinstance(graphplan, StepInputs) else graphplan
    cache = b.kv[module.layer_idx].view(2, -1, kv_heads, head_dim)  # [2, slots, KvH, D]
    cache[0].index_copy_(0, b.slot_mapping, key[0].transpose(0, 1))
    cache[1].index_copy_(0, b.slot_mapping, value[0].transpose(0, 1))
    q = query[0].transpose(0, 1).reshape(num_tokens, kv_heads, num_heads // kv_heads, head_dim)
    if b.rows is None:
        out = _gathered(q, cache, b.key_slots, b.future, scaling)
        return out.reshape(1, num_tokens, num_heads, head_dim), None
    out = (q.new_zeros if b.padded else q.new_empty)(num_tokens, num_heads, head_dim)
    if b.rows.numel():
        out[b.rows] = _gathered(q[b.rows], cache, b.key_slots, b.future, scaling).reshape(
            -1, num_heads, head_dim
        )
    with sdpa_kernel(PREFILL_BACKENDS):
        for p in b.prefill:  # [1, heads, n or S, D] per request; K/V heads shared by query groups
            o = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, p.start : p.end],
                cache[0][p.slots].transpose(0, 1)[None],
                cache[1][p.slots].transpose(0, 1)[None],
                attn_mask=p.allowed,
                scale=scaling,
                enable_gqa=True,
            )
            out[p.start : p.end] = o[0].transpose(0, 1)
    return out[None], None


def register() -> None:
    """Make ``ATTN_IMPLEMENTATION`` a valid ``attn_implementation`` (idempotent), marked as the
    ``attention`` splitting op of piecewise plans."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, split_paged_attention)


split_paged_attention = split_point("attention", paged_attention)
