"""bench/serve_bench.py's workloads: the requests (prompt token ids, output lengths), when each is
sent, and the body each sends.

- ``loguniform``: bench/offline_throughput.py's own draw (``workload``: prompts and outputs
  log-uniform in [min_len, max_len], fixed seed), so a served run and an offline run share it
  request for request.
- ``sharegpt``: synthetic ShareGPT-like lengths (no download: the data set is not read). Prompt
  and output token counts are log-normal, prompts median 130 tokens (sigma 1.05), outputs median
  135 (sigma 0.9), each clipped to [min_len, max_len] (vLLM's ShareGPT sampling keeps prompts of
  4-1024 tokens and prompt + output <= 2048). At 1,000 requests, seed 0, 4-1024 tokens the draw
  holds 215,692 prompt and 195,472 output tokens, near the 215,196 and 197,520 of the 1,000
  ShareGPT requests (Llama-3 tokenizer) that vLLM PR #8125 reports; the shape (heavy tail toward
  short turns) is ShareGPT's, the individual lengths are not.
- ``chat``: chat traffic for prefix caching (issue 38). One system prompt of ``--system-len``
  tokens (default 2,000) starts every request; requests are turns of conversations of 1 to
  ``--turns`` turns, each turn re-sending the earlier ones: system, user 1, assistant 1, ..., user
  k (user turns log-normal, median ``--turn-len`` tokens, default 60, at most 4x that; the
  assistant turns re-sent are drawn too, 5/3 as long: the history a client holds). Outputs are ShareGPT-like, clipped to [min_len, max_len].
  Requests are ordered turn by turn (every conversation's first turn, then the second turns...),
  so a turn is sent after the one before it in its conversation.
"""

from __future__ import annotations

import argparse
import math
import random

from offline_throughput import workload as offline_workload

WORKLOADS = ("loguniform", "sharegpt", "chat")
CHAT_SIGMA = 0.8  # log-normal sigma of a turn's length (its median: --turn-len, 5/3 of it)
SHAREGPT_PROMPT = (130, 1.05)  # log-normal (median tokens, sigma)
SHAREGPT_OUTPUT = (135, 0.9)


def lognormal(n: int, median: float, sigma: float, lo: int, hi: int, rng) -> list[int]:
    """``n`` log-normal integers of this median and sigma, clipped to [lo, hi]."""
    draw = (rng.lognormvariate(math.log(median), sigma) for _ in range(n))
    return [min(hi, max(lo, round(x))) for x in draw]


def sharegpt(a, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(a.seed)
    plens = lognormal(a.requests, *SHAREGPT_PROMPT, a.min_len, a.max_len, rng)
    outputs = lognormal(a.requests, *SHAREGPT_OUTPUT, a.min_len, a.max_len, rng)
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in plens]
    return prompts, outputs


def chat(a, vocab: int) -> tuple[list[list[int]], list[int]]:
    """``a.requests`` turns of conversations sharing one system prompt (see the docstring)."""
    rng = random.Random(a.seed)
    system = [rng.randrange(1, vocab) for _ in range(a.system_len)]
    convs: list[list[list[int]]] = []  # each conversation's prompts, turn by turn
    left = a.requests
    while left:
        turns = min(left, rng.randint(1, a.turns))
        history, prompts = list(system), []
        for t in range(turns):
            if t:  # the previous answer, as the client re-sends it
                history += _words(rng, vocab, a.turn_len * 5 / 3)
            history += _words(rng, vocab, a.turn_len)
            prompts.append(list(history))
        convs.append(prompts)
        left -= turns
    ordered = [c[t] for t in range(a.turns) for c in convs if t < len(c)]
    outputs = lognormal(len(ordered), *SHAREGPT_OUTPUT, a.min_len, a.max_len, rng)
    return ordered, outputs


def chat_max_len(a) -> int:
    """The longest prompt the chat workload can draw, and its longest output."""
    return a.system_len + a.turns * 4 * round(a.turn_len * 8 / 3) + a.max_len


def _words(rng, vocab: int, median: float) -> list[int]:
    (n,) = lognormal(1, median, CHAT_SIGMA, 1, 4 * round(median), rng)
    return [rng.randrange(1, vocab) for _ in range(n)]


def requests(a, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The workload's (prompts as token ids, output lengths), one of each per request."""
    if a.workload == "chat":
        return chat(a, vocab)
    if a.workload == "loguniform":
        ns = argparse.Namespace(
            seed=a.seed, requests=a.requests, min_len=a.min_len, max_len=a.max_len
        )
        return offline_workload(ns, vocab)
    return sharegpt(a, vocab)


def send_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all at once for ``rate`` inf,
    else a Poisson process of ``rate`` requests/s (exponential gaps, as vLLM's and SGLang's
    serving benchmarks draw them)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def body(model: str, prompt: list[int], max_tokens: int) -> dict:
    """A streamed greedy completion of exactly ``max_tokens`` tokens (EOS ignored)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
