"""Decode steps as two nano-batches whose attention and dense work overlap on the GPU.

A large uniform-decode step spends about half its time in GEMMs (compute-bound) and half in the
attention's KV reads (memory-bound), one after the other. Split the step's requests in two halves
A and B and run each layer as a two-stage pipeline on two CUDA streams: while the side stream
runs A's attention, the main stream runs B's dense work (o_proj, MLP, the next layer's norm and
q|k|v), and the other way round:

    main:  pre(A,0) pre(B,0) | post(A,0) pre(A,1) | post(B,0) pre(B,1) | post(A,1) ...
    side:           attn(A,0) | attn(B,0)          | attn(A,1)          | attn(B,1) ...

so a step costs about the larger of the two kinds instead of their sum (NanoFlow's intra-device
overlap, arXiv 2408.12757: nano-batches of one batch whose compute-, memory- and network-bound
operations run concurrently; learned from the paper, no code taken).

Every operation is the one ``FusedDecoder.layer_forward`` runs, on half the rows, so a step's
tokens are those of the plain forward up to GEMM rounding (cuBLAS picks its algorithm by the row
count). On a device without streams (the CPU) the same order runs on one stream, and equals the
plain forward exactly.

Only uniform decode (one token per request, ``T == R``, the attention's ``PagedBatch``) of at
least ``min_tokens`` tokens is split; everything else (mixed steps, piecewise steps, LoRA, tensor
parallelism) takes the plain forward. Works eagerly and under CUDA graph capture: the side stream
forks from and joins back into the capturing stream through events.

Memory: a tensor handed between streams is kept referenced until the receiving stream's work on it
is ordered before the sender's next allocation, so the caching allocator never reuses a block that
the other stream still reads (each stream reuses only its own blocks, in its own order).
"""

from __future__ import annotations

import torch

from .attention import PagedBatch


def split_batch(meta: PagedBatch, s: int) -> tuple[PagedBatch, PagedBatch]:
    """The two halves of a uniform decode step's metadata: requests (and their one token each)
    ``[0, s)`` and ``[s, R)``; B's offsets restart at 0."""
    qsl = meta.query_start_loc
    a = PagedBatch(meta.kv, meta.slot_mapping[:s], meta.block_tables[:s], meta.seq_lens[:s], qsl[: s + 1])
    b = PagedBatch(
        meta.kv, meta.slot_mapping[s:], meta.block_tables[s:], meta.seq_lens[s:], qsl[s:] - qsl[s]
    )
    return a, b


def applies(decoder, meta, tokens: int) -> bool:
    """Whether ``decoder`` runs this step as two overlapped nano-batches."""
    return (
        decoder.overlap_min_tokens > 0
        and tokens >= max(2, decoder.overlap_min_tokens)
        and isinstance(meta, PagedBatch)
        and meta.block_tables.shape[0] == tokens
        and decoder.lora_step is None
        and type(decoder).reduce is _plain_reduce()
    )


def _plain_reduce():
    from .fused_decoder import FusedDecoder

    return FusedDecoder.reduce


class _Streams:
    """The main stream and the side stream of one device; on the CPU both run inline."""

    def __init__(self, side: torch.cuda.Stream | None):
        self.side = side
        self.main = torch.cuda.current_stream() if side is not None else None

    def fork(self):
        """An event of the main stream's work so far (None on the CPU)."""
        if self.side is None:
            return None
        e = torch.cuda.Event()
        e.record(self.main)
        return e

    def on_side(self, after, fn):
        """``fn()`` on the side stream once the main stream has reached ``after`` -> (its result,
        the event of its completion)."""
        if self.side is None:
            return fn(), None
        self.side.wait_event(after)
        with torch.cuda.stream(self.side):
            out = fn()
            done = torch.cuda.Event()
            done.record(self.side)
        return out, done

    def join(self, done) -> None:
        """The main stream waits for the side stream's work up to ``done``."""
        if done is not None:
            self.main.wait_event(done)


def side_stream(decoder, device: torch.device) -> torch.cuda.Stream | None:
    """The decoder's side stream on ``device`` (made once), None off CUDA."""
    if device.type != "cuda":
        return None
    if decoder._side_stream is None:
        decoder._side_stream = torch.cuda.Stream(device, priority=decoder.overlap_priority)
    return decoder._side_stream


def overlapped_layers(decoder, h: torch.Tensor, step: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer of a uniform decode step as two overlapped halves (module docstring)
    -> (the last layer's output, the residual stream), both ``[T, hidden]``."""
    positions, position_ids, meta, attention = step
    layers = decoder.layers
    s = h.shape[0] // 2
    streams = _Streams(side_stream(decoder, h.device))
    metas = split_batch(meta, s)
    pos = (positions[:s], positions[s:])
    pids = (position_ids[:, :s], position_ids[:, s:])
    hs: list = [h[:s], h[s:]]
    res: list = [None, None]
    qkv: list = [None, None]
    out: list = [None, None]
    done: list = [None, None]

    def attend(x: int, layer):
        return lambda: decoder.attend(layer, qkv[x], pids[x], metas[x], attention)

    qkv[0], res[0] = decoder.pre_attention(layers[0], hs[0], None, pos[0])
    for i, layer in enumerate(layers):
        out[0], done[0] = streams.on_side(streams.fork(), attend(0, layer))
        if i == 0:
            qkv[1], res[1] = decoder.pre_attention(layer, hs[1], None, pos[1])
        else:
            streams.join(done[1])
            hs[1], res[1] = decoder.post_attention(layers[i - 1], out[1], res[1])
            qkv[1], res[1] = decoder.pre_attention(layer, hs[1], res[1], pos[1])
        out[1], done[1] = streams.on_side(streams.fork(), attend(1, layer))
        streams.join(done[0])
        hs[0], res[0] = decoder.post_attention(layer, out[0], res[0])
        if i + 1 < len(layers):
            qkv[0], res[0] = decoder.pre_attention(layers[i + 1], hs[0], res[0], pos[0])
    streams.join(done[1])
    hs[1], res[1] = decoder.post_attention(layers[-1], out[1], res[1])
    return torch.cat(hs), torch.cat(res)
