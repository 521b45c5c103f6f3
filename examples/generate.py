"""Greedy generation with the tiny Llama through graphplan's runtime.

    plan compile plans/tiny-llama.yaml -o table.json
    python examples/generate.py --table table.json --check
    python examples/generate.py --table table.json --check --continuous --chunk 32

Loads the compiled table (the runtime never reads YAML), builds the model, captures the table's
graphs, then prefills and decodes a set of prompts through ``GraphRunner``. ``--continuous`` lets
the prompts arrive over time (one every ``--arrive-every`` steps) and batches them continuously
(``batching.ContinuousBatcher``): each step decodes the running requests and prefills prompts in
chunks within a ``--chunk`` token budget, all in one batch, so mixed steps replay piecewise graphs
and pure decode steps FULL ones. ``--check`` also runs the same generation (the same scheduling)
eagerly and fails unless the tokens are identical. On a machine without CUDA the runner uses its
CPU stand-in for graphs.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching import ContinuousBatcher  # noqa: E402
from tiny_llama import (TinyLlama, TinyLlamaConfig, make_batch, reference_generate,  # noqa: E402
                        static_inputs)

from graphplan.runtime import GraphRunner, GraphplanError, load_table  # noqa: E402


def make_prompts(n: int, seed: int, vocab: int, max_len: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def build(table_path, device: str, layers: int = 2, hidden: int = 256, seed: int = 0,
          progress: bool = True):
    """The tiny model sized to the table's limits, and a runner with its graphs captured."""
    table = load_table(table_path)
    cfg = TinyLlamaConfig.sized(hidden=hidden, layers=layers, vocab_size=2048, max_model_len=128,
                                num_cache_rows=table.max_num_seqs)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = TinyLlama(cfg, seed=seed, device=device, dtype=dtype)
    runner = GraphRunner(model, table, static_inputs(model), device=device, progress=progress)
    runner.capture()
    return model, runner


def generate(model, runner, prompts, new_tokens: int) -> list[list[int]]:
    return reference_generate(model, prompts, new_tokens, step=lambda batch, r, q: runner.step(
        batch, num_reqs=r, max_query_len=q))


def continuous_generate(model, prompts, new_tokens: int, *, chunk: int, max_num_seqs: int,
                        arrive_every: int = 2, step=None) -> list[list[int]]:
    """Greedy generation with continuous batching: prompt i arrives at step i * arrive_every.
    ``step(batch, num_reqs, max_query_len) -> logits`` as in reference_generate (default: eager)."""
    step = step or (lambda batch, num_reqs, max_query_len: model(**batch))
    batcher = ContinuousBatcher(max_num_seqs=max_num_seqs, token_budget=chunk,
                                max_model_len=model.cfg.max_model_len,
                                num_cache_rows=model.cfg.num_cache_rows)
    arrived, t = 0, 0
    with torch.no_grad():
        while arrived < len(prompts) or batcher.has_work():
            while arrived < len(prompts) and arrived * arrive_every <= t:
                batcher.add(arrived, prompts[arrived], new_tokens)
                arrived += 1
            batch = batcher.schedule()
            if batch is not None:
                batcher.commit(batch, step(make_batch(model, batch.reqs), batch.num_reqs,
                                           batch.max_query_len))
            t += 1
    return [batcher.finished[i] for i in range(len(prompts))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Greedy generation through graphplan's runtime.")
    p.add_argument("--table", required=True, help="compiled table.json (plan compile ... -o)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with eager generation")
    p.add_argument("--continuous", action="store_true",
                   help="prompts arrive over time; chunked prefill and decodes share each step")
    p.add_argument("--chunk", type=int, default=32, help="--continuous: tokens per step")
    p.add_argument("--arrive-every", type=int, default=2,
                   help="--continuous: steps between arriving prompts")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="longest prompt (default 24, with --continuous 64)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    max_len = a.max_prompt_len or (64 if a.continuous else 24)

    def run(step=None):
        if not a.continuous:
            return reference_generate(model, prompts, a.new_tokens, step=step)
        return continuous_generate(model, prompts, a.new_tokens, chunk=a.chunk, step=step,
                                   max_num_seqs=runner.table.max_num_seqs,
                                   arrive_every=a.arrive_every)
    try:
        model, runner = build(a.table, a.device, seed=a.seed)
        prompts = make_prompts(a.prompts, a.seed, model.cfg.vocab_size, max_len)
        if not a.continuous and a.prompts > runner.table.max_num_seqs:
            raise GraphplanError(f"--prompts {a.prompts} exceeds the plan's max_num_seqs "
                                 f"{runner.table.max_num_seqs}")
        if a.continuous and not 0 < a.chunk <= runner.table.max_tokens:
            raise GraphplanError(f"--chunk {a.chunk} must be in 1..{runner.table.max_tokens} "
                                 "(the plan's max_num_batched_tokens)")
        if max_len + a.new_tokens > model.cfg.max_model_len:
            raise GraphplanError(f"prompts of up to {max_len} tokens + --new-tokens "
                                 f"{a.new_tokens} exceed the model's max_model_len "
                                 f"{model.cfg.max_model_len}")
        out = run(lambda batch, r, q: runner.step(batch, num_reqs=r, max_query_len=q))
    except GraphplanError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 1
    for prompt, new in zip(prompts, out):
        print(f"{len(prompt):3d} prompt tokens -> {new}")
    s = runner.stats()
    print(f"graph replays {s['replays']} {s['replays_by_mode']}, eager steps {s['eager_steps']}")
    if a.check:
        model.kv_cache.zero_()
        eager = run()
        if eager != out:
            print("generate: MISMATCH between graphs and eager", file=sys.stderr)
            return 1
        print("check: tokens with graphs == tokens eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
