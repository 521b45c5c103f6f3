"""Where a tensor-parallel rank's batch-1 decode step goes (issue 37's TP=2 <= 0.62x bar): the
8B shape's per-layer GEMMs at the widths of TP = 1, 2 and 4 (a rank's shards), every layer's
weights distinct (no L2 reuse), timed as one CUDA graph of the whole model's GEMMs and nothing
else; beside it the bytes those GEMMs must read and the HBM bandwidth they reach. GPU only: one
GPU (``--device cpu --shape tiny`` only checks the program).

    python bench/gemv_probe.py --tps 1,2,4 --batches 1,64 --out gemv_probe.md

``--triton 8x512x4,16x256x8``: at batch 1, also the Triton GEMV of models/hf/fused_kernels.py
(``gemv``) with each tile config (rows x columns x warps), kind by kind beside cuBLAS, and the
whole model's GEMMs with each kind's fastest config.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from graphplan.models.hf.tp import split_of

from llama_shapes import SHAPES
from timing import graph_time_per_call, publish


def rank_weights(shape: dict, tp: int, device, dtype=torch.bfloat16) -> list[list[torch.Tensor]]:
    """Each layer's [out, in] weights of rank 0 as models/hf/tp.py splits the shape
    (``split_of``): q|k|v and gate|up fused (as the fused decoder runs them), o_proj and
    down_proj split by their input; then the LM head's vocabulary rows."""
    s = split_of(SimpleNamespace(**shape), tp, 0, f"the {tp}-rank shape")
    h, d = shape["hidden_size"], s.head_dim
    dims = [((s.heads + 2 * s.kv_heads) * d, h), (h, s.heads * d), (2 * s.inter, h), (h, s.inter)]
    layers = shape["num_hidden_layers"]
    out = [[torch.randn(o, i, device=device, dtype=dtype) for o, i in dims] for _ in range(layers)]
    out.append([torch.randn(s.vocab_rows, h, device=device, dtype=dtype)])
    return out


def by_kind(ws):
    """(kind, weight) of every GEMM of a step in order: kinds 0-3 each layer's q|k|v, o_proj,
    gate|up and down; 4 the LM head."""
    for layer in ws:
        for k, w in enumerate(layer):
            yield (4 if len(layer) == 1 else k), w


def against_cublas(tp, ws, x, whole_cublas, cublas, configs, dev, a) -> str:
    """One row of the Triton table: each kind's cuBLAS ms against the Triton GEMV's with each
    config (the fastest shown), then the whole model's GEMMs in one graph, both ways (Triton:
    each kind's fastest config). ``x``: the cuBLAS run's batch-1 inputs, by width."""
    from graphplan.models.hf.fused_kernels import gemv

    outs = {w.shape[0]: w.new_empty(w.shape[0]) for _, w in by_kind(ws)}

    def run(kinds):  # kind -> config
        for kind, w in by_kind(ws):
            if kind in kinds:
                bn, bk, warps = kinds[kind]
                gemv(x[w.shape[1]][0], w, None, outs[w.shape[0]], bn, bk, warps)

    best, cells = {}, []
    for k in range(5):
        ts = {c: graph_time_per_call(lambda k=k, c=c: run({k: c}), dev, a.iters) for c in configs}
        best[k] = min(ts, key=ts.__getitem__)
        cells.append(
            f"{cublas[k] * 1e3:.3f} / **{ts[best[k]] * 1e3:.3f}** ({'x'.join(map(str, best[k]))})"
        )
    whole = graph_time_per_call(lambda: run(best), dev, a.iters)
    return f"| {tp} | {whole_cublas * 1e3:.3f} | {whole * 1e3:.3f} | " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--tps", default="1,2,4")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the program")
    p.add_argument("--triton", default="", help="Triton GEMV tile configs, ROWSxCOLSxWARPS,...")
    a = p.parse_args(argv)
    configs = [tuple(map(int, c.split("x"))) for c in a.triton.split(",") if c]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU smoke run of --triton
    if configs and (any(len(c) != 3 for c in configs) or not (a.device == "cuda" or interpreted)):
        print(
            "gemv_probe: --triton takes ROWSxCOLSxWARPS configs and a CUDA device",
            file=sys.stderr,
        )
        return 2
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gemv_probe: needs a CUDA device (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    shape = SHAPES[a.shape]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    lines = [
        f"# gemv_probe ({a.shape}), {name}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"command: `python bench/gemv_probe.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "| TP | batch | weights GB (rank) | GEMMs ms | GB/s | by kind ms (qkv, o, gate_up, down, head) |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    triton_rows: list[str] = []
    for tp in (int(x) for x in a.tps.split(",")):
        ws = rank_weights(shape, tp, dev)
        gb = sum(w.numel() * w.element_size() for layer in ws for w in layer) / 1e9
        for b in (int(x) for x in a.batches.split(",")):
            x = {w.shape[1]: torch.randn(b, w.shape[1], device=dev, dtype=torch.bfloat16)
                 for _, w in by_kind(ws)}  # fmt: skip

            def run(kinds=None, ws=ws, x=x):
                for kind, w in by_kind(ws):
                    if kinds is None or kind in kinds:
                        F.linear(x[w.shape[1]], w)

            t = graph_time_per_call(run, dev, a.iters)
            each = [graph_time_per_call(lambda k=k: run({k}), dev, a.iters) for k in range(5)]
            lines.append(
                f"| {tp} | {b} | {gb:.2f} | {t * 1e3:.3f} | {gb / t:.0f} | "
                + ", ".join(f"{e * 1e3:.3f}" for e in each)
                + " |"
            )
            print(lines[-1], flush=True)
            if b == 1 and configs:
                triton_rows.append(against_cublas(tp, ws, x, t, each, configs, dev, a))
        del ws, x
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if triton_rows:
        lines += [
            "",
            "Batch 1, the Triton GEMV (models/hf/fused_kernels.py ``gemv``) beside cuBLAS: ms per "
            "step of each kind (all layers), its fastest tile config (rows x columns x warps):",
            "",
            "| TP | GEMMs ms cuBLAS | GEMMs ms Triton (fastest per kind) | qkv | o | gate_up | down | head |",
            "|---:|---:|---:|---|---|---|---|---|",
            *triton_rows,
        ]
    publish("\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
