"""The Triton kernels of models/hf/fused_kernels.py on the CPU, under Triton's interpreter, against
the plain-torch forms in fused_ops.py (transformers' own computations). Not collected with the
suite: Triton picks its interpreter when a kernel is decorated, so this module runs in a process
that had TRITON_INTERPRET=1 before triton was imported; tests/test_fused_ops.py runs it:

    TRITON_INTERPRET=1 python -m pytest -q tests/fused_interpreted.py

Bounds, relative to the largest reference value (at least 1): float32 1e-6 (the kernels sum in
another order and divide by a square root where torch multiplies by its reciprocal); float16 and
bfloat16 three units in the last place (3 x 2^-10, 3 x 2^-7): the kernels round where transformers
rounds (up to two roundings in a row), computing in float32 between, and an intermediate value can
land on the other side of a rounding boundary. Triton 3.6's interpreter rounds float32 to bfloat16
toward zero (the GPU rounds to nearest, as torch does), so the residual sum, exact in float32 and
float16, is within one unit in the last place in bfloat16 here; the GPU tests
(tests/test_fused_ops_gpu.py) hold bfloat16 to torch's rounding.
"""

import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (see the docstring)", allow_module_level=True)
pytest.importorskip("triton")

from graphplan.models.hf import fused_ops  # after the interpreter check above
from graphplan.models.hf.fused_ops import (
    rmsnorm_reference,
    rotary_reference,
    rotary_tables,
    silu_mul_reference,
)

BOUND = {torch.float32: 1e-6, torch.float16: 3 * 2.0**-10, torch.bfloat16: 3 * 2.0**-7}
DTYPES = st.sampled_from(sorted(BOUND, key=str))
SHAPES = settings(max_examples=12, deadline=None)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    top = want.float().abs().max().item()
    assert err <= BOUND[want.dtype] * max(top, 1.0), f"{want.dtype}: error {err} (largest {top})"


def test_the_kernels_run_here():
    x = torch.randn(3, 8)
    assert fused_ops.use_triton(x) and fused_ops.kernels() is not None


@SHAPES
@given(rows=st.integers(1, 5), width=st.integers(1, 300), dtype=DTYPES, seed=st.integers(0, 99))
def test_rmsnorm_and_add_rmsnorm(rows, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, res, w = (
        torch.randn(s, generator=gen).to(dtype) for s in ((rows, width),) * 2 + ((width,),)
    )
    close(fused_ops.rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5))
    want_res = res + x
    want = rmsnorm_reference(want_res, w, 1e-5)
    # rows of a wider buffer: the kernels follow the row stride
    xs, rs = torch.zeros(rows, width + 3, dtype=dtype), torch.zeros(rows, width + 5, dtype=dtype)
    xs[:, :width], rs[:, :width] = x, res
    out, new_res = fused_ops.add_rmsnorm_(xs[:, :width], rs[:, :width], w, 1e-5)
    if dtype == torch.bfloat16:  # rounded toward zero by the interpreter (module docstring)
        ulp = 2.0**-7 * want_res.float().abs()
        assert ((new_res.float() - want_res.float()).abs() <= ulp).all()
    else:
        assert torch.equal(new_res, want_res)  # one rounding of the sum, as torch's add
    close(out, want)
    assert not xs[:, width:].any() and not rs[:, width:].any()  # nothing past the rows


@SHAPES
@given(rows=st.integers(1, 5), inter=st.integers(1, 2500), dtype=DTYPES, seed=st.integers(0, 99))
def test_silu_mul(rows, inter, dtype, seed):
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(seed)) * 3).to(
        dtype
    )
    close(fused_ops.silu_mul(gate_up), silu_mul_reference(gate_up))


@SHAPES
@given(
    tokens=st.integers(1, 6),
    heads=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    half=st.sampled_from([1, 3, 4, 16, 64]),
    dtype=DTYPES,
    seed=st.integers(0, 99),
)
def test_rotary_in_place_on_q_and_k_leaves_v(tokens, heads, kv_heads, half, dtype, seed):
    d = 2 * half
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rotary_tables(inv_freq, 1.0, 100, dtype)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    n = (heads + kv_heads) * d
    want = rotary_reference(qkv[:, :n].view(tokens, -1, d), positions, cos, sin).reshape(tokens, n)
    v = qkv[:, n:].clone()
    fused_ops.rotary_(qkv, positions, cos, sin, heads + kv_heads, d)
    close(qkv[:, :n], want)
    assert torch.equal(qkv[:, n:], v)


def test_a_model_with_the_kernels_matches_it_with_the_plain_forms():
    """The fused decoder of a small Llama, kernels interpreted, against the plain forms (the same
    weights, the process switched to them by hiding the kernels)."""
    from graphplan.models.hf import PagedCausalLM

    from hf_models import small_config

    model = PagedCausalLM.load(
        small_config("llama"), max_num_seqs=2, max_model_len=32, random_weights=True, fused_ops=True
    )
    batch = [(0, 0, [1, 2, 3, 5, 6]), (1, 0, [4])]
    got = model(**model.make_batch(batch))
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        assert not fused_ops.use_triton(got)
        for seat in (0, 1):
            model.release(seat)
        want = model(**model.make_batch(batch))
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@SHAPES
@given(
    n=st.integers(1, 40),
    k=st.integers(1, 700),
    block=st.sampled_from([(1, 16), (4, 64), (8, 512), (16, 128)]),
    bias=st.booleans(),
    dtype=DTYPES,
    seed=st.integers(0, 99),
)
def test_gemv_is_one_tokens_linear(n, k, block, bias, dtype, seed):
    """Any row count and width (tiles that overhang both), with and without a bias, from rows of a
    wider weight (the kernel follows the row stride): F.linear's value within one rounding."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, k + 3, generator=gen).to(dtype)
    w, x = wide[:, :k], torch.randn(k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = torch.full((n + 2,), 7.0, dtype=dtype)
    fused_ops.kernels().gemv(x, w, b, out[:n], block_n=block[0], block_k=block[1])
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    close_sum(out[:n], want, x, w, dtype)
    assert torch.equal(out[n:], torch.full((2,), 7.0, dtype=dtype))  # nothing past the rows


def close_sum(got, want, x, w, dtype) -> None:
    """A float32 sum of k products, rounded once to ``dtype``: within half a unit in the last
    place of the result (one rounding; the interpreter may round bfloat16 toward zero: a whole
    unit) plus float32's error over the sum of |products| (k x 2^-24 each)."""
    ulp = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    scale = (w.double().abs() * x.double().abs()).sum(-1)
    bound = ulp * want.abs() + w.shape[1] * 2.0**-24 * scale + 1e-30
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"{dtype}: error {err.max()} (bound {bound.min()})"


def test_the_gemv_probe_times_the_triton_gemv_beside_cublas(tmp_path, capsys):
    """bench/gemv_probe.py --triton, a smoke run of the tiny shape: the Triton table's row of each
    TP, each kind's cuBLAS and fastest Triton ms with its config."""
    from gemv_probe import main

    out = tmp_path / "probe.md"
    argv = ["--device", "cpu", "--shape", "tiny", "--tps", "2", "--batches", "1", "--iters", "1"]
    assert main([*argv, "--triton", "8x64x4,16x32x2", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 2 | ")]
    assert len(rows) == 2  # the cuBLAS table's and the Triton table's
    cells = rows[1].strip("| ").split(" | ")
    assert len(cells) == 8 and all(float(c) > 0 for c in cells[1:3])
    for cell in cells[3:]:
        assert re.fullmatch(r"[\d.]+ / \*\*[\d.]+\*\* \((8x64x4|16x32x2)\)", cell), cell
