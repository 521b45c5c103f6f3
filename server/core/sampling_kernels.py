"""A Triton kernel for the sampler's last step (``Sampler(fused=True)``, server/core/sampling.py): the
Gumbel noise of each (row, token), the truncation mask and the argmax, in one pass over the scaled
logits. The torch form runs the counter hash as about a dozen elementwise int64 ops over
[rows, vocab] (0.77 ms of the sampler's 2.1 ms at 64 x 128256 on an H100,
bench/results/sampling_bench.md); here each program hashes its tile in 32-bit registers, reads the
scaled logits once and writes one (max, index) pair.

``gumbel_argmax(scaled, threshold, row_keys, greedy)``:

- programs over (row, tile of ``TILE`` tokens); a program computes, for each token v of its tile,
  ``u = ((mix32(row_key ^ mix32(v * A + B)) >> 9) + 1/2) * 2**-23`` and ``g = -log(-log u)`` (the
  same bits as ``sampling.gumbel_noise``, whose constants these are), ``g = 0`` on greedy rows,
  and the score ``scaled + g`` where ``scaled >= threshold`` (else -inf), and writes its tile's
  largest score and the first token holding it;
- torch then takes, per row, the first tile holding the row's largest score: the token is that
  tile's index, so ties go to the smallest token id, as ``torch.argmax`` breaks them.

No launch takes the row count as a constant (the grid carries it), so one compiled kernel serves
every batch size and a CUDA graph capture never compiles. The float32 logs are the device's; where
two scores are within a rounding of each other the token may differ from the torch form's, never
between two runs of the same form. Importing this module needs triton (it ships with CUDA builds
of torch; the CPU tests run it under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048
"""Tokens one program scores: 63 tiles a row at a 128256-token vocabulary."""


@triton.jit
def _mix32(x):
    """``sampling.mix32`` on uint32 (multiplication wraps modulo 2**32, shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x21F0AAAD, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x735A2D97, tl.uint32)
    return x ^ (x >> 15)


@triton.jit
def _gumbel_argmax_kernel(
    scaled_ptr, threshold_ptr, row_key_ptr, greedy_ptr, best_ptr, best_idx_ptr, row_stride,
    vocab, n_tiles, TILE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tile * TILE + tl.arange(0, TILE)
    ok = cols < vocab
    x = tl.load(scaled_ptr + row * row_stride + cols, mask=ok, other=float("-inf"))
    key = tl.load(row_key_ptr + row).to(tl.uint32)
    v = cols.to(tl.uint32)
    vocab_key = _mix32(
        v * tl.full(v.shape, 0x2545F491, tl.uint32) + tl.full(v.shape, 0x68E31DA4, tl.uint32)
    )
    bits = _mix32(vocab_key ^ key)
    u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    noise = -tl.log(-tl.log(u))
    greedy = tl.load(greedy_ptr + row) != 0
    noise = tl.where(greedy, 0.0, noise)
    threshold = tl.load(threshold_ptr + row)
    score = tl.where(ok & (x >= threshold), x + noise, float("-inf"))
    best, best_idx = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + row * n_tiles + tile, best)
    tl.store(best_idx_ptr + row * n_tiles + tile, tile * TILE + best_idx)


def gumbel_argmax(
    scaled: torch.Tensor, threshold: torch.Tensor, row_keys: torch.Tensor, greedy: torch.Tensor
) -> torch.Tensor:
    """[R] int64: per row of ``scaled`` [R, vocab] float32 (unit stride along the vocabulary), the
    token with the largest ``scaled + noise`` among those ``>= threshold`` [R] float32 (``-inf``:
    every token), the noise hashed from ``row_keys`` [R] int64 (32-bit values:
    ``mix32(seed_key ^ step_key)``, ``sampling.gumbel_noise``'s row keys), none on rows where
    ``greedy`` [R] bool is set."""
    rows, vocab = scaled.shape
    if scaled.dtype != torch.float32 or scaled.stride(1) != 1:
        raise ValueError("gumbel_argmax needs float32 scores with unit stride along the vocabulary")
    n_tiles = triton.cdiv(vocab, TILE)
    best = torch.empty(rows, n_tiles, dtype=torch.float32, device=scaled.device)
    best_idx = torch.empty(rows, n_tiles, dtype=torch.int32, device=scaled.device)
    _gumbel_argmax_kernel[(rows, n_tiles)](
        scaled, threshold.contiguous(), row_keys.contiguous(), greedy.to(torch.int8),
        best, best_idx, scaled.stride(0), vocab, n_tiles, TILE=TILE,
    )  # fmt: skip
    return best_idx.gather(1, best.argmax(dim=1, keepdim=True))[:, 0].long()
