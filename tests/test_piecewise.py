"""Piecewise graphs on the CPU stand-in: capture, replay around eager attention on mixed batches,
FULL_AND_PIECEWISE routing, release on a failed capture, metrics. How the run-time split reaches the
plan's ops, and the models it refuses, are tests/test_breakable.py's.

The stand-in re-runs each recorded piece on the buffers it was captured on, so a tensor that crossed
a split at a non-static address would give wrong logits here, as it would with CUDA graphs.
"""

import subprocess
import sys

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models.tiny_llama import (
    TinyLlama,
    TinyLlamaConfig,
    greedy,
    greedy_mismatch,
    make_batch,
    reference_generate,
    static_inputs,
)
from graphplan.runtime import CaptureError, GraphRunner, render_prometheus
from graphplan.server.core.generation import continuous_generate, continuous_greedy, make_prompts

CFG = TinyLlamaConfig(
    vocab_size=128,
    hidden=64,
    layers=3,
    heads=4,
    kv_heads=2,
    intermediate=96,
    max_model_len=48,
    num_cache_rows=8,
)
SIZES = (1, 2, 4, 8, 16, 32)


def plan(mode="PIECEWISE", sizes=SIZES, splitting_ops=("attention",)):
    return {
        "version": 1,
        "name": "pw",
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
        "cudagraph": {
            "mode": mode,
            "attention_support": "ALWAYS",
            "splitting_ops": list(splitting_ops),
            "capture_sizes": list(sizes),
        },
    }


def runner_for(p, model=None, **kw):
    model = model or TinyLlama(CFG, seed=0)
    return model, GraphRunner(model, compile_plan(p), static_inputs(model), progress=False, **kw)


def toks(n, seed):
    return torch.randint(
        1, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def mixed_steps():
    """(reqs, num_tokens) per step: chunked prefills next to decodes, at captured and in-between
    token counts; each step continues the cache rows of the steps before it."""
    return [
        [(0, 0, toks(5, 1)), (1, 0, toks(2, 2))],  # 7 tokens
        [(0, 5, toks(1, 3)), (1, 2, toks(7, 4)), (2, 0, toks(8, 5))],  # 16
        [(0, 6, toks(1, 6)), (1, 9, toks(1, 7)), (2, 8, toks(11, 8))],  # 13
        [(0, 7, toks(1, 9)), (2, 19, toks(2, 10)), (3, 0, toks(1, 11))],  # 4
        [(r, 8 + r, toks(1, 20 + r)) for r in range(3)] + [(3, 1, toks(17, 12))],
    ]  # 20


def test_piecewise_replay_matches_eager_on_mixed_batches_at_captured_and_in_between_sizes():
    model, runner = runner_for(plan())
    summary = runner.capture()
    eager = TinyLlama(CFG, seed=0)
    for reqs in mixed_steps():
        batch = make_batch(model, reqs)
        mql = max(len(t) for _, _, t in reqs)
        out = runner.step(batch, num_reqs=len(reqs), max_query_len=mql)
        ref = eager(**{k: v.clone() for k, v in batch.items()})
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    real = slice(0, CFG.num_cache_rows)  # padding tokens wrote only the dummy row
    torch.testing.assert_close(
        model.kv_cache[:, :, real], eager.kv_cache[:, :, real], atol=1e-5, rtol=1e-5
    )  # K/V of unit scale: summation order only
    s = runner.stats()
    assert s["replays_by_mode"] == {"PIECEWISE": 5} and s["eager_steps"] == {}
    assert s["padding_tokens"] == (8 - 7) + 0 + (16 - 13) + 0 + (32 - 20)
    assert summary["piecewise"]["pieces"] == CFG.layers + 1
    assert summary["piecewise"]["split_ops"] == CFG.layers
    assert summary["piecewise"]["piece_graphs"] == len(SIZES) * (CFG.layers + 1)


def test_full_and_piecewise_routes_decodes_to_full_and_mixed_steps_to_piecewise():
    model, runner = runner_for(plan("FULL_AND_PIECEWISE"))
    runner.capture()
    prompts = [toks(5, 1), toks(1, 2), toks(9, 3), toks(3, 4)]
    with_graphs, got = greedy(model, prompts, 6, step=lambda b, r, q: runner.step(b, r, q))
    assert with_graphs == reference_generate(TinyLlama(CFG, seed=0), prompts, 6)
    _, want = greedy(TinyLlama(CFG, seed=0), prompts, 6, forced=with_graphs)
    assert greedy_mismatch(with_graphs, got, want, torch.float32) is None
    s = runner.stats()
    assert s["replays_by_mode"] == {"PIECEWISE": 1, "FULL": 5}  # the prefill, then 5 decodes
    assert s["eager_steps"] == {}


def test_continuous_batching_with_graphs_generates_what_eager_does():
    model, runner = runner_for(plan("FULL_AND_PIECEWISE"))
    runner.capture()
    prompts = [toks(n, 30 + n) for n in (13, 4, 21, 1, 9, 17)]
    kw = dict(chunk=16, max_num_seqs=4, arrive_every=2)
    with_graphs, got = continuous_greedy(
        model, prompts, 5, **kw, step=lambda b, r, q: runner.step(b, r, q)
    )
    assert with_graphs == continuous_generate(TinyLlama(CFG, seed=0), prompts, 5, **kw)
    _, want = continuous_greedy(TinyLlama(CFG, seed=0), prompts, 5, **kw, forced=with_graphs)
    assert greedy_mismatch(with_graphs, got, want, torch.float32) is None
    s = runner.stats()
    assert s["replays_by_mode"]["PIECEWISE"] >= 5 and s["replays_by_mode"]["FULL"] > 0
    assert len({g["num_tokens"] for g in s["graphs"] if g["mode"] == "PIECEWISE"}) >= 3
    assert s["eager_steps"] == {}


def test_capturing_full_only_leaves_mixed_steps_eager_with_their_reason():
    model, runner = runner_for(plan("FULL_AND_PIECEWISE"))
    runner.capture(modes=("FULL",))
    reqs = mixed_steps()[0]
    runner.step(make_batch(model, reqs), num_reqs=2, max_query_len=5)
    assert runner.stats()["eager_steps"] == {"piecewise_not_captured": 1}


def test_stats_and_prometheus_show_piecewise_replays_by_mode():
    model, runner = runner_for(plan("FULL_AND_PIECEWISE"))
    runner.capture()
    runner.step(make_batch(model, mixed_steps()[0]), num_reqs=2, max_query_len=5)  # 7 -> 8 tokens
    runner.step(make_batch(model, [(5, 0, [3])]), num_reqs=1, max_query_len=1)  # uniform decode
    s = runner.stats()
    assert s["replays_by_mode"] == {"PIECEWISE": 1, "FULL": 1}
    pw = next(g for g in s["graphs"] if g["mode"] == "PIECEWISE")
    assert (pw["num_tokens"], pw["replays"], pw["padding_tokens"]) == (8, 1, 1)
    text = render_prometheus(s)
    assert (
        f'graphplan_graph_replays_total{{graph="{pw["id"]}",mode="PIECEWISE",num_tokens="8"}} 1'
        in text
    )
    assert 'mode="FULL",num_tokens="1"} 1' in text


# ---- a capture that fails ----

FAIL_AT = {"tokens": None}


def fail_at(x):
    """A call inside the last piece that fails at one size (as if capture ran out of memory)."""
    if x.shape[0] == FAIL_AT["tokens"]:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return x


class FailsAt(TinyLlama):
    def forward(self, input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        return fail_at(
            super().forward(input_ids, positions, slot_mapping, seq_lens, query_start_loc)
        )


def test_failed_piecewise_capture_names_the_graph_releases_everything_and_runner_stays_usable():
    model = FailsAt(CFG, seed=0)
    _, runner = runner_for(plan("FULL_AND_PIECEWISE"), model)
    FAIL_AT["tokens"] = 4
    try:
        with pytest.raises(
            CaptureError,
            match=r"graph #3 \(4 tokens, None requests.*Released every "
            r"graph.*lower cudagraph.capture_sizes",
        ):
            runner.capture()
    finally:
        FAIL_AT["tokens"] = None
    assert runner.captured_graph_ids() == [] and not runner.captured
    reqs = mixed_steps()[0]
    out = runner.step(make_batch(model, reqs), num_reqs=2, max_query_len=5)  # eager, still works
    assert out.shape == (7, CFG.vocab_size)
    assert runner.stats()["eager_steps"] == {"piecewise_not_captured": 1}
    runner.capture()  # a retry after fixing the cause captures everything
    assert len(runner.captured_graph_ids()) == len(runner.table.graphs)


def test_generate_example_continuous_check_passes_with_piecewise_and_full_replays(tmp_path, root):
    table = tmp_path / "table.json"
    compile_plan(
        str(root / "plans" / "tiny-llama.yaml"), {"cudagraph.capture_sizes": [1, 2, 4, 8, 16]}
    ).save(table)
    argv = [
        "--table",
        str(table),
        "--device",
        "cpu",
        "--prompts",
        "4",
        "--new-tokens",
        "3",
        "--continuous",
        "--chunk",
        "16",
        "--max-prompt-len",
        "20",
        "--check",
    ]
    run = subprocess.run(
        [sys.executable, str(root / "examples" / "generate.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (
        "check: 12 logits rows with graphs == eager within atol=rtol=0.001 (float32" in run.stdout
    )
    assert "eager picks the same token at 12 of 12" in run.stdout and "'PIECEWISE'" in run.stdout


def test_the_eager_check_fails_when_a_request_reads_another_requests_kv_cache(root):
    """What ``examples/generate.py --check`` does, with the graphs' run mixed up: one decode's K/V
    goes to another request's cache row, and greedy_mismatch reports it."""
    table = compile_plan(
        str(root / "plans" / "tiny-llama.yaml"), {"cudagraph.capture_sizes": [1, 2, 4, 8, 16]}
    )
    cfg = TinyLlamaConfig.sized(
        hidden=256, layers=2, vocab_size=2048, max_model_len=128, num_cache_rows=table.max_num_seqs
    )
    model = TinyLlama(cfg, seed=0, device="cpu", dtype=torch.float32)
    runner = GraphRunner(model, table, static_inputs(model), device="cpu", progress=False)
    runner.capture()
    max_len = model.cfg.max_model_len

    def bad_step(batch, num_reqs, max_query_len):
        if num_reqs > 1 and max_query_len == 1:
            batch = dict(batch, slot_mapping=batch["slot_mapping"].clone())
            first_row = int(batch["slot_mapping"][0]) // max_len
            batch["slot_mapping"][-1] = first_row * max_len + int(batch["positions"][-1])
        return runner.step(batch, num_reqs=num_reqs, max_query_len=max_query_len)

    prompts = make_prompts(4, 0, cfg.vocab_size)
    out, logits = greedy(model, prompts, 4, step=bad_step)
    model.kv_cache.zero_()
    _, eager = greedy(model, prompts, 4, forced=out)
    assert greedy_mismatch(out, logits, eager, torch.float32)


def test_bench_tables_are_compiled_from_their_plans(root):
    from graphplan.compiler import DispatchTable

    for name in ("mixed-piecewise", "mixed-full", "full-and-piecewise-51"):
        compiled = compile_plan(str(root / "bench" / "tables" / f"{name}.yaml"))
        stored = DispatchTable.load(root / "bench" / "tables" / f"{name}.json")
        assert stored.fingerprint == compiled.fingerprint, f"regenerate bench/tables/{name}.json"


def test_the_piecewise_benchmark_runs_the_tiny_llama_on_the_cpu(tmp_path, root, monkeypatch):
    """bench/piecewise_bench.py at smoke size (the bar is enforced on CUDA only): eager,
    piecewise graphs and FULL graphs, one split."""
    monkeypatch.syspath_prepend(str(root / "bench"))
    import piecewise_bench

    out = tmp_path / "pw.txt"
    assert (
        piecewise_bench.main(["--device", "cpu", "--quick", "--iters", "1", "--out", str(out)]) == 0
    )
    text = out.read_text()
    assert "runtime split" in text and " pw ms  FULL ms " in text and "rt/fx" not in text
