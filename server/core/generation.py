"""Offline greedy generation (the engine loop without HTTP) over any ``graphplan.models.Model``
(its ``make_batch``): continuous batching through the server's batcher, and the lockstep loop of a
data-parallel rank. The examples and tests use them to compare graphs with eager
execution on the same schedule (``tiny_llama.greedy`` and ``reference_generate`` are the
one-batch forms)."""

from __future__ import annotations

import random
from typing import Hashable

import torch

from .batching import ContinuousBatcher


def make_prompts(n: int, seed: int, vocab: int, max_len: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def continuous_generate(
    model,
    prompts,
    new_tokens: int,
    *,
    chunk: int,
    max_num_seqs: int,
    arrive_every: int = 2,
    step=None,
) -> list[list[int]]:
    """Greedy generation with continuous batching: prompt i arrives at step i * arrive_every.
    ``step(batch, num_reqs, max_query_len) -> logits`` as in reference_generate (default: eager)."""
    return continuous_greedy(
        model,
        prompts,
        new_tokens,
        chunk=chunk,
        max_num_seqs=max_num_seqs,
        arrive_every=arrive_every,
        step=step,
    )[0]


def continuous_greedy(
    model,
    prompts,
    new_tokens: int,
    *,
    chunk: int,
    max_num_seqs: int,
    arrive_every: int = 2,
    step=None,
    forced=None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """``continuous_generate`` that also returns the logits each token was chosen from, per
    prompt ([new_tokens, vocab] float32, CPU); ``forced`` feeds those tokens back instead of the
    argmax, as ``tiny_llama.greedy`` does."""
    step = step or (lambda batch, num_reqs, max_query_len: model(**batch))
    batcher = ContinuousBatcher(
        max_num_seqs=max_num_seqs,
        token_budget=chunk,
        max_model_len=model.cfg.max_model_len,
        num_cache_rows=model.cfg.num_cache_rows,
        kv_pool=model.kv_pool,
    )
    arrived, t = 0, 0
    rows: dict[Hashable, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}  # by id
    with torch.no_grad():
        while arrived < len(prompts) or batcher.has_work():
            while arrived < len(prompts) and arrived * arrive_every <= t:
                batcher.add(arrived, prompts[arrived], new_tokens)
                arrived += 1
            batch = batcher.schedule()
            if batch is not None:
                logits = step(model.make_batch(batch.reqs), batch.num_reqs, batch.max_query_len)
                tokens: list[int | None] = []
                for rid, i in zip(batch.request_ids, batch.sample_rows):
                    assert isinstance(rid, int)  # the prompts' indices, added above
                    if i < 0:
                        tokens.append(None)
                        continue
                    rows[rid].append(logits[i].to("cpu", torch.float32, copy=True))  # a view: copy
                    tokens.append(
                        int(rows[rid][-1].argmax())
                        if forced is None
                        else forced[rid][len(rows[rid]) - 1]
                    )
                batcher.commit_tokens(batch, tokens)
            t += 1
    return (
        [batcher.finished[i] for i in range(len(prompts))],
        [torch.stack(rows[i]) for i in range(len(prompts))],
    )


@torch.no_grad()
def dp_generate(model, dp, prompts, new_tokens: int, steps: int) -> list[list[int]]:
    """reference_generate's loop through the DPRunner, then idle steps until ``steps``. Each
    decode step's DP exchange is started (``dp.prepare``) before the host waits for the previous
    step's logits, so it overlaps the GPU."""
    reqs = [(row, 0, list(p)) for row, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in prompts]
    for i in range(steps):
        if i >= new_tokens or not reqs:
            dp.step(None)
            continue
        batch = model.make_batch(reqs)
        last = batch["query_start_loc"][1:].long() - 1
        logits = dp.step(
            batch,
            len(reqs),
            max(len(t) for _, _, t in reqs),
            query_lens=[len(t) for _, _, t in reqs],
        )
        if i + 1 < steps:  # the next step's shape is known now: agree on it while the GPU runs
            n = len(reqs) if i + 1 < new_tokens else 0  # one token per request, or no work
            dp.prepare(n, n or None, 1 if n else None)
        next_ids = logits[last].argmax(dim=-1).tolist()  # waits for the GPU
        for tokens, tok in zip(out, next_ids):
            tokens.append(tok)
        reqs = [(row, start + len(t), [tok]) for (row, start, t), tok in zip(reqs, next_ids)]
    return out
