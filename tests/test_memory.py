"""compiler/tools/memory.py: the graph-memory model, calibrated profiles, and `plan compile --memory`."""

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphplan.compiler import compile_plan
from graphplan.compiler.cli import main
from graphplan.compiler.tools.memory import (
    DEFAULT_PROFILE,
    FORMAT,
    MIB,
    ProfileError,
    estimate,
    fit_profile,
    load_profile,
    save_profile,
)

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"


def profile(per_graph=1 * MIB, per_token=10 * 1024, **kw) -> dict:
    return {
        "format": FORMAT,
        "version": 1,
        "model_fingerprint": "m",
        "device": "d",
        "per_graph_bytes": per_graph,
        "per_token_bytes": per_token,
        "samples": [],
        **kw,
    }


def test_fit_recovers_the_exact_line_from_noiseless_samples():
    samples = [[n, 3e6 + 5000.0 * n] for n in (8, 64, 256, 512)]
    p = fit_profile(samples, "llama", "H100")
    assert p["per_graph_bytes"] == pytest.approx(3e6)
    assert p["per_token_bytes"] == pytest.approx(5000.0)
    assert p["samples"] == samples and p["format"] == FORMAT and p["device"] == "H100"


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4096), st.floats(0, 1e10)), min_size=2, max_size=12).filter(
        lambda s: len({n for n, _ in s}) >= 2
    )
)
def test_fit_is_least_squares_when_both_coefficients_are_nonnegative(samples):
    p = fit_profile([list(s) for s in samples], "m", "d")
    n, b = np.array(samples, dtype=float).T
    slope, intercept = np.polyfit(n, b, 1)
    assert p["per_graph_bytes"] >= 0 and p["per_token_bytes"] >= 0
    if slope >= 0 and intercept >= 0:
        assert p["per_token_bytes"] == pytest.approx(slope, rel=1e-6, abs=1e-3)
        assert p["per_graph_bytes"] == pytest.approx(intercept, rel=1e-6, abs=1e-1)


def test_fit_clamps_a_negative_intercept_and_refits_the_slope_through_zero():
    p = fit_profile([[100, 1000.0], [200, 3000.0]], "m", "d")  # line: -1000 + 20 n
    assert p["per_graph_bytes"] == 0.0
    assert p["per_token_bytes"] == pytest.approx((100 * 1000 + 200 * 3000) / (100**2 + 200**2))


def test_fit_needs_two_distinct_token_counts():
    with pytest.raises(ProfileError, match="distinct num_tokens"):
        fit_profile([[64, 1e6], [64, 2e6]], "m", "d")
    with pytest.raises(ProfileError, match=r"samples\[0\]\[0\].*integer"):
        fit_profile([[0.5, 1e6], [64, 2e6]], "m", "d")


def test_save_then_load_round_trips_and_leaves_no_temp_files(tmp_path):
    p = fit_profile([[8, 1e6], [512, 9e6]], "fp", "H100")
    path = tmp_path / "profile.json"
    save_profile(path, p)
    assert load_profile(path) == {**p, "source": str(path)}
    assert [f.name for f in tmp_path.iterdir()] == ["profile.json"]


@pytest.mark.parametrize(
    "content, match",
    [
        (b"{not json", "not JSON"),
        (json.dumps({"format": "x"}).encode(), "not a graphplan memory profile"),
        (json.dumps(profile(version=2)).encode(), "version 2"),
        (json.dumps(profile(per_token=-1)).encode(), "per_token_bytes: expected a finite number"),
        (json.dumps(profile(per_graph=True)).encode(), "per_graph_bytes"),
        (json.dumps(profile(device=3)).encode(), "device: expected a string"),
        (json.dumps(profile(samples=[[1]])).encode(), r"samples\[0\]"),
        (
            b'{"format": "graphplan.memory_profile", "version": 1, "model_fingerprint": "m", '
            b'"device": "d", "per_graph_bytes": NaN, "per_token_bytes": 1}',
            "per_graph_bytes",
        ),
    ],
)
def test_a_bad_profile_file_is_a_profile_error_naming_the_file_and_field(tmp_path, content, match):
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match=match) as e:
        load_profile(path)
    assert str(path) in str(e.value)


def test_a_missing_profile_or_a_directory_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "nope.json")
    with pytest.raises(ProfileError, match="is a directory"):
        load_profile(tmp_path)


@pytest.mark.parametrize("plan", sorted(p.name for p in PLANS.glob("*.yaml")))
def test_estimate_is_per_graph_cost_times_graphs_plus_the_largest_graphs_activations(plan):
    table = compile_plan(PLANS / plan)
    prof = profile()
    est = estimate(table, prof)
    n = len(table.graphs)
    largest = max((g.key.num_tokens for g in table.graphs), default=0)
    expected = (1 * MIB * n + 10 * 1024 * largest) if n else 0
    assert est["total_bytes"] == expected
    assert est["num_graphs"] == n and est["largest_graph_tokens"] == largest
    assert sum(m["graphs"] for m in est["per_mode"].values()) == n
    for mode, m in est["per_mode"].items():
        mine = [g for g in table.graphs if g.mode.name == mode]
        assert m["bytes"] == 1 * MIB * len(mine) + 10 * 1024 * max(g.key.num_tokens for g in mine)
    assert not est["profile"]["default"]
    assert "largest graph only" in est["explanation"] or n == 0


def test_a_pool_base_cost_is_counted_once_and_old_profiles_read_as_zero():
    table = compile_plan(PLANS / "llama3-8b-h100.yaml")
    plain, based = estimate(table, profile()), estimate(table, profile(base_bytes=20 * MIB))
    assert based["total_bytes"] - plain["total_bytes"] == 20 * MIB
    assert based["explanation"].startswith("20.0 MiB once per pool, + 86 graphs")
    assert plain["profile"]["base_bytes"] == 0.0  # a profile written before base_bytes existed


def test_without_a_profile_the_default_is_used_and_said():
    est = estimate(compile_plan(PLANS / "llama3-8b-h100.yaml"))
    assert est["profile"]["default"] and "default profile" in est["explanation"]
    assert est["total_bytes"] == round(
        86 * DEFAULT_PROFILE["per_graph_bytes"] + 512 * DEFAULT_PROFILE["per_token_bytes"]
    )


def test_memory_module_imports_only_the_standard_library_numpy_and_compiler_basics():
    for path in (
        ROOT / "compiler" / "tools" / "memory.py",
        ROOT / "compiler" / "profile_format.py",
    ):
        tree = ast.parse(path.read_text())
        mods = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
        }
        mods |= {
            n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level == 0
        }
        assert mods <= set(sys.stdlib_module_names) | {"numpy", "__future__"}, path
    code = (
        "import sys, graphplan.compiler.tools.memory; print(sorted(m for m in sys.modules if "
        "m.split('.')[0] in ('yaml', 'jinja2', 'jsonschema', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr


def test_compile_memory_prints_the_estimate(capsys):
    assert main(["compile", str(PLANS / "llama3-8b-h100.yaml"), "--memory"]) == 0
    out = capsys.readouterr().out
    assert "graph memory (estimate): 400.0 MiB for 86 graphs" in out
    assert "default profile" in out


def test_compile_memory_json_carries_the_estimate_with_a_calibrated_profile(tmp_path, capsys):
    path = tmp_path / "p.json"
    save_profile(path, profile())
    assert (
        main(
            [
                "compile",
                str(PLANS / "llama3-8b-h100.yaml"),
                "--profile",
                str(path),
                "--format",
                "json",
            ]
        )
        == 0
    )
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert mem["total_bytes"] == 86 * MIB + 512 * 10 * 1024
    assert mem["profile"]["source"] == str(path) and not mem["profile"]["default"]


def test_compile_with_a_bad_profile_exits_1_without_traceback_or_table(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text('{"format": "graphplan.memory_profile", "version": 1}')
    out = tmp_path / "table.json"
    assert (
        main(
            [
                "compile",
                str(PLANS / "llama3-8b-h100.yaml"),
                "--memory",
                "--profile",
                str(bad),
                "-o",
                str(out),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(bad) in err and "model_fingerprint" in err
    assert not out.exists()


def test_default_profile_is_itself_a_valid_profile(tmp_path):
    save_profile(tmp_path / "d.json", DEFAULT_PROFILE)
    loaded = load_profile(tmp_path / "d.json")
    assert math.isclose(loaded["per_token_bytes"], DEFAULT_PROFILE["per_token_bytes"])


def test_piecewise_graphs_use_their_own_per_token_cost_and_the_largest_need_wins():
    """A PIECEWISE graph holds one piece's activations at a time: with a measured
    piecewise_per_token_bytes the pool's activations are the larger of the FULL and PIECEWISE
    needs, not the largest graph's tokens at the FULL rate."""
    t = compile_plan(
        {
            "version": 1,
            "name": "m",
            "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 1024},
            "cudagraph": {
                "mode": "FULL_AND_PIECEWISE",
                "attention_support": "ALWAYS",
                "capture_sizes": [8, 64, 128],
            },
        }
    )
    prof = {
        "format": FORMAT,
        "version": 1,
        "model_fingerprint": "m",
        "device": "d",
        "per_graph_bytes": 0.0,
        "per_token_bytes": 1000.0,
        "base_bytes": 5000.0,
        "piecewise_per_token_bytes": 100.0,
        "samples": [],
    }
    est = estimate(t, prof)
    assert est["activation_bytes"] == 64 * 1000  # FULL 64 tokens beats PIECEWISE 128 x 100
    assert est["total_bytes"] == 5000 + 64 * 1000
    del prof["piecewise_per_token_bytes"]  # an older profile: the FULL rate for every graph
    assert estimate(t, prof)["activation_bytes"] == 128 * 1000


def test_the_default_estimate_of_a_tp_plan_is_per_rank_with_the_mlp_split():
    """Each rank captures its own pool: the built-in profile's MLP intermediates (84 of its 112
    KiB per token) are split TP ways, the hidden-size tensors are not; the per-graph cost and
    the capture time per rank are those of TP=1."""
    p = {
        "version": 1,
        "name": "tp",
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
        "cudagraph": {"mode": "FULL", "capture_sizes": [64]},
    }
    one = estimate(compile_plan(p))
    p["parallel"] = {"tensor_parallel_size": 4, "data_parallel_size": 2}
    four = estimate(compile_plan(p))
    assert one["activation_bytes"] == 64 * 112 * 1024
    assert four["activation_bytes"] == 64 * (28 + 84 // 4) * 1024
    assert four["overhead_bytes"] == one["overhead_bytes"]
    assert four["capture_seconds"] == one["capture_seconds"]
    assert (four["world_size"], four["tensor_parallel_size"], one["per_rank"]) == (8, 4, "")
    assert "split 4 ways on each rank" in four["per_rank"]
    calibrated = profile()
    assert estimate(compile_plan(p), calibrated)["activation_bytes"] == 64 * 10 * 1024
