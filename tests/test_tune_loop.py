"""examples/tune_loop.py end to end on the CPU (issue 28 part 4): graphplan-serve on the tiny Llama
with the server's default sizes (plans/tiny-llama.yaml, vLLM's list) serves a chat-like workload;
its own /metrics, read by `plan workload`, tuned by `plan optimize` within the default's graph
count and hot-swapped through /admin/reload, cut padded tokens per step on the same workload by
at least 30 %, with no more graphs."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_loop_cuts_padded_tokens_per_step_by_30_percent_without_more_graphs(tmp_path):
    out = tmp_path / "loop.json"
    cmd = [sys.executable, str(ROOT / "examples" / "tune_loop.py"), "--json", str(out)]
    cmd += ["--out", str(tmp_path / "loop.md"), "--min-drop", "0"]  # the test checks the drop
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    before, after = got["before"], got["after"]
    assert got["reload"]["previous"] != got["reload"]["fingerprint"]  # the tuned plan serves
    assert abs(after["steps"] - before["steps"]) <= 0.05 * before["steps"]  # the same workload
    assert got["drop"] >= 0.30, r.stdout
    assert after["padding_per_step"] <= 0.7 * before["padding_per_step"]
    assert after["graphs"] <= before["graphs"] == got["default_graphs"] == 30
    assert got["tuned_graphs"] <= got["default_graphs"]
    assert "padded tokens per step" in (tmp_path / "loop.md").read_text()


def test_the_loop_exits_1_when_the_drop_is_below_min_drop(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples" / "tune_loop.py"), "--requests", "30"]
    r = subprocess.run([*cmd, "--min-drop", "0.99"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "FAIL: drop below 99%" in r.stderr, r.stdout + r.stderr
