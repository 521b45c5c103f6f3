"""The engine's host work per steady decode step (issue 25's host overhead, phase by phase): the
synchronous step the server's engine thread runs (server/core/pipeline.py), timed call by call on the
host over a small model, so that the device's own time is small and what is left is the host's:
``schedule`` (the batcher), ``make_batch`` (the model's inputs on the device), ``runner.step``
(copy into the static buffers, replay: its launch), ``sampler.launch`` (stage, the argmax or the
sampler's graph: its launch), ``read`` (wait for the tokens, the host read) and ``commit`` (the
batcher's bookkeeping). CPU or GPU; on the CPU the runner's and sampler's launch are their work.

    python bench/host_step.py --out bench/results/host_step.md          # CUDA when present
    python bench/host_step.py --device cpu --batch 64 --steps 100
    python bench/host_step.py --device cpu --batch 256 --context 1024 --non-blocking

Every one of ``--batch`` requests decodes every step (a prompt of ``--context`` tokens first, 16 by
default, prefilled in untimed steps; then up to ``--steps`` more tokens each, greedy or
``--sampled``); the tiny Llama shape of bench/llama_shapes.py with random weights, plan
``plans/hf-mixed.yaml`` with ``--batch`` seats. A long context makes the block tables wide (1024
tokens: 64 blocks a request at block size 16), which is what ``make_batch`` moves every step.
``--non-blocking``: ``make_batch(non_blocking=True)``, the async-scheduling engine's call.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from graphplan.models.hf import PagedCausalLM
from graphplan.runtime import GraphRunner
from graphplan.server.core.batching import ContinuousBatcher
from graphplan.server.core.model import load_table
from graphplan.server.core.step_sampler import StepSampler
from graphplan.server.requests import GREEDY, QueueSink, Request
from graphplan.server.sampling_params import SamplingParams

import load_test
from machine import machine
from timing import publish

PHASES = ("schedule", "make_batch", "runner.step", "sampler.launch", "read", "commit")
ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="decode steps timed (after 10 more)")
    p.add_argument("--sampled", action="store_true", help="temperature 0.8, top_p 0.95, seeded")
    p.add_argument("--context", type=int, default=16, help="prompt tokens of each request")
    p.add_argument(
        "--non-blocking", action="store_true", help="make_batch(non_blocking=True), as async does"
    )
    p.add_argument("--out", help="also write the markdown result here")
    a = p.parse_args(argv)
    if a.batch < 1 or a.steps < 1 or a.context < 1:
        p.error("--batch, --steps and --context must be at least 1")
    return a


def measure(a) -> dict[str, float]:
    """Mean seconds per step of each phase."""
    device = torch.device(a.device)
    # requests that finish their prefill early decode in the mixed steps while others prefill
    # (a budget of 16 tokens a seat: about context / 16 such steps): tokens for those too
    max_tokens = a.steps + 12 + 2 * -(-a.context // 16)
    max_len = a.context + max_tokens + 16
    with tempfile.TemporaryDirectory() as tmp:
        path = load_test.write_model(Path(tmp) / "m", "tiny", max_len)
        model = PagedCausalLM.load(
            str(path),
            max_num_seqs=a.batch,
            max_model_len=max_len,
            device=device,
            random_weights=True,
            kv_cache_tokens=a.batch * max_len,
        )
    sets = {"scheduler": {"max_num_seqs": a.batch, "max_num_batched_tokens": 16 * a.batch}}
    table = load_table(str(ROOT / "plans" / "hf-mixed.yaml"), sets)
    runner = GraphRunner(model, table, model.static_inputs(), device=device, progress=False)
    runner.capture()
    sampler = StepSampler(a.batch, model.cfg.vocab_size, device)
    batcher = ContinuousBatcher(
        max_num_seqs=a.batch,
        token_budget=16 * a.batch,
        max_model_len=max_len,
        num_cache_rows=a.batch,
        kv_pool=model.kv_pool,
    )
    for i in range(a.batch):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=i) if a.sampled else GREEDY
        prompt = [(i * 7 + k) % 400 + 3 for k in range(a.context)]
        r = Request(prompt, max_tokens, QueueSink(), params)
        batcher.add(r, r.prompt, r.max_tokens)
    totals = dict.fromkeys(PHASES, 0.0)
    nb = {"non_blocking": True} if a.non_blocking else {}
    decodes = 0
    while decodes < a.steps + 10:  # the prefill steps, 10 warm-up decodes, then the timed ones
        t = [time.perf_counter()]
        batch = batcher.schedule()
        assert batch is not None
        t.append(time.perf_counter())
        inputs = model.make_batch(batch.reqs, **nb)
        t.append(time.perf_counter())
        logits = runner.step(inputs, num_reqs=batch.num_reqs, max_query_len=batch.max_query_len)
        t.append(time.perf_counter())
        pending = sampler.launch(batch, logits)
        t.append(time.perf_counter())
        sampled = pending.read()
        t.append(time.perf_counter())
        batcher.commit(batch, sampled=[s.token for s in sampled])
        t.append(time.perf_counter())
        if batch.num_reqs < a.batch or batch.max_query_len > 1:  # still prefilling
            continue
        decodes += 1
        if decodes > 10:
            for name, t0, t1 in zip(PHASES, t, t[1:]):
                totals[name] += t1 - t0
    return {name: v / a.steps for name, v in totals.items()}


def main(argv=None) -> int:
    a = parse_args(argv)
    t = measure(a)
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else machine()
    host = sum(v for k, v in t.items() if k != "read")
    lines = [
        f"## host_step: {a.batch} decodes a step, {'sampled' if a.sampled else 'greedy'}, "
        f"{a.device}, {a.context}-token prompts" + (", non_blocking" if a.non_blocking else ""),
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {where}, torch "
        f"{torch.__version__}, python {platform.python_version()}; "
        f"`python bench/host_step.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "| " + " | ".join(f"{p} us" for p in PHASES) + " | host (all but read) us |",
        "|" + "---|" * (len(PHASES) + 1),
        "| " + " | ".join(f"{t[p] * 1e6:.0f}" for p in PHASES) + f" | {host * 1e6:.0f} |",
    ]
    publish("\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
