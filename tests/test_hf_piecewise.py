"""Piecewise graphs for Hugging Face models on the CPU (stand-in graphs, fp32, small random Llama,
Qwen2, Qwen3): the adapter's registered attention is the ``attention`` split point, so batches with
prefill chunks replay PIECEWISE graphs (split at run time) with attention eager between the pieces,
and every request's logits equal the model's own forward over its whole sequence (no cache). Under
FULL_AND_PIECEWISE uniform decodes replay FULL graphs; the graph used is counted in the stats."""

from pathlib import Path

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models.hf import PagedCausalLM
from graphplan.runtime import GraphRunner

from hf_models import (
    FAMILIES,
    mixed_plan,
    mixed_schedule,
    reference_logits,
    reference_model,
    run_schedule,
    small_config,
    tokens,
)

ROOT = Path(__file__).resolve().parents[1]
LENS, PROMPTS = (21, 13, 9, 17), (14, 8, 1, 12)


def build(family: str, mode: str):
    model = PagedCausalLM.load(
        small_config(family),
        max_num_seqs=4,
        max_model_len=32,
        block_size=4,
        seed=0,
        random_weights=True,
    )
    runner = GraphRunner(
        model, compile_plan(mixed_plan(mode)), model.static_inputs(), progress=False
    )
    runner.capture()
    return model, runner


def replays(runner) -> tuple[int, int, int]:
    s = runner.stats()
    return (
        s["replays_by_mode"].get("PIECEWISE", 0),
        s["replays_by_mode"].get("FULL", 0),
        sum(s["eager_steps"].values()),
    )


@pytest.fixture(scope="module", params=FAMILIES)
def built(request):
    model, runner = build(request.param, "FULL_AND_PIECEWISE")
    return model, runner, reference_model(model)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batches_equal_the_models_own_forward_and_count_their_graphs(built, seed):
    model, runner, ref = built
    steps, uniform = mixed_schedule(LENS, prompts=PROMPTS, budget=12, seed=seed)
    assert sum(uniform) >= 3 and len(steps) - sum(uniform) >= 3  # both kinds, many shapes
    assert len({sum(n for _, n in s) for s in steps}) >= 5
    seqs = [tokens(n, seed=50 + 7 * seed + i) for i, n in enumerate(LENS)]
    for seat in range(len(seqs)):
        model.release(seat)
    before = replays(runner)
    got = run_schedule(model, runner, seqs, steps)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(
            got[i],
            reference_logits(ref, seq),
            atol=1e-4,
            rtol=1e-4,
            msg=lambda m: f"request {i}: {m}",
        )
    after = replays(runner)
    assert tuple(a - b for a, b in zip(after, before)) == (
        len(steps) - sum(uniform),
        sum(uniform),
        0,
    )
    pw = runner.stats()["capture"]["piecewise"]
    assert pw["mechanism"] == "runtime" and pw["split_ops"] == 2  # one attention per layer


def test_piecewise_only_runs_every_step_in_piece_graphs():
    model, runner = build("qwen3", "PIECEWISE")
    ref = reference_model(model)
    steps, _ = mixed_schedule(LENS, prompts=PROMPTS, budget=16, seed=3)
    seqs = [tokens(n, seed=90 + i) for i, n in enumerate(LENS)]
    got = run_schedule(model, runner, seqs, steps)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], reference_logits(ref, seq), atol=1e-4, rtol=1e-4)
    assert replays(runner) == (len(steps), 0, 0)


def test_a_padded_piecewise_step_writes_only_real_and_padding_slots(built):
    model, runner, _ = built
    for seat in range(4):
        model.release(seat)
    kv_before = model.cache.kv.clone()
    before = replays(runner)
    # 5 + 1 + 3 = 9 tokens from 3 requests: the PIECEWISE graph of 16 (7 padded tokens)
    runner.step(model.make_batch([(0, 0, [1, 2, 3, 4, 5]), (1, 0, [6]), (2, 0, [7, 8, 9])]), 3, 5)
    assert replays(runner)[0] == before[0] + 1
    changed = (model.cache.kv != kv_before).flatten(3).any(-1)
    touched = {int(b) for b in changed.nonzero()[:, 2]}
    real = {b for seat in range(3) for b in model.tables.row(seat) if b != model.cache.pad_block}
    assert touched <= real | {model.cache.pad_block} and real <= touched


def test_the_shipped_hf_mixed_plan_splits_mixed_steps_at_attention():
    import yaml

    table = compile_plan(yaml.safe_load((ROOT / "plans" / "hf-mixed.yaml").read_text()))
    assert list(table.settings.splitting_ops) == ["attention"]
    assert table.route(40, 3, 32, 0).mode.name == "PIECEWISE"
    assert table.route(2048, 10, 2000, 0).mode.name == "PIECEWISE"
    assert table.route(8, 8, 1, 0).mode.name == "FULL"


def test_the_piecewise_benchmark_runs_the_hf_llama_on_the_cpu(tmp_path):
    """bench/piecewise_bench.py --model hf at smoke size (the bar is enforced on CUDA only)."""
    import piecewise_bench

    out = tmp_path / "pw.txt"
    assert (
        piecewise_bench.main(
            [
                "--model",
                "hf",
                "--device",
                "cpu",
                "--quick",
                "--tokens",
                "8",
                "16",
                "--iters",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = out.read_text()
    assert "LlamaForCausalLM" in text and "runtime split" in text and "# bar:" in text


def test_the_server_benchmark_serves_both_hf_plans_on_the_cpu(tmp_path):
    """bench/hf_server_bench.py --smoke: the server (a subprocess) with plans/hf-decode.yaml and
    plans/hf-mixed.yaml; under the latter chunked prefills replay PIECEWISE graphs, none eager."""
    import hf_server_bench

    out = tmp_path / "srv.md"
    assert (
        hf_server_bench.main(
            ["--device", "cpu", "--smoke", "--clients", "2", "--requests", "2", "--out", str(out)]
        )
        == 0
    )
    rows = {
        ln.split()[0]: ln.split() for ln in out.read_text().splitlines() if ln.startswith("FULL_")
    }
    *_, full, piecewise, eager, lost = rows["FULL_AND_PIECEWISE"]
    assert int(piecewise) > 0 and int(eager) == 0 and int(lost) == 0
    assert int(rows["FULL_DECODE_ONLY"][-3]) == 0 and int(rows["FULL_DECODE_ONLY"][-2]) > 0
    assert "identical outputs 4/4" in out.read_text()
