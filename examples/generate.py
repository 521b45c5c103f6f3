"""Greedy generation with the tiny Llama through graphplan's runtime.

    plan compile plans/tiny-llama.yaml -o table.json
    python examples/generate.py --table table.json --check

Loads the compiled table (the runtime never reads YAML), builds the model, captures the table's
graphs, then prefills and decodes a set of prompts through ``GraphRunner``. ``--check`` also runs
the same generation eagerly and fails unless the tokens are identical. On a machine without CUDA
the runner uses its CPU stand-in for graphs.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_llama import TinyLlama, TinyLlamaConfig, reference_generate, static_inputs  # noqa: E402

from runtime import GraphRunner, GraphplanError, load_table  # noqa: E402


def make_prompts(n: int, seed: int, vocab: int, max_len: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def build(table_path, device: str, layers: int = 2, hidden: int = 256, seed: int = 0,
          progress: bool = True):
    """The tiny model sized to the table's limits, and a runner with its graphs captured."""
    table = load_table(table_path)
    cfg = TinyLlamaConfig(layers=layers, hidden=hidden, heads=max(hidden // 64, 1),
                          kv_heads=max(hidden // 256, 1), intermediate=hidden * 3,
                          vocab_size=2048, max_model_len=128,
                          num_cache_rows=table.max_num_seqs)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = TinyLlama(cfg, seed=seed, device=device, dtype=dtype)
    runner = GraphRunner(model, table, static_inputs(model), device=device, progress=progress)
    runner.capture()
    return model, runner


def generate(model, runner, prompts, new_tokens: int) -> list[list[int]]:
    return reference_generate(model, prompts, new_tokens, step=lambda batch, r, q: runner.step(
        batch, num_reqs=r, max_query_len=q))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Greedy generation through graphplan's runtime.")
    p.add_argument("--table", required=True, help="compiled table.json (plan compile ... -o)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with eager generation")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        model, runner = build(a.table, a.device, seed=a.seed)
        prompts = make_prompts(a.prompts, a.seed, model.cfg.vocab_size)
        if a.prompts > runner.table.max_num_seqs:
            raise GraphplanError(f"--prompts {a.prompts} exceeds the plan's max_num_seqs "
                                 f"{runner.table.max_num_seqs}")
        out = generate(model, runner, prompts, a.new_tokens)
    except GraphplanError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 1
    for prompt, new in zip(prompts, out):
        print(f"{len(prompt):3d} prompt tokens -> {new}")
    s = runner.stats()
    print(f"graph replays {s['replays']} {s['replays_by_mode']}, eager steps {s['eager_steps']}")
    if a.check:
        model.kv_cache.zero_()
        eager = reference_generate(model, prompts, a.new_tokens)
        if eager != out:
            print("generate: MISMATCH between graphs and eager", file=sys.stderr)
            return 1
        print("check: tokens with graphs == tokens eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
