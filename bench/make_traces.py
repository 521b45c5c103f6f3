"""Seeded synthetic step traces for ``plan optimize`` and ``plan report --trace``.

    python bench/make_traces.py                      # writes bench/traces/{chat,long_prompt}.jsonl
    python bench/make_traces.py --resample 1000000 -o /tmp/big.jsonl bench/traces/*.jsonl

A trace is one JSON object per scheduler step: ``{"num_tokens", "num_reqs", "max_query_len"}``.
The steps come from a small simulation of a vLLM-style continuous-batching scheduler with chunked
prefill (the scheduler limits of ``plans/llama3-8b-h100.yaml``: 256 requests, 8192 tokens):

- requests arrive as a Poisson process; 20K steps are ~10 minutes of serving, over which the rate
  drifts slowly (a sine of period ``PERIOD`` steps, +-25 %) with random bursts (x1.6 for 200-800
  steps, about one per 4000 steps);
- prompt and output lengths are lognormal, clipped to the model's context;
- each step the scheduler gives every running request that has finished its prompt one decode
  token, then spends what is left of the token budget on prompt chunks, oldest request first,
  admitting waiting requests while fewer than ``max_num_seqs`` run (vLLM V1's policy);
- a request's last prompt chunk samples its first output token; idle steps are not recorded, nor
  the first ``WARMUP`` steps (the ramp up from an empty server).

Profiles (``PROFILES``):
- ``chat``: a chat service, decode-heavy: prompts median 350 tokens (a turn plus some history),
  outputs median 220; ~90 concurrent requests on average, so most steps are pure decode
  (``num_tokens == num_reqs``, ``max_query_len == 1``) and the rest mix decodes with a prompt.
- ``long_prompt``: RAG / summarisation: prompts median 5000 tokens (up to 32K), outputs median 120;
  prefill keeps most steps mixed and many of them at the full 8192-token budget.

The same seed gives the same file, byte for byte.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

import numpy as np

PERIOD = 40000
WARMUP = 3000
PROFILES = {
    # rate: mean arrivals per step; (median, sigma, lo, hi) of lognormal lengths
    "chat": dict(rate=0.30, prompt=(350, 0.9, 8, 8000), output=(220, 0.8, 4, 2000), seed=1),
    "long_prompt": dict(
        rate=0.42, prompt=(5000, 0.7, 600, 32000), output=(120, 0.7, 4, 1000), seed=2
    ),
}


def _lengths(rng, n, median, sigma, lo, hi):
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(int)


def simulate(
    profile: str,
    steps: int,
    seed: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> np.ndarray:
    """[steps, 3] int64 rows (num_tokens, num_reqs, max_query_len) of one simulated run."""
    p = PROFILES[profile]
    rng = np.random.default_rng(p["seed"] if seed is None else seed)
    burst_until, out = -1, []
    waiting: collections.deque = collections.deque()
    running: list[list[int]] = []  # [prompt tokens left, output tokens left]
    t = 0
    while len(out) < steps:
        if t > burst_until and rng.random() < 1 / 4000:
            burst_until = t + int(rng.integers(200, 800))
        rate = (
            p["rate"]
            * (1 + 0.25 * math.sin(2 * math.pi * t / PERIOD))
            * (1.6 if t <= burst_until else 1)
        )
        for _ in range(rng.poisson(rate)):
            waiting.append(
                [int(_lengths(rng, 1, *p["prompt"])[0]), int(_lengths(rng, 1, *p["output"])[0])]
            )
        t += 1
        budget, chunks = max_num_batched_tokens, []
        for req in running:
            take = min(req[0], budget) if req[0] else min(1, budget)
            budget -= take
            chunks.append(take)
        while waiting and len(running) < max_num_seqs and budget > 0:
            req = waiting.popleft()
            take = min(req[0], budget)
            budget -= take
            running.append(req)
            chunks.append(take)
        scheduled = [c for c in chunks if c]
        if scheduled and t > WARMUP:
            out.append((sum(scheduled), len(scheduled), max(scheduled)))
        alive = []
        for req, take in zip(running, chunks):
            if req[0]:
                req[0] -= take
                if req[0] == 0:
                    req[1] -= 1  # the last prompt chunk samples the first output token
            elif take:
                req[1] -= 1
            if req[1] > 0:
                alive.append(req)
        running = alive
    return np.array(out, dtype=np.int64)


def resample(paths, steps: int, seed: int = 0) -> np.ndarray:
    """[steps, 3]: steps drawn with replacement from the given traces (the benchmark's 1M trace)."""
    rows = np.concatenate([read(p) for p in paths])
    return rows[np.random.default_rng(seed).integers(0, len(rows), steps)]


def read(path) -> np.ndarray:
    with open(path, encoding="utf-8") as f:
        return np.array(
            [[d["num_tokens"], d["num_reqs"], d["max_query_len"]] for d in map(json.loads, f) if d],
            dtype=np.int64,
        )


def write(path, rows: np.ndarray) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(
            f'{{"num_tokens": {n}, "num_reqs": {r}, "max_query_len": {m}}}\n'
            for n, r, m in rows.tolist()
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20000, help="steps per simulated trace")
    ap.add_argument("--out", default=str(Path(__file__).parent / "traces"))
    ap.add_argument("--resample", type=int, metavar="N", help="draw N steps from the given traces")
    ap.add_argument("-o", "--output", help="with --resample: where to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("traces", nargs="*")
    a = ap.parse_args(argv)
    if a.resample:
        if not a.output or not a.traces:
            ap.error("--resample needs -o FILE and at least one trace")
        write(a.output, resample(a.traces, a.resample, a.seed))
        print(f"wrote {a.output}: {a.resample} steps")
        return 0
    for name in PROFILES:
        rows = simulate(name, a.steps)
        path = Path(a.out) / f"{name}.jsonl"
        write(path, rows)
        decode = int(((rows[:, 2] == 1) & (rows[:, 0] == rows[:, 1])).sum())
        print(
            f"wrote {path}: {len(rows)} steps, {decode} uniform decode, median "
            f"{int(np.median(rows[:, 0]))} tokens, {int((rows[:, 0] <= 512).sum())} at <= 512 tokens"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
