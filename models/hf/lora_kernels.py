"""Triton kernels of batched LoRA (``lora_slots``), as vLLM's punica BGMV kernels: each token reads
only its own slot's weights.

- ``shrink``: ``s[t, j*R:(j+1)*R] = x[t] @ A[slot[t], j]^T`` in float32 for each sub-projection j
  (q, k, v of a fused q|k|v; gate, up of gate|up), split along the input: programs over (token, j,
  chunk of ``BLOCK_K`` inputs), each writing its partial sums (a token of slot -1 writes zeros),
  so that a decode step of one token still spreads over many SMs;
- ``expand``: ``y[t, o] += scale[slot[t]] * s[t, j(o)*R:(j(o)+1)*R] . B[o, slot[t], j(o)]`` in
  place (the shrink's partial sums added first), j(o) the sub-projection of output row o; programs over (token, tile of rows), a token of
  slot -1 is left as it is.

Slot ids and scales are read on the device (static buffers: graphs replay with any mix), and no
launch takes a token count, so one compile serves every batch size. The dot products are
multiply-and-sum (ranks are small: memory, not math, bounds them), so the kernels take any rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 256
BLOCK_O = 64


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, s_ptr, K, x_stride, s_stride,
    N_SUB: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    part = tl.program_id(2)  # split K: each program one BLOCK_K chunk, the expand sums them
    slot = tl.load(slot_ptr + t)
    rs = tl.arange(0, BLOCK_R)
    ok_r = rs < R
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        rows = (slot * N_SUB + j) * R + rs
        ks = part * BLOCK_K + tl.arange(0, BLOCK_K)
        ok_k = ks < K
        xv = tl.load(x_ptr + t * x_stride + ks, mask=ok_k, other=0.0).to(tl.float32)
        av = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
            mask=ok_r[:, None] & ok_k[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = tl.sum(av * xv[None, :], axis=1)
    tl.store(s_ptr + t * s_stride + part * (N_SUB * R) + j * R + rs, acc, mask=ok_r)


@triton.jit
def _expand_kernel(
    y_ptr, s_ptr, b_ptr, slot_ptr, scale_ptr, OUT, PARTS, y_stride, s_stride, b_stride, bound1,
    bound2, N_SUB: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        rs = tl.arange(0, BLOCK_R)
        ok_r = rs < R
        s0 = tl.zeros([BLOCK_R], dtype=tl.float32)  # the shrink of each sub-projection
        s1 = tl.zeros([BLOCK_R], dtype=tl.float32)
        s2 = tl.zeros([BLOCK_R], dtype=tl.float32)
        for part in range(PARTS):
            row = s_ptr + t * s_stride + part * (N_SUB * R)
            s0 += tl.load(row + rs, mask=ok_r, other=0.0)
            if N_SUB > 1:
                s1 += tl.load(row + R + rs, mask=ok_r, other=0.0)
            if N_SUB > 2:
                s2 += tl.load(row + 2 * R + rs, mask=ok_r, other=0.0)
        os = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        ok_o = os < OUT
        j = (os >= bound1).to(tl.int32) + (os >= bound2).to(tl.int32)
        jj = j[:, None]
        sv = tl.where(jj == 0, s0[None, :], tl.where(jj == 1, s1[None, :], s2[None, :]))
        ok = ok_o[:, None] & ok_r[None, :]
        cols = (slot * N_SUB + j)[:, None] * R + rs[None, :]
        bv = tl.load(b_ptr + os[:, None].to(tl.int64) * b_stride + cols, mask=ok, other=0.0)
        upd = tl.sum(sv * bv.to(tl.float32), axis=1) * tl.load(scale_ptr + slot).to(tl.float32)
        yv = tl.load(y_ptr + t * y_stride + os, mask=ok_o, other=0.0)
        tl.store(y_ptr + t * y_stride + os, (yv.to(tl.float32) + upd).to(yv.dtype), mask=ok_o)


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    scales: torch.Tensor,
    bounds: tuple[int, ...],
    rank: int,
) -> torch.Tensor:
    """``y`` ``[T, out]`` += each token's adapter update, in place (module docstring). ``a``
    ``[S*n*R, in]``, ``b`` ``[out, S*n*R]`` (``lora_slots`` layout), ``slots`` ``[T]``,
    ``bounds``: the first output row of each sub-projection after the first (n - 1 of them)."""
    t, n = x.shape[0], len(bounds) + 1
    out, k = y.shape[1], x.shape[1]
    parts = triton.cdiv(k, BLOCK_K)
    s = torch.empty(t, parts * n * rank, dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(rank)
    _shrink_kernel[(t, n, parts)](
        x, a, slots, s, k, x.stride(0), s.stride(0),
        N_SUB=n, R=rank, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    b1, b2 = (*bounds, out, out)[:2]
    _expand_kernel[(t, triton.cdiv(out, BLOCK_O))](
        y, s, b, slots, scales, out, parts, y.stride(0), s.stride(0), b.stride(0), b1, b2,
        N_SUB=n, R=rank, BLOCK_R=block_r, BLOCK_O=BLOCK_O,
    )  # fmt: skip
    return y
