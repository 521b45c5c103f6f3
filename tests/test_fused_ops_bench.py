"""bench/fused_ops_bench.py checks itself on the CPU (--shape tiny): its numbers there mean nothing
(CPU ops stand in for kernels), but every code path the GPU run takes is exercised."""

import pytest

pytest.importorskip("transformers")


def test_the_fused_ops_benchmark_runs_at_tiny_size_on_the_cpu(tmp_path, capsys):
    import fused_ops_bench

    out = tmp_path / "fused.md"
    argv = ["--device", "cpu", "--shape", "tiny", "--quick", "--batches", "1,3"]
    argv += ["--context", "20", "--max-model-len", "48", "--out", str(out)]
    assert fused_ops_bench.main(argv) == 0
    text = out.read_text()
    for batch in (1, 3):
        for variant in ("fused", "unfused", "floor: GEMMs + SDPA", "GEMM floor"):
            assert f"| {batch} | {variant} |" in text
        assert f"Top kernels of a step, batch {batch}, fused" in text
    # every decoder layer calls the attention once, and the profile found each call
    rows = [r for r in text.splitlines() if r.startswith("| 1 | fused |")]
    assert rows and all(not r.split("|")[-3].strip().startswith("0 /") for r in rows)
