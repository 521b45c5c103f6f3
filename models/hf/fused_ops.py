"""The fused small ops of a decoder layer: RMSNorm with the residual add, SiLU(gate) x up on a
fused gate|up projection, and rotary embeddings applied to q and k in place. Each runs as one
Triton kernel (``fused_kernels``) on CUDA and as plain torch elsewhere (the CPU, and code that
torch.compile traces, where inductor fuses the torch ops itself). The plain-torch forms
(``*_reference``) are transformers' own eager computations, op for op (LlamaRMSNorm, SiLU,
apply_rotary_pos_emb): on the CPU the fused layer computes what the stock layer does.

Shapes are fixed by the token count and nothing reads a value back to the host, so every op can
be captured in a CUDA graph. Under ``TRITON_INTERPRET=1`` the Triton kernels run on CPU tensors too
(Triton's interpreter: how the CPU tests check them).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.cache
def kernels():
    """The Triton kernels module, or None where triton is not installed."""
    try:
        from . import fused_kernels
    except ImportError:
        return None
    return fused_kernels


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` runs the Triton kernel: a CUDA tensor outside a torch.compile trace
    (or any tensor under Triton's interpreter), with triton installed."""
    if t.is_cuda:
        return not torch.compiler.is_compiling() and kernels() is not None
    return os.environ.get("TRITON_INTERPRET") == "1" and kernels() is not None


# -- references: transformers' eager code ------------------------------------------------------
def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward."""
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """LlamaMLP's ``act_fn(gate_proj(x)) * up_proj(x)`` on ``[T, 2I]`` gate|up. The gate half is
    made contiguous first, as gate_proj's own output is: torch's CPU SiLU rounds a strided input
    differently (the last bit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.contiguous()) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(x, positions, cos, sin) -> torch.Tensor:
    """apply_rotary_pos_emb on ``x`` ``[T, heads, D]`` at ``positions`` ``[T]``, with ``cos``
    and ``sin`` ``[P, D/2]`` tables of the rotary frequencies (each half of HF's cat(freqs,
    freqs))."""
    c, s = cos[positions], sin[positions]  # [T, D/2]
    c = torch.cat((c, c), dim=-1)[:, None, :].to(x.dtype)
    s = torch.cat((s, s), dim=-1)[:, None, :].to(x.dtype)
    return (x * c) + (rotate_half(x) * s)


# -- the ops --------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[T, N]`` into a new tensor."""
    if not use_triton(x):
        return rmsnorm_reference(x, weight, eps)
    out = torch.empty_like(x)
    kernels().rmsnorm(x, None, weight, eps, out, None)
    return out


def add_rmsnorm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, one kernel: ``residual <- residual + x`` (transformers' residual add), then
    ``x <- RMSNorm(residual)``. Returns (x, residual): the normalised input of the next block and
    the new residual stream. Both ``[T, N]``, last dim contiguous."""
    if not use_triton(x):
        residual.copy_(residual + x)
        x.copy_(rmsnorm_reference(residual, weight, eps))
        return x, residual
    kernels().rmsnorm(x, residual, weight, eps, x, residual)
    return x, residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` gate|up (one GEMM's output) -> ``[T, I]`` ``silu(gate) * up``."""
    if not use_triton(gate_up):
        return silu_mul_reference(gate_up)
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    kernels().silu_mul(gate_up, out)
    return out


def rotary_(
    qk: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    head_dim: int,
) -> None:
    """Rotate, in place, the first ``n_heads`` heads (q's heads, then k's) of each row of ``qk``
    ``[T, W]`` (a fused q|k|v projection: the heads side by side, ``W >= n_heads * head_dim``) by
    each token's position; ``cos``/``sin`` ``[P, head_dim / 2]``, read at ``positions`` ``[T]``
    on the device."""
    if not use_triton(qk):
        heads = qk[:, : n_heads * head_dim].view(qk.shape[0], n_heads, head_dim)
        heads.copy_(rotary_reference(heads, positions, cos, sin))
        return
    kernels().rotary(qk, positions, cos, sin, n_heads, head_dim)


def rotary_tables(
    inv_freq: torch.Tensor, scaling: float, positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[positions, D/2]`` in ``dtype``, computed as LlamaRotaryEmbedding.forward
    computes them (float32 products of position and frequency, times the rope type's attention
    scaling, then rounded to the activations' dtype) on ``inv_freq``'s device."""
    pos = torch.arange(positions, device=inv_freq.device)
    freqs = pos[:, None].float() * inv_freq.float()[None, :]
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)
