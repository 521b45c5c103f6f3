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
eagerly, feeding back the tokens the graphs chose (teacher forcing), and fails unless every logit
the graphs produced matches eager within ``tiny_llama.LOGIT_TOL`` of the model dtype (float32
1e-3, bf16 5e-2, atol = rtol) and the tokens are the same. The example model's outputs depend on
each request's context (tests/test_tiny_llama.py measures it), so a KV-cache or attention mix-up
between requests fails the check. On a machine without CUDA the runner uses its CPU stand-in for
graphs.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from graphplan.models.tiny_llama import (
    LOGIT_TOL,
    TinyLlama,
    TinyLlamaConfig,
    greedy,
    greedy_mismatch,
    reference_generate,
    static_inputs,
)
from graphplan.runtime import GraphplanError, GraphRunner, load_table
from graphplan.server.core.generation import continuous_greedy, make_prompts


def build(
    table_path,
    device: str,
    layers: int = 2,
    hidden: int = 256,
    seed: int = 0,
    progress: bool = True,
):
    """The tiny model sized to the table's limits, and a runner with its graphs captured."""
    table = load_table(table_path)
    cfg = TinyLlamaConfig.sized(
        hidden=hidden,
        layers=layers,
        vocab_size=2048,
        max_model_len=128,
        num_cache_rows=table.max_num_seqs,
    )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = TinyLlama(cfg, seed=seed, device=device, dtype=dtype)
    runner = GraphRunner(model, table, static_inputs(model), device=device, progress=progress)
    runner.capture()
    return model, runner


def generate(model, runner, prompts, new_tokens: int) -> list[list[int]]:
    return reference_generate(
        model,
        prompts,
        new_tokens,
        step=lambda batch, r, q: runner.step(batch, num_reqs=r, max_query_len=q),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Greedy generation through graphplan's runtime.")
    p.add_argument("--table", required=True, help="compiled table.json (plan compile ... -o)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with eager generation")
    p.add_argument(
        "--continuous",
        action="store_true",
        help="prompts arrive over time; chunked prefill and decodes share each step",
    )
    p.add_argument("--chunk", type=int, default=32, help="--continuous: tokens per step")
    p.add_argument(
        "--arrive-every", type=int, default=2, help="--continuous: steps between arriving prompts"
    )
    p.add_argument(
        "--max-prompt-len",
        type=int,
        default=None,
        help="longest prompt (default 24, with --continuous 64)",
    )
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    max_len = a.max_prompt_len or (64 if a.continuous else 24)

    def run(step=None, forced=None):
        if not a.continuous:
            return greedy(model, prompts, a.new_tokens, step=step, forced=forced)
        return continuous_greedy(
            model,
            prompts,
            a.new_tokens,
            chunk=a.chunk,
            step=step,
            max_num_seqs=runner.table.max_num_seqs,
            arrive_every=a.arrive_every,
            forced=forced,
        )

    try:
        model, runner = build(a.table, a.device, seed=a.seed)
        prompts = make_prompts(a.prompts, a.seed, model.cfg.vocab_size, max_len)
        if not a.continuous and a.prompts > runner.table.max_num_seqs:
            raise GraphplanError(
                f"--prompts {a.prompts} exceeds the plan's max_num_seqs {runner.table.max_num_seqs}"
            )
        if a.continuous and not 0 < a.chunk <= runner.table.max_tokens:
            raise GraphplanError(
                f"--chunk {a.chunk} must be in 1..{runner.table.max_tokens} "
                "(the plan's max_num_batched_tokens)"
            )
        if max_len + a.new_tokens > model.cfg.max_model_len:
            raise GraphplanError(
                f"prompts of up to {max_len} tokens + --new-tokens "
                f"{a.new_tokens} exceed the model's max_model_len "
                f"{model.cfg.max_model_len}"
            )
        out, logits = run(lambda batch, r, q: runner.step(batch, num_reqs=r, max_query_len=q))
    except GraphplanError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 1
    for prompt, new in zip(prompts, out):
        print(f"{len(prompt):3d} prompt tokens -> {new}")
    s = runner.stats()
    print(f"graph replays {s['replays']} {s['replays_by_mode']}, eager steps {s['eager_steps']}")
    if a.check:
        model.kv_cache.zero_()
        _, eager = run(forced=out)  # eager over the graphs' tokens: logits comparable step by step
        dtype = model.kv_cache.dtype
        bad = greedy_mismatch(out, logits, eager, dtype)
        if bad:
            print(f"generate: MISMATCH between graphs and eager, {bad}", file=sys.stderr)
            return 1
        same = sum(int(w.argmax()) == t for toks, lg in zip(out, eager) for t, w in zip(toks, lg))
        total = sum(len(toks) for toks in out)
        diff = max((g - w).abs().max().item() for g, w in zip(logits, eager))
        print(
            f"check: {total} logits rows with graphs == eager within atol=rtol="
            f"{LOGIT_TOL[dtype]:g} ({str(dtype).removeprefix('torch.')}; max |diff| "
            f"{diff:.3g}); eager picks the same token at {same} of {total}"
        )
        if same != total:  # a flipped argmax inside the tolerance is a near-tie, not a bug
            print("check: the differing picks are near-ties within the tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
