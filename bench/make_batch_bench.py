"""``PagedCausalLM.make_batch`` alone in the steady decode state (issue 34): ``--batch`` requests of
``--context`` tokens each decode one token a step (each crossing into a new KV block every
``block_size`` steps, staggered), the step's inputs built and sent to the device, nothing run. The
tiny Llama shape with random weights; only its block tables and batches are used.

    python bench/make_batch_bench.py --device cpu --batch 256 --context 1024

Prints the best and the median of ``--repeats`` means over ``--steps`` steps each: on a shared
machine the best is the least disturbed (host_step.py times every phase of the real step).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from graphplan.models.hf import PagedCausalLM

import load_test
from machine import machine
from timing import publish


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=80, help="steps a repeat times")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--non-blocking", action="store_true")
    p.add_argument("--out", help="also write the markdown result here")
    return p.parse_args(argv)


def measure(a) -> list[float]:
    """Mean seconds per make_batch of each repeat."""
    max_len = a.context + a.steps * a.repeats + 32
    with tempfile.TemporaryDirectory() as tmp:
        path = load_test.write_model(Path(tmp) / "m", "tiny", max_len)
        model = PagedCausalLM.load(
            str(path),
            max_num_seqs=a.batch,
            max_model_len=max_len,
            device=a.device,
            random_weights=True,
            kv_cache_tokens=a.batch * max_len,
            max_step_tokens=max(a.context + 16, a.batch),
        )
    for seat in range(a.batch):  # the prompts' blocks (no forward): contexts staggered by seat
        model.make_batch([(seat, 0, [1] * (a.context + seat % 16))])
    nb = {"non_blocking": True} if a.non_blocking else {}
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    means, k = [], 0
    for _ in range(a.repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            reqs = [(s, a.context + s % 16 + k, (5,)) for s in range(a.batch)]
            model.make_batch(reqs, **nb)
            k += 1
        sync()
        means.append((time.perf_counter() - t0) / a.steps)
    return means


def main(argv=None) -> int:
    a = parse_args(argv)
    means = measure(a)
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else machine()
    lines = [
        f"## make_batch: {a.batch} decodes of {a.context}-token contexts, {a.device}"
        + (", non_blocking" if a.non_blocking else ""),
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {where}, torch "
        f"{torch.__version__}, python {platform.python_version()}; "
        f"`python bench/make_batch_bench.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "| best us | median us |",
        "|---|---|",
        f"| {min(means) * 1e6:.0f} | {statistics.median(means) * 1e6:.0f} |",
    ]
    publish("\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
