"""Speculative decoding on the 8B Llama shape (issue 36), in one process on one GPU:

1. The verification step: a uniform decode step of q = 4 tokens a request (the plan's
   ``decode_query_len: 4``, its FULL graph of 4 tokens) beside the q = 1 step at batch 1 and
   context 1024, the LM head on every verified row included. Bar: <= 1.25x.
2. End to end at batch 1 (one request at a time through the server's Engine, greedy): output
   tok/s without speculation, with a draft model equal to the target (the same checkpoint and seed:
   acceptance 1, the mechanism's ceiling; k = 3, bar >= 2.5x) and with n-gram prompt lookup on a
   copy workload (k = 3, bar >= 1.8x). The weights are random, so "copy" is what a random model
   does: the prompt is a document repeated, and the acceptance the run measured is printed beside
   the speed; it, not the prompt, decides the n-gram figure. A draft as costly as the target
   cannot beat plain decoding (k draft passes + one verification for at most k + 1 tokens), so the
   run adds the mechanism's ceiling: an oracle proposer that drafts the tokens the run without
   speculation produced (free drafts, acceptance 1 up to bf16 near-ties).

   With ``--copy-model`` the n-gram row runs on weights that copy (bench/copy_model.py: an
   induction circuit hand-set into the same 8B shape, so a step costs what it costs with random
   weights) beside a no-speculation row on the same weights; the other rows are unchanged.

    python bench/spec_bench.py --out bench/results/spec_bench.md          # 8B, H100
    python bench/spec_bench.py --copy-model --out bench/results/spec_bench_copy.md
    python bench/spec_bench.py --device cpu --shape tiny --context 48 --new-tokens 16 --requests 2
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from graphplan.compiler import compile_plan
from graphplan.models.hf import PagedCausalLM

from copy_model import drawn_as_copy_model
from load_test import write_model
from real_scale import SHAPES, build_model, captured_runner
from serve_bench import write_tokenizer
from timing import publish, sync, time_per_call

STEP_BAR, DRAFT_BAR, NGRAM_BAR = 1.25, 2.5, 1.8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=256, help="output tokens a request")
    p.add_argument("--requests", type=int, default=3, help="requests a variant, one at a time")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    p.add_argument(
        "--copy-model",
        action="store_true",
        help="the n-gram row (and a no-speculation row beside it) on weights that copy their "
        "context (bench/copy_model.py) instead of random ones",
    )
    a = p.parse_args(argv)
    a.kv_fraction, a.block_size = 0.3, 16
    if a.device == "cpu" and a.shape != "tiny":
        p.error("the CPU runs only --shape tiny")
    return a


def plan(q: int, max_len: int, seats: int = 4) -> dict:
    """FULL graphs for uniform decode batches of q tokens a request (q-multiples up to ``seats``
    requests); prompts run eager."""
    return {
        "version": 1,
        "name": f"spec-bench-q{q}",
        "scheduler": {
            "max_num_seqs": seats,
            "max_num_batched_tokens": max(2048, max_len),
            "decode_query_len": q,
        },
        "cudagraph": {
            "mode": "FULL_DECODE_ONLY",
            "attention_support": "ALWAYS",
            "capture_sizes": [q * n for n in range(1, seats + 1)],
        },
    }


def step_times(a, device) -> dict[int, float]:
    """Seconds of the q = 1 and q = 1 + k verification steps at batch 1, context ``a.context``
    (the step and the LM head on its q rows), one model, one runner a plan."""
    hf, _ = build_model(a, device)
    max_len = a.context + 64
    model = PagedCausalLM(
        hf, max_num_seqs=4, max_model_len=max_len, block_size=a.block_size, logits="rows",
        **({"kv_memory_fraction": a.kv_fraction} if device.type == "cuda"
           else {"kv_cache_tokens": 4 * max_len}),
    )  # fmt: skip
    out = {}
    for q in (1, 1 + a.k):
        runner, _ = captured_runner(model, compile_plan(plan(q, max_len)), device)
        batch = model.make_batch([(0, a.context, [7] * q)])
        rows = torch.arange(q, device=device)

        def step(batch=batch, q=q, rows=rows, runner=runner, model=model):
            return model.logits(runner.step(batch, 1, q), rows)

        with torch.no_grad():
            out[q] = time_per_call(step, device, a.iters, a.repeats)
        stats = runner.stats()
        assert stats["replays_by_mode"].get("FULL", 0) > 0, f"q={q}: no FULL replay: {stats}"
        runner.release()
    del model, hf
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return out


class Waiter:
    """One request's events (the engine's sink): its tokens and when it ended."""

    def __init__(self):
        self.tokens: list[int] = []
        self.done = threading.Event()

    def put_many(self, items) -> None:
        for _, kind, value in items:
            if kind == "token":
                self.tokens.append(value if isinstance(value, int) else getattr(value, "token", 0))
            elif kind in ("done", "error"):
                self.done.set()


def prompts(a, vocab: int) -> list[list[int]]:
    """A document of ``context / 4`` tokens, four times over (the copy workload), per request."""
    out = []
    for i in range(a.requests):
        g = torch.Generator().manual_seed(i)
        doc = torch.randint(1, vocab, (max(1, a.context // 4),), generator=g).tolist()
        out.append((doc * 4)[: a.context])
    return out


def follows(prompts: list[list[int]], outputs: list[list[int]], context: int) -> str:
    """Output tokens equal to the repeated document's next token ("a/b"; ``prompts``' layout)."""
    n = max(1, context // 4)
    hits = sum(
        t == p[(len(p) + i) % n] for p, out in zip(prompts, outputs) for i, t in enumerate(out)
    )
    return f"{hits}/{sum(map(len, outputs))}"


class Oracle:
    """Drafts the tokens the run without speculation produced for the same prompt (the bench's
    ceiling: drafts cost nothing and are right wherever the target agrees with itself)."""

    def __init__(self, k: int, prompts: list[list[int]], outputs: list[list[int]]):
        self.k = k
        self.known = [(tuple(p), o) for p, o in zip(prompts, outputs)]

    def propose(self, seqs, ks, rows=()) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks):
            for prompt, output in self.known:
                if tuple(seq[: len(prompt)]) == prompt:
                    done = len(seq) - len(prompt)
                    out.append(list(output[done : done + k]))
                    break
            else:
                out.append([])
        return out


def end_to_end(
    a, device, model_dir: Path, speculative: str | None, oracle=None, copy: bool = False
) -> dict:
    """Batch 1: each prompt alone through an Engine (greedy), wall time from submit to done.
    ``copy``: the engine's weights are the copy circuit's (bench/copy_model.py), not random."""
    from graphplan.server.core.engine import Engine
    from graphplan.server.core.hf_model import HFSpec
    from graphplan.server.core.spec.config import parse_speculative_config
    from graphplan.server.requests import GREEDY, Request

    max_len = a.context + a.new_tokens + 64
    q = 1 if speculative is None else 1 + a.k
    spec = HFSpec(
        model=str(model_dir), max_model_len=max_len, random_weights=True, seed=0,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        kv_cache_tokens=4 * max_len,
    )  # fmt: skip
    config = None if speculative is None else parse_speculative_config(speculative)
    engine = Engine(
        compile_plan(plan(q, max_len)), "spec-bench", spec=spec, device=str(device),
        progress=False, speculative=config,
    )  # fmt: skip
    from graphplan.server.core.spec import proposer

    build = proposer.build_proposer
    if oracle is not None:  # the engine builds its proposer on its thread, through this name
        proposer.build_proposer = lambda config, engine=None: oracle
    weights = drawn_as_copy_model(max_len) if copy else contextlib.nullcontext()
    try:
        with weights:  # the engine loads its model on its thread too
            engine.start()
            assert engine.wait_ready(900), engine.error
    finally:
        proposer.build_proposer = build
    tokens, wall, outputs = 0, 0.0, []
    try:
        for i, p in enumerate(prompts(a, SHAPES[a.shape]["vocab_size"])):
            w = Waiter()
            r = Request(p, a.new_tokens, w, GREEDY, tag=i)
            sync(device)
            t0 = time.perf_counter()
            engine.enqueue([r])
            assert w.done.wait(600), "a request did not finish"
            wall += time.perf_counter() - t0
            tokens += len(w.tokens)
            outputs.append(w.tokens)
        m = engine.metrics
        drafts = m.value("graphplan_spec_decode_num_draft_tokens_total") if config else 0
        accepted = m.value("graphplan_spec_decode_num_accepted_tokens_total") if config else 0
    finally:
        engine.stop(5)
        release(engine)
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "outputs": outputs,
        "acceptance": accepted / drafts if drafts else None,
    }


def release(engine) -> None:
    """Give a stopped engine's device memory back before the next variant starts (five 8B
    engines do not fit one 80 GB card side by side)."""
    engine.model = engine.runner = engine.sampler = engine.proposer = engine.spec_step = (
        engine.batcher
    ) = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    steps = step_times(a, device)
    ratio = steps[1 + a.k] / steps[1]
    k = a.k
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        model_dir = write_model(
            Path(tmp) / f"llama-{a.shape}", a.shape, a.context + a.new_tokens + 64
        )
        write_tokenizer(model_dir, SHAPES[a.shape]["vocab_size"])
        base = end_to_end(a, device, model_dir, None)
        draft = end_to_end(
            a, device, model_dir,
            f'{{"method": "draft_model", "model": "{model_dir}", "num_speculative_tokens": {k}}}',
        )  # fmt: skip
        ps = prompts(a, SHAPES[a.shape]["vocab_size"])
        oracle = end_to_end(
            a, device, model_dir,
            f'{{"method": "ngram", "num_speculative_tokens": {k}}}',
            oracle=Oracle(k, ps, base["outputs"]),
        )  # fmt: skip
        ngram = end_to_end(
            a, device, model_dir,
            f'{{"method": "ngram", "num_speculative_tokens": {k}, "prompt_lookup_max": 4, '
            '"prompt_lookup_min": 2}', copy=a.copy_model,
        )  # fmt: skip
        copied = end_to_end(a, device, model_dir, None, copy=True) if a.copy_model else None
    if copied is None:
        same = base["outputs"] == draft["outputs"] == ngram["outputs"] == oracle["outputs"]
        ngram_base, same_line = base, f"- greedy tokens identical in all four variants: **{same}**"
    else:
        same_random = base["outputs"] == draft["outputs"] == oracle["outputs"]
        same_copy = copied["outputs"] == ngram["outputs"]
        same, ngram_base = same_random and same_copy, copied
        same_line = (
            f"- greedy tokens identical in the three random-weight variants: **{same_random}**; "
            f"n-gram and no speculation on the copy weights: **{same_copy}**\n"
            f"- the copy weights' output (no speculation) follows the document: "
            f"**{follows(ps, copied['outputs'], a.context)}** tokens"
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    acc = lambda r: "-" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
    verdict = lambda x, bar: f"{'met' if x >= bar else 'MISSED'}: >= {bar}x"
    lines = [
        f"# spec_bench ({a.shape}), {name}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"command: `python bench/spec_bench.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        f"torch {torch.__version__}; batch 1, context {a.context}, k = {k}, greedy; "
        f"{a.requests} requests of {a.new_tokens} new tokens a variant, one at a time",
        "",
        "| step (batch 1, FULL graph, LM head on its rows) | ms |",
        "|---|---:|",
        f"| q = 1 | {steps[1] * 1e3:.3f} |",
        f"| q = {1 + k} | {steps[1 + k] * 1e3:.3f} |",
        "",
        f"- q = {1 + k} step / q = 1 step: **{ratio:.3f}x** "
        f"({'met' if ratio <= STEP_BAR else 'MISSED'}: <= {STEP_BAR}x)",
        "",
        "| end to end, batch 1 | output tok/s | acceptance | speed-up |",
        "|---|---:|---:|---:|",
        f"| no speculation | {base['tok_s']:.1f} | - | 1.00x |",
        f"| draft = target, k = {k} | {draft['tok_s']:.1f} | {acc(draft)} | "
        f"**{draft['tok_s'] / base['tok_s']:.2f}x** ({verdict(draft['tok_s'] / base['tok_s'], DRAFT_BAR)}) |",
        f"| oracle drafts (the ceiling), k = {k} | {oracle['tok_s']:.1f} | {acc(oracle)} | "
        f"**{oracle['tok_s'] / base['tok_s']:.2f}x** |",
        *([f"| no speculation, copy weights | {copied['tok_s']:.1f} | - | "
           f"{copied['tok_s'] / base['tok_s']:.2f}x |"] if copied else []),
        f"| n-gram (copy workload{', copy weights' if copied else ''}), k = {k} | "
        f"{ngram['tok_s']:.1f} | {acc(ngram)} | **{ngram['tok_s'] / ngram_base['tok_s']:.2f}x** "
        f"({verdict(ngram['tok_s'] / ngram_base['tok_s'], NGRAM_BAR)}) |",
        "",
        same_line,
    ]  # fmt: skip
    publish("\n".join(lines) + "\n", a.out)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
