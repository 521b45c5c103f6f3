"""bench/spec_bench.py's smoke run on the CPU: the q = 1 and q = 4 steps replay FULL graphs, and
the three end-to-end variants give the same greedy tokens, a draft equal to the target having every
draft accepted."""

from __future__ import annotations

import re

from spec_bench import main


def test_the_smoke_run_times_both_steps_and_the_variants_agree(tmp_path):
    out = tmp_path / "spec_bench.md"
    argv = ["--device", "cpu", "--shape", "tiny", "--context", "48", "--new-tokens", "16"]
    assert (
        main([*argv, "--requests", "2", "--iters", "2", "--repeats", "1", "--out", str(out)]) == 0
    )
    text = out.read_text()
    steps = dict(re.findall(r"^\| q = (\d) \| ([\d.]+) \|$", text, re.M))
    assert set(steps) == {"1", "4"} and all(float(v) > 0 for v in steps.values())
    assert re.search(r"\| draft = target, k = 3 \| [\d.]+ \| 100\.0% \|", text)
    assert re.search(r"\| oracle drafts \(the ceiling\), k = 3 \| [\d.]+ \| 100\.0% \|", text)
    assert "- greedy tokens identical in all four variants: **True**" in text
