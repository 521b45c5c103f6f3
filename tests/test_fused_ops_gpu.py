"""The fused decoder's Triton kernels and the adapter's fused forward on a GPU.

Bounds (bf16): each kernel against its plain-torch form (transformers' own computation, run by
torch on the same device), at most three units in the last place of the largest value
(3 x 2^-7 x max(|want|, 1)): the kernels round where transformers rounds (up to two roundings in
a row), computing in float32 between, so an intermediate can land on the other side of a
rounding boundary. The residual sum is exact (one rounding to nearest, as torch's add). The
adapter's logits, fused and not, against transformers' float32 forward of the same bf16-rounded
weights: within twice transformers' own bf16 sdpa error, or 2% of the largest logit
(``hf_models.bf16_errors``' rule, with the sdpa forward as the bf16 reference). Findings are
printed and, when $OUT is set, written to $OUT/fused_ops_gpu.md.

    python -m pytest -q -s -m gpu tests/test_fused_ops_gpu.py
"""

import copy
import os
from pathlib import Path

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models.hf.fused_ops import (
    add_rmsnorm_,
    rmsnorm,
    rmsnorm_reference,
    rotary_,
    rotary_reference,
    rotary_tables,
    silu_mul,
    silu_mul_reference,
    use_triton,
)
from graphplan.runtime import GraphRunner

from hf_models import (
    LENS,
    STEPS,
    mixed_plan,
    mixed_schedule,
    plan,
    reference_logits,
    run_schedule,
    small_config,
    tokens,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
VOCAB = 1024
ULPS = 3 * 2.0**-7


def record(line: str) -> None:
    print(line)
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "fused_ops_gpu.md", "a") as f:
            f.write(line + "\n")


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    err = (got.float() - want.float()).abs().max().item()
    top = want.float().abs().max().item()
    same = (got == want).float().mean().item()
    record(f"- {what}: max |error| {err:.2e} (largest {top:.2f}), identical {same:.2%}")
    assert err <= ULPS * max(top, 1.0), what


def rand(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEV, torch.bfloat16)


@pytest.mark.parametrize("rows, hidden", [(1, 4096), (64, 4096), (7, 1000), (300, 2048)])
def test_rmsnorm_kernels_equal_llamas_rmsnorm_in_bf16(rows, hidden):
    x, res, w = rand(rows, hidden, seed=1), rand(rows, hidden, seed=2), rand(hidden, seed=3)
    assert use_triton(x)
    close(rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5), f"rmsnorm [{rows}, {hidden}]")
    want_res = res + x
    want = rmsnorm_reference(want_res, w, 1e-5)
    out, new_res = add_rmsnorm_(x, res, w, 1e-5)
    assert torch.equal(new_res, want_res)
    close(out, want, f"add_rmsnorm [{rows}, {hidden}]")


@pytest.mark.parametrize("rows, inter", [(1, 14336), (64, 14336), (5, 1000)])
def test_silu_mul_kernel_equals_the_mlps_silu_times_up_in_bf16(rows, inter):
    gate_up = rand(rows, 2 * inter, seed=4, scale=3.0)
    close(silu_mul(gate_up), silu_mul_reference(gate_up), f"silu_mul [{rows}, {inter}]")


@pytest.mark.parametrize("n, k", [(3072, 4096), (4096, 2048), (4096, 7168), (1000, 777)])
def test_the_gemv_kernel_equals_one_tokens_f_linear_in_bf16(n, k):
    """fused_kernels.gemv (bench/gemv_probe.py's Triton GEMV) at a TP=2 rank's 8B widths: cuBLAS's
    bf16 F.linear within one rounding of the largest value (both sum in float32, in other
    orders), with and without a bias."""
    from graphplan.models.hf.fused_kernels import gemv

    x, w, b = rand(k, seed=5), rand(n, k, seed=6, scale=k**-0.5), rand(n, seed=7)
    for bias in (None, b):
        out = torch.empty(n, device=DEV, dtype=torch.bfloat16)
        gemv(x, w, bias, out)
        close(
            out, torch.nn.functional.linear(x[None], w, bias)[0], f"gemv [{n}, {k}] {bias is None}"
        )


@pytest.mark.parametrize(
    "rows, heads, kv_heads, head_dim", [(1, 32, 8, 128), (64, 32, 8, 128), (9, 14, 2, 64)]
)
def test_rotary_kernel_equals_apply_rotary_pos_emb_in_bf16(rows, heads, kv_heads, head_dim):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    cos, sin = rotary_tables(inv_freq, 1.0, 8192, torch.bfloat16)
    positions = torch.randint(0, 8192, (rows,), generator=torch.Generator().manual_seed(6)).to(DEV)
    qkv = rand(rows, (heads + 2 * kv_heads) * head_dim, seed=5)
    n = (heads + kv_heads) * head_dim
    want = rotary_reference(qkv[:, :n].view(rows, -1, head_dim), positions, cos, sin)
    v = qkv[:, n:].clone()
    rotary_(qkv, positions, cos, sin, heads + kv_heads, head_dim)
    close(qkv[:, :n], want.reshape(rows, n), f"rotary [{rows}, {heads}+{kv_heads} x {head_dim}]")
    assert torch.equal(qkv[:, n:], v)


def test_the_fused_ops_replay_in_a_cuda_graph_on_new_inputs():
    """One layer's small ops captured once over static buffers, replayed after new values are
    copied in: the eager result on those values, bit for bit (same kernels, no host reads)."""
    rows, hidden, heads, d = 8, 512, 6, 64
    cos, sin = rotary_tables(torch.rand(d // 2, device=DEV), 1.0, 256, torch.bfloat16)
    static = dict(
        x=rand(rows, hidden, seed=1),
        res=rand(rows, hidden, seed=2),
        qkv=rand(rows, heads * d, seed=3),
        gate_up=rand(rows, 2 * hidden, seed=4),
        pos=torch.arange(rows, device=DEV),
    )
    w = rand(hidden, seed=5)

    def body(t):
        x, res = add_rmsnorm_(t["x"], t["res"], w, 1e-6)
        rotary_(t["qkv"], t["pos"], cos, sin, heads - 2, d)
        return x, res, t["qkv"], silu_mul(t["gate_up"])

    body({k: v.clone() for k, v in static.items()})  # compiles the kernels, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body(static)
    fresh = dict(
        x=rand(rows, hidden, seed=11),
        res=rand(rows, hidden, seed=12),
        qkv=rand(rows, heads * d, seed=13),
        gate_up=rand(rows, 2 * hidden, seed=14),
        pos=torch.randint(0, 256, (rows,), device=DEV),
    )
    for k, v in fresh.items():
        static[k].copy_(v)
    graph.replay()
    want = body({k: v.clone() for k, v in fresh.items()})
    for got, exp in zip(outs, want):
        assert torch.equal(got, exp)


# ---- the adapter ------------------------------------------------------------------------------
def build(family: str, fused: bool, table, **size):
    from graphplan.models.hf import PagedCausalLM

    cfg = small_config(family, vocab=VOCAB, **(size or dict(hidden=256, layers=4, heads=8)))
    model = PagedCausalLM.load(
        cfg,
        max_num_seqs=table.max_num_seqs,
        max_model_len=64,
        block_size=4,
        dtype=torch.bfloat16,
        device=DEV,
        random_weights=True,
        fused_ops=fused,
    )
    assert model.fused_ops is fused
    runner = GraphRunner(model, table, model.static_inputs(), progress=False)
    runner.capture()
    return model, runner


def sdpa_reference(model, dtype):
    """transformers' own forward of the same bf16-rounded weights, sdpa attention, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(
        copy.deepcopy(model.hf.config), attn_implementation="sdpa", dtype=dtype
    )
    ref.load_state_dict(model.hf.state_dict())
    return ref.to(DEV).eval().requires_grad_(False)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_bf16_logits_fused_and_not_are_within_transformers_own_bf16_error(family, mode):
    """Decode steps (FULL graphs) and steps with prefill chunks of different lengths (eager, or
    PIECEWISE graphs), fused_ops on and off, against transformers' sdpa forward."""
    if mode == "FULL_DECODE_ONLY":
        table = compile_plan(plan())
        seqs = [tokens(n, seed=10 + i, vocab=VOCAB) for i, n in enumerate(LENS)]
        steps = STEPS
    else:
        table = compile_plan(mixed_plan(mode))
        lens, prompts = (27, 19, 9, 23), (17, 12, 1, 15)
        steps, _ = mixed_schedule(lens, prompts=prompts, budget=16, seed=4)
        seqs = [tokens(n, seed=20 + i, vocab=VOCAB) for i, n in enumerate(lens)]
    got = {}
    for fused in (True, False):
        model, runner = build(family, fused, table)
        got[fused] = run_schedule(model, runner, seqs, steps)
        runner.release()
    ref16, ref32 = sdpa_reference(model, torch.bfloat16), sdpa_reference(model, torch.float32)
    for i, seq in enumerate(seqs):
        truth = reference_logits(ref32, seq)
        top = truth.abs().max().item()
        err_hf = (reference_logits(ref16, seq) - truth).abs().max().item()
        bound = max(2 * err_hf, 0.02 * top)
        err = {f: (got[f][i] - truth).abs().max().item() for f in (True, False)}
        between = (got[True][i] - got[False][i]).abs().max().item()
        record(
            f"- {family} {mode} request {i}: max |logit error| fused {err[True]:.4f}, unfused "
            f"{err[False]:.4f}, transformers sdpa bf16 {err_hf:.4f} (bound {bound:.4f}; "
            f"largest {top:.2f}); fused vs unfused {between:.4f}"
        )
        assert err[True] <= bound and err[False] <= bound, f"request {i}"
