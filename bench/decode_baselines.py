"""The two baselines bench/real_scale.py measures beside graphplan's step, in the same process
(its docstring says what each is): ``floor_step``, every linear layer as ``F.linear`` plus SDPA
decode over contiguous K/V, captured in one CUDA graph; ``hf_compiled_step``, transformers' own
decode step with a static cache under its compile."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from graphplan.models.hf import ATTN_IMPLEMENTATION

from timing import graph_time_per_call, sync

GiB = 1 << 30
REUSE_KV_ABOVE = 256 << 20
"""One layer's K/V above this (five times the H100's L2): two buffers alternate instead of one a
layer, reading the same bytes from HBM and keeping the floor within memory."""


def floor_step(hf, a, device, batch: int, ctx: int) -> float | str:
    """All GEMMs and SDPA decode of one step, captured in one graph (see the module docstring)."""
    c = hf.config
    layers, kvh, qh = c.num_hidden_layers, c.num_key_value_heads, c.num_attention_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // qh
    dtype = next(hf.parameters()).dtype
    weights = [m.weight for m in hf.modules() if isinstance(m, torch.nn.Linear)]
    per_layer = 2 * batch * kvh * ctx * hd * dtype.itemsize
    n_buf = layers if per_layer <= REUSE_KV_ABOVE else 2
    if device.type == "cuda" and n_buf * per_layer > torch.cuda.mem_get_info(device)[0] - 2 * GiB:
        return f"floor K/V ({n_buf * per_layer / GiB:.1f} GiB) does not fit"
    xs = {
        k: torch.randn(batch, k, device=device, dtype=dtype) for k in {w.shape[1] for w in weights}
    }
    kv = [torch.randn(2, batch, kvh, ctx, hd, device=device, dtype=dtype) for _ in range(n_buf)]
    q = torch.randn(batch, qh, 1, hd, device=device, dtype=dtype)

    def body():
        for w in weights:
            F.linear(xs[w.shape[1]], w)
        for i in range(layers):
            k, v = kv[i % n_buf]
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    with torch.no_grad():
        return graph_time_per_call(body, device, a.iters, a.repeats)


def hf_compiled_step(hf, a, device, batch: int, ctx: int) -> float | str:
    """transformers' own decode step: ``generate`` with ``cache_implementation="static"``, which
    compiles the decode forward (its ``compile_config``). The step is the difference between two
    generations of ``ctx``-token prompts, 64 and 16 new tokens each, over the 48 tokens between
    (the prefill and the first token cancel out)."""
    hf.set_attn_implementation("sdpa")
    try:
        prompt = torch.randint(1, hf.config.vocab_size, (batch, ctx), device=device)

        def gen(n: int) -> float:
            sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                hf.generate(
                    prompt,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    cache_implementation="static",
                    pad_token_id=0,
                )
            sync(device)
            return time.perf_counter() - t0

        gen(64)  # compiles
        gen(16)
        short = min(gen(16) for _ in range(max(1, a.repeats // 2)))
        long = min(gen(64) for _ in range(max(1, a.repeats // 2)))
        return (long - short) / 48
    except Exception as e:  # a baseline that fails is reported, not fatal
        return f"failed: {type(e).__name__}: {str(e)[:120]}"
    finally:
        hf.set_attn_implementation(ATTN_IMPLEMENTATION)
