"""Overlapped nano-batch decode (models/hf/overlap.py) against the plain fused forward, at real scale:
a Llama-3-8B-shaped model (random bf16 weights from its config), uniform decode steps of B requests
at ``--context`` tokens each, every variant captured in a CUDA graph and replayed on the same
weights and cache. GPU only for a result; ``--device cpu --shape tiny`` checks the program.

    python bench/overlap_bench.py --out bench/results/overlap_bench.md

Per batch:
- **plain**: ``FusedDecoder.forward`` (the decoder, no LM head: the server's ``logits="rows"``);
- **overlap p0 / p-1**: the same step as two overlapped halves, the side stream at the default
  or the high CUDA priority;
- **plain lt / overlap cN** (``--carveouts``): with cuBLASLt as torch's BLAS, plain, and
  overlapped with the GEMMs leaving N SMs free (PyTorch's experimental SM carveout) so the
  attention finds SMs to run beside them;
- **dense** and **attention**: the step's two kinds of work alone (the attention function replaced
  by a view of q; the 32 layers' attention calls alone). Their sum is what a serial step costs at
  least, their max what a perfect overlap would cost;
- the attention's KV bytes read per second, and the largest |difference| of the overlapped
  step's hidden states from the plain one's (bf16 GEMMs on half the rows round differently).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys

import torch

from graphplan.models.hf import PagedCausalLM
from graphplan.models.hf.attention import make_paged_batch
from graphplan.runtime.dp.ubatch import sm_carveout

from real_scale import SHAPES, build_model
from timing import graph_time_per_call, publish

KEYS = ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--batches", default="64,128,256,384,512")
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--carveouts",
        default="32,64",
        help="SM counts the GEMMs leave free (cuBLASLt carveout) in extra overlap rows",
    )
    p.add_argument("--out")
    a = p.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",") if x]
    a.carveouts = [int(x) for x in a.carveouts.split(",") if x]
    if a.device == "cpu" and a.shape != "tiny":
        p.error("the CPU runs only --shape tiny")
    return a


def _view_attention(module, query, key, value, mask, **kwargs):
    """Stands in for the attention: q itself as the output (no KV read)."""
    return query.transpose(1, 2), None


def measure(model: PagedCausalLM, a, device, b: int) -> dict:
    dec = model.fused
    batch = model.make_batch([(seat, a.context, [1 + seat]) for seat in range(b)])
    meta = make_paged_batch(model.kv_cache, *(batch[k] for k in KEYS))
    ids, positions = batch["input_ids"], batch["positions"]
    t = lambda fn: graph_time_per_call(fn, device, a.iters, a.repeats)
    row: dict = {"batch": b}

    def step():
        return dec.forward(ids, positions, meta, head=False)

    with torch.no_grad():
        dec.overlap_min_tokens = 0
        row["plain"] = t(step)
        plain_out = step().float()
        for prio in (0, -1):
            dec.overlap_min_tokens, dec.overlap_priority, dec._side_stream = 2, prio, None
            row[f"overlap p{prio}"] = t(step)
            row.setdefault("diff", (step().float() - plain_out).abs().max().item())
        if device.type == "cuda" and a.carveouts:  # cuBLASLt GEMMs leave SMs to the attention
            previous = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                dec.overlap_min_tokens = 0
                row["plain lt"] = t(step)
                dec.overlap_min_tokens, dec.overlap_priority, dec._side_stream = 2, 0, None
                for sms in a.carveouts:
                    with sm_carveout(sms):
                        row[f"overlap c{sms}"] = t(step)
            finally:
                torch.backends.cuda.preferred_blas_library(previous)
        dec.overlap_min_tokens = 0
        real = dec.step_inputs
        dec.step_inputs = lambda pos, gp: (pos, pos[None], gp, _view_attention)
        try:
            row["dense"] = t(step)
        finally:
            dec.step_inputs = real
        _, pids, _, attention = real(positions, meta)
        qkv = torch.randn(b, dec.layers[0].qkv.shape[0], device=device, dtype=dec.embed.dtype)
        row["attention"] = t(lambda: [dec.attend(ly, qkv, pids, meta, attention) for ly in dec.layers])
    cfg = model.hf.config
    kv_bytes = len(dec.layers) * b * (a.context + 1) * 2 * cfg.num_key_value_heads * dec.head_dim
    row["kv_gbs"] = kv_bytes * dec.embed.element_size() / row["attention"] / 1e9
    for seat in range(b):
        model.release(seat)
    return row


def report(a, device, rows) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    when = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"# overlap_bench ({a.shape}), {name}, {when:%Y-%m-%d %H:%M} UTC",
        f"command: `python bench/overlap_bench.py {shlex.join(sys.argv[1:])}`",
        f"torch {torch.__version__}; every request at context {a.context}; graph replay times in ms",
        "",
        "| batch | plain | overlap p0 | overlap p-1 | best / plain | dense | attention | dense + attention | max(dense, attention) | attention GB/s | max |diff| |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    extra = [k for k in rows[0] if k == "plain lt" or k.startswith("overlap c")]
    if extra:
        lines[-2] = lines[-2].replace(" | dense |", " | " + " | ".join(extra) + " | dense |")
        lines[-1] = "|---" * (11 + len(extra)) + "|"
    for r in rows:
        best = min(r["overlap p0"], r["overlap p-1"])
        lines.append(
            f"| {r['batch']} | {r['plain'] * 1e3:.2f} | {r['overlap p0'] * 1e3:.2f} | "
            f"{r['overlap p-1'] * 1e3:.2f} | {best / r['plain']:.3f} | "
            + "".join(f"{r[k] * 1e3:.2f} | " for k in extra)
            + f"{r['dense'] * 1e3:.2f} | "
            f"{r['attention'] * 1e3:.2f} | {(r['dense'] + r['attention']) * 1e3:.2f} | "
            f"{max(r['dense'], r['attention']) * 1e3:.2f} | {r['kv_gbs']:.0f} | {r['diff']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    hf, _ = build_model(a, device)
    top = max(a.batches)
    model = PagedCausalLM(
        hf,
        max_num_seqs=top,
        max_model_len=a.context + 2 * a.block_size,
        block_size=a.block_size,
        kv_cache_tokens=top * (a.context + 2 * a.block_size),
        fused_ops=True,
        logits="rows",
    )
    if model.fused is None:
        print(f"fused_ops does not apply: {model.fused_reason}", file=sys.stderr)
        return 2
    rows = [measure(model, a, device, b) for b in a.batches]
    publish(report(a, device, rows), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
