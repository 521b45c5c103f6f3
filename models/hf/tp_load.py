"""Load one tensor-parallel rank's model (``models/hf/tp.py`` has the rules): the checkpoint is
checked whole from its headers (``load.check_checkpoint``, nothing allocated), then the rank's
model is built at its per-rank size and each tensor filled with only this rank's part of the
checkpoint's (or of ``init_random``'s) tensor."""

from __future__ import annotations

import math

import torch

from .config_check import check_memory
from .load import build_model, check_checkpoint, random_params, random_values
from .tp import Part, Split, TPGroup, full_index, install_tp, part_of, rank_config, split_of

CHUNK_ELEMENTS = 1 << 22
"""Elements drawn per random chunk (int64 temporaries of 32 MiB)."""


def load_tp_model(
    source,
    tp: TPGroup,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attn_implementation: str,
    random_weights: bool = False,
    reserve_bytes: int = 0,
):
    """``load.load_model`` for rank ``tp.rank`` of ``tp.size``: the rank's model (its config's
    ``vocab_size`` is the whole vocabulary again), its collectives installed (``install_tp``).
    TensorParallelError when the model does not split ``tp.size`` ways."""
    from .attention import ATTN_IMPLEMENTATION, register

    if attn_implementation == ATTN_IMPLEMENTATION:
        register()
    ckpt = check_checkpoint(source, dtype=dtype, random_weights=random_weights)
    split = split_of(ckpt.config, tp.size, tp.rank, ckpt.where)
    config = rank_config(ckpt.config, split)
    meta = build_model(config, dtype, "meta", "eager")
    tensors = [*meta.parameters(), *meta.buffers()]
    check_memory(
        weights=sum(t.numel() * t.element_size() for t in tensors),
        params=sum(p.numel() for p in meta.parameters()),
        kv=max(reserve_bytes, 0),
        dtype=dtype,
        device=device,
        config=config,
        where=f"{ckpt.where} (tensor-parallel rank {tp.rank} of {tp.size})",
    )
    model = build_model(config, dtype, device, attn_implementation)
    with torch.no_grad():
        if ckpt.reader is None:
            _fill_random(model, seed, split, ckpt.expected)
        else:
            targets = model.state_dict()
            for name in ckpt.expected:
                _fill(targets[name], part_of(name, split), lambda p, n=name: _read(ckpt, n, p))
    model.config.vocab_size = split.vocab
    install_tp(model, tp, split)
    return model.eval().requires_grad_(False)


def _read(ckpt, name: str, part: Part) -> torch.Tensor:
    if part.dim is None:
        return ckpt.reader.get(name)
    return ckpt.reader.get_part(name, part.dim, part.start, part.stop)


def _fill(target: torch.Tensor, part: Part, read) -> None:
    if part.zero:
        target.zero_()
        return
    held = target.shape[0] - part.pad
    target[:held].copy_(read(part))
    target[held:].zero_()


@torch.no_grad()
def _fill_random(model, seed: int, split: Split, full: dict[str, tuple[int, ...]]) -> None:
    """``load.init_random``'s weights, each rank drawing only its part's elements (the values of
    the same elements of the whole model's parameters)."""
    for name, p, std in random_params(model, seed):
        part = part_of(name, split)
        if std is None:
            p.fill_(1.0)
            continue
        if part.zero:
            p.zero_()
            continue
        shape = full[name]
        held = p.shape[0] - part.pad
        rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, math.prod(p.shape[1:])))
        for lo in range(0, held, rows_per_chunk):
            hi = min(held, lo + rows_per_chunk)
            j = full_index(part, shape, range(lo, hi), p.device)
            p[lo:hi].copy_(random_values(std, j).view(hi - lo, *p.shape[1:]))
        p[held:].zero_()
