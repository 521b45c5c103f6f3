"""Calibrate graphplan's memory model for the tiny Llama on this GPU and save the profile.

    plan compile plans/tiny-llama.yaml -o table.json
    python examples/calibrate_memory.py --table table.json -o profile.json
    plan compile plans/tiny-llama.yaml --memory --profile profile.json

Needs a CUDA GPU: the CPU stand-in has no device memory, so a profile measured there would be all
zeros. After calibrating it captures the whole table once and prints the model's estimate against
that capture (estimate / actual; the bar is <= 1.15); ``--no-check`` skips that capture.
"""

from __future__ import annotations

import argparse
import sys

import torch

from graphplan.compiler.tools import memory
from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, static_inputs
from graphplan.runtime import GraphplanError, GraphRunner, load_table
from graphplan.runtime.calibrate import calibrate_memory

BAR = 1.15  # estimate / actual at most this (and at least 1 / BAR)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", required=True, help="a compiled table.json")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write (atomically)")
    p.add_argument("--device", default="cuda", help="a CUDA device (default cuda)")
    p.add_argument("--count", type=int, default=4, help="FULL graphs captured to calibrate")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip capturing the whole table to compare the estimate with it",
    )
    a = p.parse_args(argv)
    if not a.device.startswith("cuda") or not torch.cuda.is_available():
        why = (
            "no CUDA device is visible"
            if a.device.startswith("cuda")
            else f"--device {a.device} is not a CUDA device"
        )
        print(
            f"calibrate_memory: needs a CUDA GPU and {why}: without one there is no device "
            "memory to measure (a profile would be all zeros); run it on the GPU the plan is "
            f"for. Nothing written to {a.output}.",
            file=sys.stderr,
        )
        return 1
    try:
        table = load_table(a.table)
        cfg = TinyLlamaConfig(num_cache_rows=table.max_num_seqs)
        model = TinyLlama(cfg, seed=0, device=a.device, dtype=torch.bfloat16)
        prof = calibrate_memory(model, table, static_inputs(model), count=a.count)
        if not prof["samples"] or prof["samples"][0][1] <= 0:
            print(
                f"calibrate_memory: the first graph's capture grew the pool by 0 bytes on "
                f"{prof['device']}: nothing to fit; nothing written to {a.output}",
                file=sys.stderr,
            )
            return 1
        memory.save_profile(a.output, prof)
    except (GraphplanError, ValueError) as e:
        print(f"calibrate_memory: {e}", file=sys.stderr)
        return 1
    print(
        f"{a.output}: {prof['per_graph_bytes'] / 2**20:.2f} MiB per graph + "
        f"{prof['per_token_bytes'] / 1024:.1f} KiB per token on {prof['device']} "
        f"(samples [tokens, bytes], largest first: {prof['samples']})"
    )
    if a.no_check:
        return 0
    est = memory.estimate(table, prof)
    runner = GraphRunner(model, table, static_inputs(model), device=a.device, progress=False)
    actual = runner.capture()["bytes"]
    runner.release()
    ratio = est["total_bytes"] / actual if actual else float("inf")
    ok = 1 / BAR <= ratio <= BAR
    print(
        f"check: {len(table.graphs)} graphs ({est['largest_graph_tokens']} tokens largest): "
        f"estimate {est['total_bytes'] / 2**20:.1f} MiB, actual capture "
        f"{actual / 2**20:.1f} MiB, estimate / actual = {ratio:.3f} "
        f"(bar {1 / BAR:.2f}..{BAR:.2f}: {'PASS' if ok else 'FAIL'})"
    )
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
