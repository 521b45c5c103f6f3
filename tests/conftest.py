"""Shared fixtures. Tests marked ``gpu`` skip cleanly without CUDA (run them on the device machine)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Test modules that import an optional extra at module level are not collected without it (the
# `test` extra installs both; a runtime-only install still runs the rest).
_NEEDS = {
    "transformers": [
        "test_hf.py",
        "test_hf_gpu.py",
        "test_hf_piecewise.py",
        "test_hf_piecewise_gpu.py",
        "test_openai_server.py",
        "test_openai_echo.py",
        "test_openai_responses.py",
        "test_openai_async.py",
        "test_openai_gpu.py",
        "test_fused_ops.py",
        "test_fused_ops_gpu.py",
        "test_paged_attention.py",
        "test_paged_attention_gpu.py",
    ],
    "openai": [
        "test_openai_server.py",
        "test_openai_echo.py",
        "test_openai_responses.py",
        "test_openai_async.py",
        "test_openai_gpu.py",
    ],
}
collect_ignore = sorted(
    {f for mod, files in _NEEDS.items() if importlib.util.find_spec(mod) is None for f in files}
)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


CPU_FREE_BYTES = 16 << 30
"""The free CPU memory every test sees (models/paged_kv.py's ``free_memory_bytes``), whatever
the host has: a KV cache sized from a share of it, and the check that a model fits, are the
same on every machine. CUDA's stays the device's own (GPU tests measure it)."""
TORCH_THREADS = 2
"""torch's CPU threads in every test, whatever the host's CPU count (CI has 2 cores)."""


@pytest.fixture(autouse=True)
def host_independent(monkeypatch):
    try:
        import torch

        from graphplan.models import paged_kv
        from graphplan.models.hf import config_check
    except ImportError:  # a runtime-less install runs the compiler's tests
        yield
        return
    real = paged_kv.free_memory_bytes

    def free_memory_bytes(device) -> int:
        return CPU_FREE_BYTES if torch.device(device).type == "cpu" else real(device)

    monkeypatch.setattr(paged_kv, "free_memory_bytes", free_memory_bytes)
    monkeypatch.setattr(config_check, "free_memory_bytes", free_memory_bytes)
    threads = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture
def fresh_dynamo():
    """Each CompiledModel adds a cache entry to its model's forward, and dynamo stops compiling a
    function after recompile_limit (8) entries: a test that compiles starts from none."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
