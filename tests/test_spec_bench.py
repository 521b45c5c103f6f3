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


def test_copy_model_runs_the_ngram_row_on_weights_that_copy(tmp_path):
    """``--copy-model``: a no-speculation row and the n-gram row on the copy circuit's weights,
    the same tokens in both, and the random-weight rows still identical among themselves."""
    out = tmp_path / "spec_bench.md"
    argv = ["--device", "cpu", "--shape", "tiny", "--context", "48", "--new-tokens", "16"]
    argv += ["--requests", "2", "--iters", "2", "--repeats", "1", "--copy-model"]
    assert main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    assert re.search(r"^\| no speculation, copy weights \| [\d.]+ \| - \| [\d.]+x \|$", text, re.M)
    assert re.search(
        r"^\| n-gram \(copy workload, copy weights\), k = 3 \| [\d.]+ \| [\d.]+% \|", text, re.M
    )
    assert (
        "- greedy tokens identical in the three random-weight variants: **True**; "
        "n-gram and no speculation on the copy weights: **True**" in text
    )
    follows = re.search(r"follows the document: \*\*(\d+)/(\d+)\*\* tokens", text)
    assert follows and follows.group(2) == "32"
