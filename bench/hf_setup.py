"""The model side of the HF benchmarks (bench/hf_bench.py, bench/ondemand_bench.py): the Llama
shapes (full and smoke), the stock transformers model with random weights from a seed, its
baseline copy for transformers' own generation, the prompts, the plan's table, and ``cli``."""

from __future__ import annotations

import copy

import torch

from graphplan.compiler.plan_or_table import load_table_or_plan
from graphplan.models.hf import ATTN_IMPLEMENTATION, load_model

FULL_SIZE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
)
SMOKE_SIZE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def prompts_for(a, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(a.seed + 1)
    spread = min(16, a.prompt_len - 1)
    lens = torch.randint(
        a.prompt_len - spread, a.prompt_len + spread + 1, (a.requests,), generator=gen
    ).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def llama_config(a):
    from transformers import LlamaConfig

    size = SMOKE_SIZE if a.smoke else FULL_SIZE
    cfg = LlamaConfig(
        **size,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def setup(a) -> tuple:
    """(device, the HF config, the stock HF model) for the bench arguments ``a``."""
    device = torch.device(a.device)
    if device.type == "cpu":  # shared small CI machines: spinning intra-op threads swamp the timing
        torch.set_num_threads(1)
    cfg = llama_config(a)
    hf = load_model(
        cfg,
        dtype=getattr(torch, a.dtype),
        device=device,
        seed=a.seed,
        random_weights=True,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    return device, cfg, hf


def table_for(path: str):
    """A compiled table (.json) or a plan compiled now."""
    return load_table_or_plan(path)[0]


def baseline_model(hf, dtype, device):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_config(
        copy.deepcopy(hf.config), attn_implementation="sdpa", dtype=dtype
    )
    m.load_state_dict(hf.state_dict())
    return m.to(device).eval().requires_grad_(False)


def cli(run, parse_args, argv=None) -> int:
    """``run(parse_args(argv))``, torch's intra-op thread count restored after (``setup`` sets
    it to 1 on the CPU)."""
    threads = torch.get_num_threads()
    try:
        return run(parse_args(argv))
    finally:
        torch.set_num_threads(threads)
