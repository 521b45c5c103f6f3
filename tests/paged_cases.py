"""Random paged-attention batches and their dense reference, shared by tests/test_paged_attention.py
and tests/test_paged_attention_gpu.py.

A case scatters each request's dense K/V into randomly chosen (shuffled, non-contiguous) blocks of
a cache whose every other slot holds NaN (stale and padding slots, the padding block): a kernel
that reads one slot it should not turns the output NaN. The reference attends each request's
query rows over its dense K/V in float64 (causal by position), so it shares no addressing with
the code under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    q: torch.Tensor
    """[T, H, D]; rows past query_start_loc[R] are padded tokens."""
    cache: torch.Tensor
    """[2, num_blocks + 1, page, KvH, D]: block num_blocks is the padding block."""
    block_tables: torch.Tensor
    """[R + padded requests, max_blocks] int32, padded with the padding block."""
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: tuple
    """Per real request, its dense K [S, KvH, D] (V in ``values``)."""
    values: tuple
    scale: float

    @property
    def padded_rows(self) -> slice:
        return slice(int(self.query_start_loc[-1]), self.q.shape[0])

    def inputs(self) -> tuple:
        return (
            self.q,
            self.cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_case(
    seq_lens,
    q_lens,
    *,
    kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 32,
    page: int = 4,
    dtype=torch.float32,
    device="cpu",
    pad_tokens: int = 0,
    pad_reqs: int = 0,
    num_blocks: int | None = None,
    max_blocks: int | None = None,
    seed: int = 0,
) -> Case:
    """Request r has ``seq_lens[r]`` tokens in the cache, its last ``q_lens[r]`` being this step's
    query rows; ``pad_tokens`` rows and ``pad_reqs`` requests of padding follow (a graph's batch)."""
    assert len(seq_lens) == len(q_lens) and all(0 < n <= s for s, n in zip(seq_lens, q_lens))
    gen = torch.Generator().manual_seed(seed)  # the block order
    data = torch.Generator(device=device).manual_seed(seed)  # K, V and q, drawn where they live
    need = [-(-s // page) for s in seq_lens]
    num_blocks = num_blocks or sum(need) + 3
    max_blocks = max_blocks or max(need) + 1
    assert num_blocks >= sum(need) and max_blocks >= max(need)
    shape = (2, num_blocks + 1, page, kv_heads, head_dim)
    cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    tables = torch.full((len(seq_lens) + pad_reqs, max_blocks), num_blocks, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    keys, values = [], []
    for r, s in enumerate(seq_lens):
        blocks = [free.pop() for _ in range(need[r])]
        tables[r, : need[r]] = torch.tensor(blocks, dtype=torch.int32)
        k, v = (
            torch.randn(s, kv_heads, head_dim, generator=data, device=device).to(dtype)
            for _ in range(2)
        )
        pos = torch.arange(s, device=device)
        where = torch.tensor(blocks, device=device)[pos // page], pos % page
        cache[0][where], cache[1][where] = k, v
        keys.append(k)
        values.append(v)
    num_tokens = sum(q_lens) + pad_tokens
    q = torch.randn(num_tokens, kv_heads * group, head_dim, generator=data, device=device)
    offsets = [0]
    for n in q_lens:
        offsets.append(offsets[-1] + n)
    offsets += [offsets[-1]] * pad_reqs
    return Case(
        q=q.to(dtype),
        cache=cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(list(seq_lens) + [0] * pad_reqs, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(offsets, dtype=torch.int32, device=device),
        keys=tuple(keys),
        values=tuple(values),
        scale=head_dim**-0.5,
    )


def dense_reference(case: Case) -> torch.Tensor:
    """[T, H, D] float64 on the CPU: per request, causal SDPA over its dense K/V; padded rows 0."""
    return sdpa_reference(case, torch.float64, "cpu")


def sdpa_reference(case: Case, dtype: torch.dtype, device) -> torch.Tensor:
    """[T, H, D] in ``dtype`` on ``device``: per request, causal SDPA over its contiguous K/V (the
    case's own copy, not the paged cache); padded rows 0."""
    q = case.q.detach().to(device, dtype)
    out = torch.zeros_like(q)
    starts = case.query_start_loc.tolist()
    for r, (k, v) in enumerate(zip(case.keys, case.values)):
        a, b = starts[r], starts[r + 1]
        s = k.shape[0]
        pos = torch.arange(s - (b - a), s, device=device)
        allowed = torch.arange(s, device=device)[None, :] <= pos[:, None]
        if b - a == 1:  # a decode row sees every key: no mask, so SDPA may pick a fused kernel
            allowed = None
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None],
            k.to(device, dtype).transpose(0, 1)[None],
            v.to(device, dtype).transpose(0, 1)[None],
            attn_mask=allowed,
            scale=case.scale,
            enable_gqa=True,
        )
        out[a:b] = o[0].transpose(0, 1)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (NaN anywhere: inf)."""
    out, ref = (x.detach().cpu().double() for x in (out, ref))
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm())
