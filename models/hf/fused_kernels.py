"""Triton kernels of the fused small ops (``fused_ops`` calls them; it holds the plain-torch
references they are tested against). Each reads and writes its rows once and rounds where
transformers' eager code rounds (the residual sum, the normalised activations and SiLU's output,
in the activation dtype), computing in float32 between.

- ``rmsnorm``: one program per row (the whole row in one tile): ``res_out = x + res`` (optional),
  ``out = w * (s * rsqrt(mean(s^2) + eps))``. In place when ``out is x`` and ``res_out is res``:
  a program has read its row before it writes it.
- ``silu_mul``: ``[T, 2I]`` gate|up -> ``[T, I]`` ``silu(gate) * up``; programs over (row, column
  tile).
- ``rotary``: q and k heads of one ``[T, (H + 2 KvH) D]`` projection row rotated in place, the
  cos/sin of each token's position read from ``[P, D/2]`` tables at ``positions[t]`` (loaded on
  the device; nothing comes back to the host); programs over (token, tile of heads).
- ``gemv``: one token's projection ``[N, K] @ [K]``, programs over tiles of weight rows. Measured
  against cuBLAS by bench/gemv_probe.py (issue 37's narrow TP shards); not in the forward yet.

No launch takes a token count: the grid carries it, so one compiled kernel serves every batch
size (a new size never compiles during a CUDA graph capture). Importing this module needs triton
(it ships with CUDA builds of torch; the CPU tests run it under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROTARY_TILE = 512
"""Elements of q/k one rotary program rotates (a few heads' half dimensions)."""
SILU_TILE = 1024


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride, res_stride, out_stride,
    res_out_stride, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, gu_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=ok, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(
    qk_ptr, pos_ptr, cos_ptr, sin_ptr, row_stride, table_stride, n_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    i = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * table_stride + i, mask=i < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * table_stride + i, mask=i < HALF, other=0.0).to(tl.float32)
    ok = (heads < n_heads) & (i < HALF)
    first = qk_ptr + t * row_stride + heads * HEAD_DIM + i
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(first, (x1 * c - x2 * s).to(qk_ptr.dtype.element_ty), mask=ok)
    tl.store(first + HALF, (x2 * c + x1 * s).to(qk_ptr.dtype.element_ty), mask=ok)


def _warps(elements: int) -> int:
    return max(1, min(16, elements // 512))


def rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    """x, residual, out, residual_out ``[T, N]`` (last dim contiguous), weight ``[N]``."""
    rows, n = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(n)
    res = x if residual is None else residual
    res_out = out if residual_out is None else residual_out
    _rmsnorm_kernel[(rows,)](
        x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0),
        res_out.stride(0), n, eps, HAS_RES=residual is not None, BLOCK=block,
        num_warps=_warps(block),
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """gate_up ``[T, 2I]`` -> out ``[T, I]`` (last dims contiguous)."""
    rows, n = out.shape
    if rows == 0:
        return
    block = min(SILU_TILE, triton.next_power_of_2(n))
    grid = (rows, triton.cdiv(n, block))
    _silu_mul_kernel[grid](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=_warps(block)
    )


def rotary(
    qk: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    head_dim: int,
) -> None:
    """Rotate the first ``n_heads`` heads of each row of ``qk`` ``[T, >= n_heads * head_dim]``
    (heads of ``head_dim`` side by side, last dim contiguous) in place; ``cos``/``sin`` ``[P,
    head_dim // 2]`` contiguous, ``positions`` ``[T]``."""
    rows = qk.shape[0]
    if rows == 0:
        return
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(max(1, ROTARY_TILE // block_half), triton.next_power_of_2(n_heads))
    grid = (rows, triton.cdiv(n_heads, block_h))
    _rotary_kernel[grid](
        qk, positions, cos, sin, qk.stride(0), cos.stride(0), n_heads, HEAD_DIM=head_dim,
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=_warps(block_h * block_half),
    )  # fmt: skip


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, n_rows, n_cols, w_stride,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    at = w_ptr + rows.to(tl.int64)[:, None] * w_stride  # [BLOCK_N, 1] row starts
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, n_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < n_cols
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(at + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """``out [N] = weight [N, K] @ x [K] (+ bias [N])``, summed in float32 and rounded once to
    ``out``'s dtype, as ``F.linear`` on one token. Each program reads ``block_n`` whole rows of
    the weight, ``block_k`` columns at a time (rows and x contiguous). The tile shape is the
    caller's: bench/gemv_probe.py measures several against cuBLAS; this is not yet in the
    model's forward (a kernel enters it when a measured step says it pays)."""
    n, k = weight.shape
    if n == 0:
        return
    grid = (triton.cdiv(n, block_n),)
    _gemv_kernel[grid](
        x, weight, out if bias is None else bias, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
