"""A counter-based 32-bit hash in integer tensor ops: the same bits from the same counters on any
device, with no generator state. The sampler's noise (server/core/sampling.py) and the random weights a
seed draws (models/hf/load.py's ``init_random``) both derive from it."""

from __future__ import annotations

M32 = 0xFFFF_FFFF


def mix32(x):
    """A bijective 32-bit integer hash (xorshift-multiply, multipliers below 2**31): works on Python
    ints and on int64 tensors holding values in [0, 2**32), with the same results."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """A seed (any int; used modulo 2**64) as the 32-bit key its streams derive from."""
    seed %= 2**64
    return mix32(mix32((seed & M32) ^ 0x5BD1E995) ^ (seed >> 32))
