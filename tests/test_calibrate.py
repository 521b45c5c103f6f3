"""runtime/calibrate.py: the runtime calibrates the compiler's memory model and saves a profile
that `plan compile --memory --profile` reads. CPU stand-in here (no device memory: zero bytes);
the GPU test checks the calibrated estimate against a real capture of the whole table."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.compiler.cli import main as plan_main
from graphplan.compiler.tools import memory
from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, static_inputs
from graphplan.runtime import GraphRunner
from graphplan.runtime.calibrate import calibrate_memory, calibration_sizes, model_fingerprint

CFG = TinyLlamaConfig(
    vocab_size=256,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=96,
    max_model_len=32,
    num_cache_rows=32,
)
ROOT = Path(__file__).resolve().parents[1]
PLAN = {
    "version": 1,
    "name": "cal",
    "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 64},
    "cudagraph": {
        "mode": "FULL",
        "attention_support": "ALWAYS",
        "capture_sizes": [1, 2, 4, 8, 16, 32, 64],
    },
}


def test_calibration_sizes_spread_over_the_full_graphs_and_include_the_largest():
    assert calibration_sizes(compile_plan(PLAN)) == [1, 4, 16, 64]
    with pytest.raises(ValueError, match="at least two FULL graph sizes"):
        calibration_sizes(
            compile_plan({**PLAN, "cudagraph": {**PLAN["cudagraph"], "capture_sizes": [8]}})
        )


def test_model_fingerprint_is_the_architecture_not_the_weights():
    a, b = TinyLlama(CFG, seed=0), TinyLlama(CFG, seed=1)
    c = TinyLlama(TinyLlamaConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "hidden": 128}))
    assert model_fingerprint(a) == model_fingerprint(b) != model_fingerprint(c)


def test_calibrated_profile_is_saved_and_read_by_plan_compile_memory(tmp_path, capsys):
    model = TinyLlama(CFG, seed=0)
    path = tmp_path / "profile.json"
    profile = calibrate_memory(model, compile_plan(PLAN), static_inputs(model), path=path)
    # captured largest first into one pool, then the smallest alone
    assert [n for n, _ in profile["samples"]] == [64, 16, 4, 1, 1]
    assert profile["device"] == "cpu" and profile["model_fingerprint"] == model_fingerprint(model)
    assert profile["per_graph_capture_seconds"] > 0  # the shared-pool capture's time per graph
    assert memory.load_profile(path)["samples"] == profile["samples"]
    table = tmp_path / "t.json"
    compile_plan(PLAN).save(table)
    assert plan_main(["compile", str(table), "--memory", "--profile", str(path)]) == 0
    assert model_fingerprint(model)[:19] in capsys.readouterr().out


@pytest.mark.gpu
def test_calibrated_estimate_is_close_to_a_real_capture_on_the_gpu():
    cfg = TinyLlamaConfig(
        vocab_size=4096,
        hidden=1024,
        layers=4,
        heads=16,
        kv_heads=4,
        intermediate=2816,
        max_model_len=256,
        num_cache_rows=256,
    )
    plan = {
        "version": 1,
        "name": "cal-gpu",
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
        "cudagraph": {
            "mode": "FULL_DECODE_ONLY",
            "attention_support": "UNIFORM_BATCH",
            "capture_sizes": {"preset": "vllm"},
        },
    }
    model = TinyLlama(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    table = compile_plan(plan)
    profile = calibrate_memory(model, table, static_inputs(model))
    assert profile["samples"][0][1] > 0 and profile["device"] == torch.cuda.get_device_name()
    est = memory.estimate(table, profile)["total_bytes"]
    runner = GraphRunner(model, table, static_inputs(model), progress=False)
    actual = runner.capture()["bytes"]
    assert actual > 0 and 0.5 <= est / actual <= 2.0, (est, actual)


def _example(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """examples/calibrate_memory.py run as a user runs it."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "calibrate_memory.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("device", [None, "cpu"])
def test_calibrate_memory_example_refuses_without_a_gpu_and_writes_nothing(tmp_path, device):
    table = tmp_path / "t.json"
    compile_plan(PLAN).save(table)
    out = tmp_path / "profile.json"
    args = ["--table", str(table), "-o", str(out)] + (["--device", device] if device else [])
    run = _example(*args, env={"CUDA_VISIBLE_DEVICES": ""})  # no GPU, also on a GPU machine
    assert run.returncode == 1, run.stderr
    assert "needs a CUDA GPU" in run.stderr and "Nothing written" in run.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


@pytest.mark.gpu
def test_calibrate_memory_example_writes_a_profile_and_checks_it_on_the_gpu(tmp_path):
    table = tmp_path / "t.json"
    compile_plan(PLAN).save(table)
    out = tmp_path / "profile.json"
    run = _example("--table", str(table), "-o", str(out))
    code, text = run.returncode, run.stdout
    assert memory.load_profile(out)["device"] == torch.cuda.get_device_name()
    assert "MiB per graph" in text and "estimate / actual = " in text
    assert code in (0, 2)  # 2: written, but the estimate missed the bar (the output says so)
    bad, out2 = tmp_path / "bad.json", tmp_path / "p2.json"
    bad.write_text("{")
    run = _example("--table", str(bad), "-o", str(out2))
    assert run.returncode == 1 and "not a graphplan table" in run.stderr and not out2.exists()
