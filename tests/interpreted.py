"""Run a test module of Triton kernels under Triton's interpreter, in a fresh process: Triton
chooses its interpreter when a kernel (and triton.language's own helpers) is decorated, so
TRITON_INTERPRET=1 must be set before triton is first imported. Used by the suite's tests of
tests/fused_interpreted.py, tests/triton_interpreted.py and tests/sampling_interpreted.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(module: str, timeout: float = 300) -> str:
    """``python -m pytest -q tests/<module>`` with TRITON_INTERPRET=1; its output when every test
    passed (none skipped). Skips without triton, or past ``timeout`` seconds (the interpreter is
    slow on a small machine); fails with the run's output otherwise."""
    pytest.importorskip("triton")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{module}"],
            cwd=ROOT,
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"the Triton interpreter took over {timeout} s on this machine")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last, last
    return run.stdout
