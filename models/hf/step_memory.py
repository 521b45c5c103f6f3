"""What one step needs beside the KV pool, measured before the pool is sized.

A default-sized pool takes most of the memory left after the weights; what a step allocates on top
(every layer's activations at the largest token count, the logits of every row in float32, the
sampler's ``[rows, vocab]`` temporaries) must stay free, or the first long mixed step runs out of
memory under load. vLLM measures this with a profiling run before it sizes its cache; so does this:
one eager forward at the scheduler's token budget over a pool just big enough for it, then the
logits of as many rows as a step samples, their peak taken from the allocator. The sampler is not part of the model; its bound is
``SAMPLER_BYTES_PER_LOGIT`` per row and vocabulary entry (server/core/sampling.py: float32 logits,
scaled copy, noise, softmax and cumsum, the sort's values and int64 indices)."""

from __future__ import annotations

import torch

DEFAULT_STEP_TOKENS = 8192
"""The step measured when the caller names no token budget (vLLM's default chunked-prefill budget;
a longer prompt runs in chunks of the scheduler's budget, which the server passes)."""

SAMPLER_BYTES_PER_LOGIT = 72
"""Upper bound of the sampler's memory per row and vocabulary entry: the server's sampler graphs'
pool, which holds the graphs' temporaries (measured 63.5 bytes per logit on an H100 at 64 rows x
32000, 2026-11-25: the caching allocator's segments around a dozen float32/int64 ``[rows, vocab]``
tensors; about 33 alive at once on the CPU), plus their static float32 logits rows (4), with room
(server/core/step_sampler.py; tests/test_sampling_gpu.py checks the bound on the GPU)."""


def step_reserve_bytes(
    model, install_pool, shape, max_num_seqs: int, max_model_len: int, tokens: int
) -> int:
    """The peak bytes of one eager forward of ``tokens`` tokens (as requests of at most
    ``max_model_len``, over at most ``max_num_seqs`` seats) and of its logits at ``max_num_seqs``
    rows (``model.logits``), plus the sampler's bound at
    ``max_num_seqs`` rows. Runs on ``model`` (a PagedCausalLM being built) over a temporary pool
    that ``install_pool(shape, blocks, max_num_seqs, max_model_len)`` sets up; leaves none."""
    tokens = max(1, min(tokens, max_num_seqs * max_model_len))
    chunks = [max_model_len] * (tokens // max_model_len)
    if tokens % max_model_len:
        chunks.append(tokens % max_model_len)
    blocks = sum(shape.blocks_per_seq(n) for n in chunks)
    device = model.hf.device
    install_pool(shape, blocks, max_num_seqs, max_model_len)
    try:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.no_grad():
            out = model(**model.make_batch([(i, 0, [0] * n) for i, n in enumerate(chunks)]))
            # the rows a step samples: with logits="rows" the LM head runs here, on them alone
            model.logits(out, torch.arange(min(max_num_seqs, tokens), device=device))
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    finally:
        del model.cache, model.tables
        torch.cuda.empty_cache()
    return peak + SAMPLER_BYTES_PER_LOGIT * max_num_seqs * model.hf.config.vocab_size
