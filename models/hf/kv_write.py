"""Writing a step's K/V into a layer's paged cache as one custom op, so that torch.compile keeps the
write in place.

Why: written as ``cache[0].index_copy_(0, slots, key)`` on a view of the pool, the write is
functionalized by AOT autograd into an out-of-place ``index_copy`` of the whole layer slice plus a
copy of that slice back into the cache, and inductor does not turn it back into an in-place
write: every compiled step then copies every layer's whole K and V (the pool's size, not the
batch's), which is why ``GraphRunner(compile=True)`` was 2.8x slower than without it at 8B (see
the fused-ops report; tests/test_kv_write.py shows the copies in the generated code). A custom op
that declares the cache it mutates is functionalized as ``auto_functionalized`` instead, which
inductor re-inplaces: the compiled code calls the op on the cache itself. Eagerly (and inside a
CUDA graph) it is the two ``index_copy_`` calls.
"""

from __future__ import annotations

import torch


def write_kv_into(
    cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """cache ``[2, blocks, block_size, KvH, D]`` (one layer of the pool), slots ``[T]`` int64 over
    the layer's ``blocks * block_size`` slots, key and value ``[T, KvH, D]``: slot ``slots[t]`` of
    K gets ``key[t]``, likewise V. Eagerly and in CUDA graphs the attention calls this directly;
    under torch.compile it goes through ``write_kv``."""
    flat = cache.view(2, -1, cache.shape[-2], cache.shape[-1])
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)


@torch.library.custom_op("graphplan::write_kv", mutates_args=("cache",))
def write_kv(
    cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """``write_kv_into`` as one op that declares the cache it mutates. The cache is passed as the
    layer's own tensor and viewed here, not in the compiled code, which on CUDA rebuilt the view
    out of bounds."""
    write_kv_into(cache, slots, key, value)


@write_kv.register_fake
def _write_kv_fake(cache, slots, key, value) -> None:
    return None
