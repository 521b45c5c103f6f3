"""The fused decoder (models/hf/fused_decoder.py, fused_ops.py) on the CPU, float32.

- Each op's plain-torch form is transformers' own computation: equal to LlamaRMSNorm, the MLP's
  SiLU x up, LlamaRotaryEmbedding + apply_rotary_pos_emb, exactly (hypothesis over shapes).
- The Triton kernels equal those forms under Triton's interpreter (tests/fused_interpreted.py, run
  in a child process with TRITON_INTERPRET=1): float32 within 1e-6 relative to the largest value,
  float16/bfloat16 within one rounding of the dtype.
- A small Llama (and Qwen2: biased q/k/v, tied embeddings) saved with save_pretrained, loaded
  with fused_ops=True: decode steps (FULL graphs, CPU stand-in), mixed prefill+decode steps
  (eager) and PIECEWISE steps give every request transformers' forward logits over its whole
  sequence within 1e-4 (absolute and relative), and greedy generation gives transformers'
  generate tokens exactly.
- Weights laid out once (views of one tensor, nothing copied), the attention called as
  transformers calls it, and models it does not apply to keep transformers' forward.
"""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreted import run_interpreted

from graphplan.compiler import compile_plan
from graphplan.models.hf import ATTN_IMPLEMENTATION, PagedCausalLM, load_model
from graphplan.models.hf.fused_decoder import why_not_fused
from graphplan.models.hf.fused_ops import (
    add_rmsnorm_,
    rmsnorm_reference,
    rotary_,
    rotary_reference,
    rotary_tables,
    silu_mul,
)
from graphplan.runtime import GraphRunner

from hf_models import (
    LENS,
    STEPS,
    generated,
    mixed_plan,
    mixed_schedule,
    plan,
    reference_logits,
    run_schedule,
    serve_greedy,
    small_config,
    tokens,
)

TOL = dict(atol=1e-4, rtol=1e-4)
SHAPES = settings(max_examples=25, deadline=None)


# ---- the ops are transformers' own computations -----------------------------------------------
@SHAPES
@given(rows=st.integers(1, 9), width=st.integers(1, 80), seed=st.integers(0, 99))
def test_add_rmsnorm_is_the_residual_add_then_llamas_rmsnorm_in_place(rows, width, seed):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(seed)
    x, res = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    norm = LlamaRMSNorm(width, eps=1e-5)
    norm.weight.data = torch.randn(width, generator=gen)
    want_res = res + x
    with torch.no_grad():
        want = norm(want_res)
    out, new_res = add_rmsnorm_(x, res, norm.weight, 1e-5)
    assert out is x and new_res is res  # in place
    assert torch.equal(res, want_res) and torch.equal(x, want)
    assert torch.equal(rmsnorm_reference(want_res, norm.weight, 1e-5), want)


@SHAPES
@given(rows=st.integers(1, 9), inter=st.integers(1, 70), seed=st.integers(0, 99))
def test_silu_mul_is_the_mlps_silu_gate_times_up(rows, inter, seed):
    gen = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(rows, inter, generator=gen), torch.randn(rows, inter, generator=gen)
    got = silu_mul(torch.cat([gate, up], dim=1))
    assert got.shape == (rows, inter)
    assert torch.equal(got, torch.nn.functional.silu(gate) * up)


@SHAPES
@given(
    tokens_=st.integers(1, 7),
    heads=st.integers(1, 4),
    kv_heads=st.integers(1, 3),
    half=st.integers(1, 12),
    rope=st.sampled_from(["default", "llama3"]),
    seed=st.integers(0, 99),
)
def test_rotary_in_place_is_apply_rotary_pos_emb_at_each_tokens_position(
    tokens_, heads, kv_heads, half, rope, seed
):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    d = 2 * half
    params = {"rope_type": rope, "rope_theta": 10000.0}
    if rope == "llama3":
        params.update(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8,
        )
    cfg = LlamaConfig(
        hidden_size=d * heads,
        num_attention_heads=heads,
        head_dim=d,
        max_position_embeddings=64,
        rope_parameters=params,
    )
    rope_emb = LlamaRotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 64, (tokens_,), generator=gen)
    qkv = torch.randn(tokens_, (heads + 2 * kv_heads) * d, generator=gen)
    q = qkv[:, : heads * d].view(tokens_, heads, d).transpose(0, 1)[None]
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens_, kv_heads, d).transpose(0, 1)[None]
    cos, sin = rope_emb(qkv, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    v = qkv[:, (heads + kv_heads) * d :].clone()
    table_cos, table_sin = rotary_tables(
        rope_emb.inv_freq, rope_emb.attention_scaling, 64, torch.float32
    )
    assert torch.equal(torch.cat([table_cos] * 2, -1)[positions], cos[0])
    rotary_(qkv, positions, table_cos, table_sin, heads + kv_heads, d)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # q and k were views of qkv
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v)  # v untouched
    fresh = torch.randn(tokens_, heads, d, generator=gen)
    want, _ = apply_rotary_pos_emb(fresh.transpose(0, 1)[None], k, cos, sin)
    got = rotary_reference(fresh, positions, table_cos, table_sin)
    assert torch.equal(got, want[0].transpose(0, 1))


def test_the_triton_kernels_equal_the_plain_forms_under_tritons_interpreter():
    run_interpreted("fused_interpreted.py")


# ---- the whole model --------------------------------------------------------------------------
def save_model(path: Path, family: str, seed: int = 0) -> Path:
    """A checkpoint as save_pretrained writes it: init_random's weights (embeddings std 1, so
    every logit depends on the context)."""
    model = load_model(
        small_config(family), seed=seed, attn_implementation="eager", random_weights=True
    )
    model.save_pretrained(path)
    return path


def transformers_model(path: Path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )
    return ref.eval().requires_grad_(False)


def load(path: Path, fused_ops=True, **kw):
    kw = {**dict(max_num_seqs=4, max_model_len=32, block_size=4), **kw}
    return PagedCausalLM.load(path, fused_ops=fused_ops, **kw)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def saved(request, tmp_path_factory):
    path = save_model(tmp_path_factory.mktemp(request.param), request.param)
    return path, transformers_model(path)


def test_decode_and_mixed_steps_give_transformers_logits_over_each_sequence(saved):
    path, ref = saved
    model = load(path)
    assert model.fused_ops and model.fused is not None
    runner = GraphRunner(model, compile_plan(plan()), model.static_inputs(), progress=False)
    runner.capture()
    seqs = [tokens(n, seed=10 + i) for i, n in enumerate(LENS)]
    got = run_schedule(model, runner, seqs, STEPS)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], reference_logits(ref, seq), **TOL)
        assert torch.equal(got[i].argmax(-1), reference_logits(ref, seq).argmax(-1))
    stats = runner.stats()
    assert stats["replays_by_mode"]["FULL"] == 6 and sum(stats["eager_steps"].values()) == 2


def test_piecewise_steps_split_at_the_same_attention_call(saved):
    path, ref = saved
    model = load(path)
    runner = GraphRunner(
        model, compile_plan(mixed_plan("PIECEWISE")), model.static_inputs(), progress=False
    )
    runner.capture()
    lens, prompts = (13, 9, 5), (8, 6, 1)
    steps, _ = mixed_schedule(lens, prompts=prompts, budget=8, seed=3)
    seqs = [tokens(n, seed=40 + i) for i, n in enumerate(lens)]
    got = run_schedule(model, runner, seqs, steps)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], reference_logits(ref, seq), **TOL)
    assert runner.stats()["replays_by_mode"].get("PIECEWISE", 0) > 0


def test_greedy_generation_equals_transformers_generate(saved):
    from graphplan.server.core.batching import ContinuousBatcher

    path, ref = saved
    model = load(path)
    runner = GraphRunner(model, compile_plan(plan()), model.static_inputs(), progress=False)
    runner.capture()
    prompts = [tokens(n, seed=30 + n) for n in (7, 3, 11)]
    batcher = ContinuousBatcher(max_num_seqs=4, token_budget=8, max_model_len=32, num_cache_rows=4)
    serve_greedy(model, runner, batcher, prompts, 8)
    for i, p in enumerate(prompts):
        assert batcher.finished[i] == generated(ref, p, 8), f"prompt {i}"


def test_the_outputs_depend_on_the_context_by_far_more_than_the_tolerance(saved):
    """So a token that attended to the wrong keys would fail the equalities above."""
    path, _ = saved
    model = load(path)
    a = model(**model.make_batch([(0, 0, [5, 6, 7, 8])]))
    model.release(0)
    b = model(**model.make_batch([(0, 0, [9, 6, 7, 8])]))
    assert (a[1:] - b[1:]).abs().amax(dim=-1).min() > 20 * TOL["atol"]


def test_fused_and_transformers_forward_agree_on_one_model_switched_at_run_time(saved):
    path, _ = saved
    model = load(path)
    batch = [(0, 0, tokens(9, seed=1)), (1, 0, tokens(1, seed=2))]
    fused = model(**model.make_batch(batch))
    model.fused_ops = False
    for seat in (0, 1):
        model.release(seat)
    stock = model(**model.make_batch(batch))
    torch.testing.assert_close(fused, stock, atol=1e-5, rtol=1e-5)


# ---- layout, the attention call, and where it does not apply ------------------------------------
def test_qkv_and_gate_up_weights_are_one_tensor_each_and_nothing_is_copied(tmp_path):
    path = save_model(tmp_path, "llama")
    stock = load(path, fused_ops=False)
    model = load(path)
    before = {n: t.clone() for n, t in stock.hf.state_dict().items()}
    for name, t in model.hf.state_dict().items():
        assert torch.equal(t, before[name]), name
    storages = {p.untyped_storage().data_ptr() for p in model.hf.parameters()}
    assert len(storages) == len(list(stock.hf.parameters())) - 3 * len(model.fused.layers)
    for layer, fused in zip(model.hf.model.layers, model.fused.layers):
        a, m = layer.self_attn, layer.mlp
        assert fused.qkv.shape[0] == a.q_proj.out_features + 2 * a.k_proj.out_features
        assert fused.qkv.data_ptr() == a.q_proj.weight.data_ptr()
        assert a.v_proj.weight.data_ptr() == fused.qkv[-a.v_proj.out_features :].data_ptr()
        assert fused.gate_up.data_ptr() == m.gate_proj.weight.data_ptr()
        assert m.up_proj.weight.data_ptr() == fused.gate_up[m.gate_proj.out_features :].data_ptr()
    assert sum(p.numel() for p in model.hf.parameters()) == sum(
        p.numel() for p in stock.hf.parameters()
    )


def test_attention_is_called_with_the_arguments_transformers_passes(saved, monkeypatch):
    from transformers import AttentionInterface

    from graphplan.models.hf import attention

    path, _ = saved
    model = load(path)
    calls = {True: [], False: []}

    def spy(module, q, k, v, mask, **kwargs):
        calls[model.fused_ops].append((module.layer_idx, q.clone(), k.clone(), v.clone(), mask))
        calls[model.fused_ops].append(sorted(kwargs))
        return attention.split_paged_attention(module, q, k, v, mask, **kwargs)

    AttentionInterface.register(ATTN_IMPLEMENTATION, spy)
    try:
        for on in (True, False):
            model.fused_ops = on
            model.release(0)
            model(**model.make_batch([(0, 0, tokens(6, seed=4))]))
    finally:
        attention.register()
    assert len(calls[True]) == len(calls[False]) == 2 * model.hf.config.num_hidden_layers
    for f, s in zip(calls[True], calls[False]):
        if isinstance(f, list):
            assert f == s  # the same keywords (graphplan's metadata among them)
            continue
        assert f[0] == s[0] and f[4] is None and s[4] is None
        for a, b in zip(f[1:4], s[1:4]):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family, change, reason",
    [
        ("qwen3", None, "not a Llama-family model"),
        ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        ("llama", "lora", "not plain torch.nn.Linear"),
    ],
)
def test_models_it_does_not_apply_to_keep_transformers_forward(family, change, reason, caplog):
    cfg = small_config(family, **(change if isinstance(change, dict) else {}))
    hf = load_model(cfg, attn_implementation=ATTN_IMPLEMENTATION, random_weights=True)
    if change == "lora":

        class LoraLinear(torch.nn.Linear):
            pass

        q = hf.model.layers[1].self_attn.q_proj
        wrapped = LoraLinear(q.in_features, q.out_features, bias=False)
        wrapped.weight = q.weight
        hf.model.layers[1].self_attn.q_proj = wrapped
    assert reason in why_not_fused(hf)
    model = PagedCausalLM(hf, max_num_seqs=2, max_model_len=16, fused_ops=True)
    assert model.fused is None and not model.fused_ops and reason in model.fused_reason
    assert reason in caplog.text
    with pytest.raises(ValueError, match="cannot be turned on"):
        model.fused_ops = True
    out = model(**model.make_batch([(0, 0, [1, 2, 3])]))
    assert out.shape == (3, cfg.vocab_size) and torch.isfinite(out).all()


def test_fused_ops_default_off_on_the_cpu_and_false_keeps_the_weights_apart(tmp_path):
    path = save_model(tmp_path, "llama")
    for option in (None, False):
        model = load(path, fused_ops=option)
        assert model.fused is None and not model.fused_ops
        a = model.hf.model.layers[0].self_attn
        storage = a.q_proj.weight.untyped_storage().data_ptr()
        assert a.k_proj.weight.untyped_storage().data_ptr() != storage


def test_a_compiled_runner_traces_transformers_forward_of_a_fused_model(saved, fresh_dynamo):
    from graphplan.runtime import CompiledModel

    path, ref = saved
    model = load(path)
    compiled = CompiledModel(model, "eager")
    runner = GraphRunner(
        model, compile_plan(plan()), model.static_inputs(), progress=False, compile=compiled
    )
    runner.capture()
    seqs = [tokens(n, seed=10 + i) for i, n in enumerate(LENS)]
    got = run_schedule(model, runner, seqs, STEPS)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], reference_logits(ref, seq), **TOL)
    assert compiled.recompiles == 0


def test_the_servers_hf_spec_passes_fused_ops_to_the_model(tmp_path):
    from graphplan.server.core.hf_model import HFSpec

    path = save_model(tmp_path, "llama")
    table = compile_plan(plan())
    assert HFSpec(model=str(path), max_model_len=32, fused_ops=True).build(table, "cpu").fused_ops
    assert not HFSpec(model=str(path), max_model_len=32).build(table, "cpu").fused_ops
