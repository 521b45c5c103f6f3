"""A step's inputs over a paged KV cache, built with array operations into staging buffers that are
reused every step and moved to the device in two copies.

``PagedBatchBuilder.build`` turns a batcher's ``(seat, start_pos, token_ids)`` requests into the
flattened batch that ``hf.adapter.PagedCausalLM`` (and its attention) reads, T tokens of R requests:

    int64 group: input_ids [T] | positions [T] | slot_mapping [T]
    int32 group: block_tables [R, max_blocks_per_seq] | seq_lens [R] | query_start_loc [R + 1]

each group one host buffer (``runtime.staging.PinnedStaging``: pinned on CUDA, written in place,
double-buffered against a copy in flight) and one copy to the device, each input a view of its
group's device tensor (parts start 16-byte aligned). The per-request Python is a ``zip`` and a
few numpy calls; ``BlockTables.reserve`` runs only for a request that starts a sequence or needs
another block, and the rows and slots come from the tables' arrays in one gather each.
"""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import numpy as np
import torch

from graphplan.runtime.staging import PinnedStaging, aligned

from .paged_kv import BlockTables


class PagedBatchBuilder:
    """``build`` a step's inputs for ``tables``; staging sized for ``max_tokens`` tokens of
    ``max_reqs`` requests (a larger step grows it once)."""

    def __init__(
        self, tables: BlockTables, *, max_tokens: int, max_reqs: int, device: torch.device | str
    ):
        self.tables = tables
        width = tables.max_blocks
        self.int64 = PinnedStaging(torch.int64, 3 * aligned(max_tokens, torch.int64), device)
        int32 = aligned(max_reqs * width, torch.int32) + aligned(max_reqs, torch.int32)
        self.int32 = PinnedStaging(torch.int32, int32 + max_reqs + 1, device)

    def build(
        self, reqs: Sequence[tuple[int, int, Sequence[int]]], *, non_blocking: bool = False
    ) -> dict[str, torch.Tensor]:
        """reqs: ``(seat, start_pos, token_ids)`` per request, distinct seats -> the forward's
        keyword tensors on the device, after reserving the blocks the tokens write
        (``non_blocking``: ``graphplan.models.Model.make_batch``)."""
        r = len(reqs)
        seat_of, start_of, tokens = zip(*reqs) if r else ((), (), ())
        seats = np.array(seat_of, dtype=np.int64)
        starts = np.array(start_of, dtype=np.int64)
        counts = np.fromiter(map(len, tokens), dtype=np.int64, count=r)
        t = int(counts.sum())
        tables = self.tables
        tables.reserve_all(seats, starts, counts)
        qsl = np.zeros(r + 1, dtype=np.int64)  # [R + 1]
        np.cumsum(counts, out=qsl[1:])

        tp = aligned(t, torch.int64)
        h64 = self.int64.host(3 * tp)
        ids, pos, slots = h64[:t], h64[tp : tp + t], h64[2 * tp : 2 * tp + t]
        ids[:] = np.fromiter(chain.from_iterable(tokens), dtype=np.int64, count=t)
        if t == r and (r == 0 or counts.min() == 1):  # decodes: one token a request
            seat_tok = seats
            pos[:] = starts
        else:
            req = np.repeat(np.arange(r), counts)  # [T]: each token's request
            seat_tok = seats[req]
            np.subtract(np.arange(t), qsl[req], out=pos)
            pos += starts[req]
        tables.slots_into(seat_tok, pos, slots)

        w = tables.max_blocks
        nb, ns = aligned(r * w, torch.int32), aligned(r, torch.int32)
        n32 = nb + ns + r + 1
        h32 = self.int32.host(n32)
        tables.rows_into(seats, h32[: r * w].reshape(r, w))
        np.add(starts, counts, out=h32[nb : nb + r])
        h32[nb + ns : n32] = qsl

        d64 = self.int64.send(3 * tp, non_blocking=non_blocking)
        d32 = self.int32.send(n32, non_blocking=non_blocking)
        return dict(
            input_ids=d64[:t],
            positions=d64[tp : tp + t],
            slot_mapping=d64[2 * tp : 2 * tp + t],
            block_tables=d32[: r * w].view(r, w),
            seq_lens=d32[nb : nb + r],
            query_start_loc=d32[nb + ns : n32],
        )

    def allocations(self) -> int:
        """Host staging buffers allocated so far (constant unless a step outgrew them)."""
        return self.int64.allocations + self.int32.allocations
