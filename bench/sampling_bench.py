"""What sampling inside the step costs (server/core/sampling.py), against the greedy argmax the server
does today and against a conventional torch sampler (sort for top-k/top-p, softmax, torch's RNG: not
reproducible per request), each timed as a replayed CUDA graph on a GPU. GPU only: a result needs a
CUDA device; ``--quick`` on the CPU checks the program.

    python bench/sampling_bench.py --out bench/results/sampling_bench.md   # GPU: Llama-3 vocab
    python bench/sampling_bench.py --device cpu --quick                    # tiny sizes

Rows: ``argmax`` (the baseline), ``torch_reference`` (sort + softmax + exponential_ + argmax),
``sampler`` (Sampler.sample, penalties off, no logprobs: penalty-free requests), ``no_sort`` (the
same with ``truncate=False``: a step whose rows set no top-k/top-p/min-p), ``fused`` and
``fused_no_sort`` (the same two with ``Sampler(fused=True)``: noise, mask and argmax as one Triton
kernel, server/core/sampling_kernels.py; "n/a" where the kernel cannot run), ``sampler_full``
(penalties on, 20 logprobs), and two parts of the sampler: ``sort`` (the per-row threshold's sort)
and ``noise`` (the counter-based Gumbel noise). Every sampler row mixes greedy and sampled requests.

A second table times the engine's whole sampling step (``StepSampler.sample``: staging, the rows'
copy, the sampler, the host read), wall clock per step, eager against its captured graphs
(server/core/step_sampler.py), for a mixed batch without and with one request asking for logprobs:
what the graphs save is the host's launches of a few dozen small kernels per step.
"""

from __future__ import annotations

import argparse
import datetime
import random
import shlex
import sys
import time

import torch

from graphplan.server.core.batching import StepBatch
from graphplan.server.core.sampling import Sampler, gumbel_noise, seed_key, vocab_keys
from graphplan.server.core.step_sampler import StepSampler, Work
from graphplan.server.requests import QueueSink, Request
from graphplan.server.sampling_params import SamplingParams

from machine import machine
from timing import graph_time_per_call, publish, sync, time_per_call

MIX = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    SamplingParams(temperature=1.0, top_k=50, seed=2),
    SamplingParams(temperature=0.7, min_p=0.05, top_p=0.9),
]
PENALISED = SamplingParams(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.1, seed=3)


def reference(logits: torch.Tensor) -> torch.Tensor:
    """A conventional batched sampler: top-p by sort, one softmax, torch's exponential RNG."""
    x = logits.float() / 0.8
    ordered, index = x.sort(dim=-1)
    probs = ordered.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) <= 0.05
    x = x.scatter(1, index, ordered.masked_fill(drop, float("-inf")))
    probs = x.softmax(dim=-1)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)


def sampler_for(rows: int, vocab: int, device, full: bool, fused: bool = False) -> Sampler:
    s = Sampler(
        rows,
        vocab,
        device=device,
        max_logprobs=20 if full else 0,
        penalties=full,
        fused=fused,
        rng=random.Random(0),
    )
    for slot in range(rows):
        params = PENALISED if full and slot % 4 == 3 else MIX[slot % len(MIX)]
        s.set_row(slot, params, prompt_ids=list(range(slot, slot + 64)))
    s.update(list(range(rows)), [slot * 7 % vocab for slot in range(rows)])
    return s


def measure(rows: int, vocab: int, device, iters: int) -> dict[str, float]:
    logits = torch.randn(rows, vocab, device=device).bfloat16() * 3
    lean, full = sampler_for(rows, vocab, device, False), sampler_for(rows, vocab, device, True)
    slots = lean.load_slots(list(range(rows)))
    full_slots = full.load_slots(list(range(rows)))
    scaled = logits.float()
    keys = torch.tensor([seed_key(r) for r in range(rows)], device=device)
    steps, token_keys = torch.zeros_like(keys), vocab_keys(vocab, device)
    cases = {
        "argmax": lambda: logits.argmax(dim=-1),
        "torch_reference": lambda: reference(logits),
        "sampler": lambda: lean.sample(logits, slots),
        "no_sort": lambda: lean.sample(logits, slots, truncate=False),
        "sampler_full": lambda: full.sample(logits, full_slots),
        "sort": lambda: scaled.sort(dim=-1),
        "noise": lambda: gumbel_noise(keys, steps, token_keys),
    }
    try:
        fused = sampler_for(rows, vocab, device, False, fused=True)
    except ValueError:  # no kernel here: those cells say n/a
        fused = None
    if fused is not None:
        cases["fused"] = lambda: fused.sample(logits, slots)
        cases["fused_no_sort"] = lambda: fused.sample(logits, slots, truncate=False)
    t = {name: graph_time_per_call(fn, device, iters) * 1e6 for name, fn in cases.items()}
    return {name: t.get(name, float("nan")) for name in (*cases, "fused", "fused_no_sort")}


def us(x: float) -> str:
    return "n/a" if x != x else f"{x:.1f}"


def engine_step(rows: int, vocab: int, device, iters: int) -> dict[str, float]:
    """Microseconds per ``StepSampler.sample`` of ``rows`` mixed requests, eager and replayed,
    without and with one request asking for 5 logprobs."""
    logits = torch.randn(rows, vocab, device=device).bfloat16() * 3
    t = {}
    for logprobs in (False, True):
        reqs = [
            Request(list(range(i, i + 64)), 1 << 20, QueueSink(), params, logprobs=None)
            for i, params in enumerate((PENALISED, *MIX[1:], *MIX) * rows)
        ][:rows]
        reqs[-1].logprobs = 5 if logprobs else None
        batch = StepBatch(
            reqs=tuple((i, 64, (1,)) for i in range(rows)),
            request_ids=tuple(reqs),
            sample_rows=tuple(range(rows)),
            num_tokens=rows,
            max_query_len=1,
        )
        for graphs in (False, True):
            sync(device)
            t0 = time.perf_counter()
            s = StepSampler(rows, vocab, device, graphs=graphs)
            sync(device)
            if graphs:  # every padded row count x every Work variant, warm-ups included
                t["capture_s"], t["graphs"] = (
                    time.perf_counter() - t0,
                    len(s.sizes) * len(Work.every()),
                )
            key = f"{'graph' if graphs else 'eager'}{'_logprobs' if logprobs else ''}"
            t[key] = time_per_call(lambda: s.sample(batch, logits), device, iters, 3) * 1e6
            s.release_graphs()
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=128256, help="Llama 3's vocabulary")
    ap.add_argument("--rows", default="1,8,64,256", help="requests sampled per step")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--smoke", "--quick", action="store_true", help="tiny sizes: checks the program"
    )
    ap.add_argument("--out", help="also write the markdown result here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    vocab, rows = args.vocab, [int(r) for r in args.rows.split(",")]
    if args.smoke:
        vocab, rows, args.iters = 1000, [1, 4], 3
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## Sampling cost per step, vocab {vocab}, {device.type}",
        "",
        f"{now}, {where}; `python bench/sampling_bench.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "| rows | argmax us | torch_reference us | sampler us | no_sort us | fused us "
        "| fused_no_sort us | sampler_full us | sort us | noise us | sampler / argmax "
        "| sampler / torch_reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = measure(r, vocab, device, args.iters)
        cells = ("argmax", "torch_reference", "sampler", "no_sort", "fused", "fused_no_sort")
        cells += ("sampler_full", "sort", "noise")
        lines.append(
            f"| {r} | {' | '.join(us(t[c]) for c in cells)} "
            f"| {t['sampler'] / t['argmax']:.1f}x | {t['sampler'] / t['torch_reference']:.2f}x |"
        )
    lines += [
        "",
        "Engine sampling step (`StepSampler.sample`, wall clock incl. the host read), mixed batch",
        "",
        "| rows | eager us | graph us | eager / graph | eager + logprobs us "
        "| graph + logprobs us | eager / graph + logprobs | capture |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = engine_step(r, vocab, device, args.iters)
        lines.append(
            f"| {r} | {t['eager']:.1f} | {t['graph']:.1f} | {t['eager'] / t['graph']:.2f}x "
            f"| {t['eager_logprobs']:.1f} | {t['graph_logprobs']:.1f} "
            f"| {t['eager_logprobs'] / t['graph_logprobs']:.2f}x "
            f"| {t['graphs']} graphs in {t['capture_s']:.2f} s |"
        )
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
