"""Paged decode attention at Llama-3-8B's shape (32 query heads, 8 K/V heads, head_dim 128, bf16):
graphplan's Triton split-KV kernel (models/hf/triton_attention.py) against the gather path it
replaced and against the floor, per batch, context and max_model_len. GPU only: it exits 2
without a CUDA device (tests/test_paged_attention.py checks its layouts on the CPU).

- ``triton``: ``triton_attention.decode`` over a pool of 16-token blocks, shuffled, holding only the
  requests' real context; block tables ``max_model_len / 16`` wide (padded).
- ``gather``: the attention before issue 25 (``models/hf/attention.py`` at ecd53a4), rebuilt: every
  token gathers the ``max_model_len`` slots of its table (a cache of ``batch x max_model_len``
  distinct slots, as that design allocated), einsum scores in float32, masked softmax, einsum.
- ``floor``: ``F.scaled_dot_product_attention(enable_gqa=True)`` over contiguous K/V of the real
  context ``[batch, 8, context, 128]`` (what a dense cache gives; no paging).
- ``flex``: FlexAttention (``torch.compile(flex_attention)``) over a paged cache of 128-token pages
  ``[1, 8, slots, 128]``, the block mask built from the block tables (kv_indices = each request's
  pages, a mask_mod for the last page's tail). 128-token pages: flex's sparse block must be a
  multiple of its kernel's key tile, so the 16-token blocks of the other columns do not serve it;
  its kv_indices are as wide as the pool's pages (not max_model_len), so the mask's size grows
  with the pool, and a new pool or batch shape is a new compile.

Every method is recorded once in a CUDA graph and replayed; each replay is timed alone with CUDA
events after a 256 MiB write that evicts the L2 cache (a model's layers each read their own K/V, so
a layer's attention starts cold); the median of ``--iters`` replays is reported. Each method's
output is checked against the floor's (max |difference|, column ``err``). A method that fails is
reported as failed with its error, and the others still run.

    python bench/paged_attention_bench.py --out bench/results/paged_attention_bench.md
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, PAGE, FLEX_PAGE = 32, 8, 128, 16, 128
METHODS = ("triton", "gather", "floor", "flex")


def graph_time_us(fn, iters: int) -> tuple[float, torch.Tensor]:
    """(median µs of one replay of ``fn`` recorded as a CUDA graph, L2 cold, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up: compiles, loads modules, allocates outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        flush.zero_()  # evicts the L2 (50 MiB on an H100); keeps the GPU busy while we enqueue
        start[i].record()
        graph.replay()
        end[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in zip(start, end)]
    del graph
    return statistics.median(times), out


def build(batch: int, ctx: int, mml: int, gen: torch.Generator, dtype=torch.bfloat16) -> dict:
    """The same K/V and queries for every method, each in its own layout (on ``gen``'s device)."""
    dev, bf16 = gen.device, dtype
    need, width = -(-ctx // PAGE), mml // PAGE
    k = torch.randn(batch, ctx, KV_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=bf16)
    v = torch.randn(batch, ctx, KV_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=bf16)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=dev, dtype=bf16)
    num_blocks = batch * need
    order = torch.randperm(num_blocks, generator=gen, device=dev).view(batch, need)
    pool = torch.zeros(2, num_blocks + 1, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=bf16)
    padded = F.pad(torch.stack([k, v]), (0, 0, 0, 0, 0, need * PAGE - ctx))
    pool[:, order.flatten()] = padded.reshape(2, batch * need, PAGE, KV_HEADS, HEAD_DIM)
    tables = torch.full((batch, width), num_blocks, dtype=torch.int32, device=dev)
    tables[:, :need] = order.int()
    return dict(
        q=q,
        k=k,
        v=v,
        pool=pool,
        tables=tables,
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        qsl=torch.arange(batch + 1, dtype=torch.int32, device=dev),
    )


def run_triton(d: dict, ctx: int, mml: int):
    from graphplan.models.hf import triton_attention

    args = (d["q"], d["pool"], d["tables"], d["seq_lens"], d["qsl"], HEAD_DIM**-0.5)
    triton_attention.warm_up(d["q"], d["pool"], d["tables"])
    return lambda: triton_attention.decode(*args)


def run_floor(d: dict, ctx: int, mml: int):
    q = d["q"][:, :, None]  # [B, H, 1, D]
    k, v = (x.transpose(1, 2).contiguous() for x in (d["k"], d["v"]))  # [B, KvH, ctx, D]
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0]


def run_gather(d: dict, ctx: int, mml: int):
    """Each token gathers ``mml`` slots of its own table; the real context in its first blocks,
    distinct stale slots after it (a ``batch x mml`` cache, as before on-demand blocks)."""
    batch, dev = d["q"].shape[0], d["q"].device
    width, need = mml // PAGE, -(-ctx // PAGE)
    cache = torch.zeros(
        2, batch * width + 1, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=d["q"].dtype
    )
    tables = torch.arange(batch * width, device=dev).view(batch, width)
    cache[:, tables[:, :need].flatten()] = d["pool"][:, d["tables"][:, :need].flatten().long()]
    span = torch.arange(width * PAGE, device=dev)  # [L]
    key_slots = tables[:, span // PAGE] * PAGE + span % PAGE  # [T, L]
    future = span[None, :] > (ctx - 1)  # [1, L]: positions after the token's own
    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM)
    q = d["q"].view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5

    def step():
        keys, values = flat[0][key_slots], flat[1][key_slots]  # [T, L, KvH, D]
        scores = torch.einsum("tkgd,tlkd->tkgl", q, keys).float() * scale
        scores = scores.masked_fill(future[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        return torch.einsum("tkgl,tlkd->tkgd", probs, values).reshape(batch, HEADS, HEAD_DIM)

    return step


def run_flex(d: dict, ctx: int, mml: int, compiled: bool = True):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    batch, dev = d["q"].shape[0], d["q"].device
    need = -(-ctx // FLEX_PAGE)
    width = batch * need  # a block mask's kv_indices span the whole (physical) key sequence
    gen = torch.Generator(device=dev).manual_seed(ctx)
    pages = torch.randperm(batch * need, generator=gen, device=dev).view(batch, need)
    slots = batch * need * FLEX_PAGE
    k_cache = torch.zeros(1, KV_HEADS, slots, HEAD_DIM, device=dev, dtype=d["q"].dtype)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(ctx, device=dev)
    where = (pages[:, pos // FLEX_PAGE] * FLEX_PAGE + pos % FLEX_PAGE).flatten()  # [B * ctx]
    k_cache[0, :, where] = d["k"].reshape(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v_cache[0, :, where] = d["v"].reshape(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
    logical = torch.empty(batch * need, dtype=torch.int64, device=dev)  # a page's index in its seq
    logical[pages.flatten()] = torch.arange(need, device=dev).repeat(batch)
    owner = torch.empty(batch * need, dtype=torch.int64, device=dev)
    owner[pages.flatten()] = torch.arange(batch, device=dev).repeat_interleave(need)
    seq_lens = d["seq_lens"]

    def tail(b, h, q_idx, kv_idx):
        """The request's own slots before its context's end. The kernel visits only the listed
        pages and applies this within them (the last page's tail); flex's eager reference
        applies only this, so it states ownership too."""
        page = kv_idx // FLEX_PAGE
        return (owner[page] == b) & (logical[page] * FLEX_PAGE + kv_idx % FLEX_PAGE < seq_lens[b])

    indices = torch.zeros(batch, 1, 1, width, dtype=torch.int32, device=dev)
    indices[:, 0, 0, :need] = pages.int()
    counts = torch.full((batch, 1, 1), need, dtype=torch.int32, device=dev)
    mask = BlockMask.from_kv_blocks(
        counts, indices, BLOCK_SIZE=(FLEX_PAGE, FLEX_PAGE), mask_mod=tail, seq_lengths=(1, slots)
    )
    torch._dynamo.reset()  # a new block-mask shape per row: start each from no compiled entry
    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    q = d["q"][:, :, None]
    return lambda: attend(q, k_cache, v_cache, block_mask=mask, enable_gqa=True)[:, :, 0]


RUNNERS = dict(triton=run_triton, gather=run_gather, floor=run_floor, flex=run_flex)


def measure(batch, ctx, mml, methods, iters, gen) -> dict:
    d = build(batch, ctx, mml, gen)
    row: dict = {}
    ref = None
    for name in ("floor",) + tuple(m for m in methods if m != "floor"):
        try:
            us, out = graph_time_us(RUNNERS[name](d, ctx, mml), iters)
            out = out.float()
            ref = out if name == "floor" else ref
            err = math.nan if ref is None else (out - ref).abs().max().item()
            row[name] = (us, err)
        except Exception as e:  # one failing method does not stop the others
            traceback.print_exc(file=sys.stderr)
            row[name] = (
                f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            )
        torch.cuda.empty_cache()
    return row


def cell(v) -> str:
    return v if isinstance(v, str) else f"{v[0]:.1f}"


def table(rows, methods) -> list[str]:
    head = ["batch", "context", "max_model_len"] + [f"{m} µs" for m in methods]
    head += ["triton / floor", "gather / triton", "triton GB/s", "max err vs floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (batch, ctx, mml), row in rows:
        kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
        t, f, g = (row.get(m) for m in ("triton", "floor", "gather"))
        ok = [not isinstance(x, str) and x is not None for x in (t, f, g)]
        ratio = f"{t[0] / f[0]:.2f}x" if ok[0] and ok[1] else "-"
        speedup = f"{g[0] / t[0]:.1f}x" if ok[0] and ok[2] else "-"
        bw = f"{kv_bytes / t[0] / 1e3:.0f}" if ok[0] else "-"
        errs = [
            f"{m} {row[m][1]:.1e}"
            for m in methods
            if m != "floor" and not isinstance(row.get(m), str)
        ]
        cells = [str(batch), str(ctx), str(mml)] + [cell(row.get(m, "-")) for m in methods]
        lines.append("| " + " | ".join(cells + [ratio, speedup, bw, ", ".join(errs)]) + " |")
    return lines


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--max-model-lens", default="4096,32768")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", help="also write the report (markdown) here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("paged_attention_bench needs a CUDA device", file=sys.stderr)
        return 2
    methods = [m for m in a.methods.split(",") if m]
    if unknown := set(methods) - set(METHODS):
        p.error(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(METHODS)}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    rows, t0 = [], time.perf_counter()
    report = header(command, a.iters, 0.0) + table(rows, methods)
    for mml in ints(a.max_model_lens):
        for ctx in ints(a.contexts):
            if ctx > mml:
                continue
            for batch in ints(a.batches):
                row = measure(batch, ctx, mml, methods, a.iters, gen)
                rows.append(((batch, ctx, mml), row))
                print(
                    f"batch {batch} context {ctx} max_model_len {mml}: "
                    + ", ".join(f"{m} {cell(row[m])}" for m in row),
                    flush=True,
                )
                report = header(command, a.iters, time.perf_counter() - t0)
                report += table(rows, methods)
                if a.out:  # after every row: a run cut short keeps what it measured
                    with open(a.out, "w") as f:
                        f.write("\n".join(report) + "\n")
    print("\n".join(report))
    return 0


def header(command: str, iters: int, seconds: float) -> list[str]:
    import triton

    return [
        f"# paged_attention_bench — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton "
        f"{triton.__version__}, Python {platform.python_version()}",
        f"- command: `python bench/paged_attention_bench.py {command}`",
        f"- shape: {HEADS} query heads, {KV_HEADS} K/V heads, head_dim {HEAD_DIM}, bf16, one "
        f"decode token per request, every request at the context; blocks of {PAGE} "
        f"(flex: {FLEX_PAGE}); median of {iters} CUDA-graph replays, L2 flushed before each "
        f"({seconds:.0f} s so far)",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main())
