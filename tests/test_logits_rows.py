"""``PagedCausalLM(logits="rows")`` (models/hf/adapter.py): the step returns the last hidden states
and ``logits(out, rows)`` applies the LM head to the rows a step reads, outside the graphs. On the
CPU in float32, through FULL and PIECEWISE graphs (the CPU stand-in) over a mixed schedule, every
row's logits equal the default ``logits="all"`` model's within 1e-5 for Llama (transformers'
forward and the fused decoder), Qwen2 (tied embeddings) and Qwen3 (on CUDA in bfloat16, Llama:
within two units of the dtype); a model whose logits are more
than its LM head keeps "all" and says why; the server builds its models with "rows"; the step
memory measurement runs the LM head on the rows a step samples."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models.hf import PagedCausalLM, load_model, step_memory
from graphplan.models.hf import adapter as adapter_module
from graphplan.runtime import GraphRunner
from graphplan.server.core.hf_model import HFSpec

from hf_models import (
    AllRows,
    mixed_plan,
    mixed_schedule,
    run_schedule,
    small_config,
    tokens,
    write_model_dir,
)


def paged(hf, logits: str, fused: bool) -> PagedCausalLM:
    return PagedCausalLM(
        hf, max_num_seqs=4, max_model_len=64, block_size=4, fused_ops=fused, logits=logits
    )


def both_ways(family: str, fused: bool, device: str = "cpu", dtype=torch.float32):
    """Each request's logits over a mixed schedule through FULL and PIECEWISE graphs, from a
    'rows' model (every row through ``logits``) and an 'all' model of the same weights."""
    hf = load_model(small_config(family), seed=0, attn_implementation="eager", random_weights=True)
    hf = hf.to(device, dtype)
    models = {mode: paged(copy.deepcopy(hf), mode, fused) for mode in ("all", "rows")}
    assert models["rows"].logits_mode == "rows" and models["rows"].logits_reason is None
    assert models["all"].logits_mode == "all"
    table = compile_plan(mixed_plan())
    lens, prompts = [30, 12, 20, 9], [17, 5, 11, 4]
    seqs = [tokens(n, seed=i) for i, n in enumerate(lens)]
    steps, uniform = mixed_schedule(lens, prompts=prompts, budget=16, seed=3)
    assert any(uniform) and not all(uniform)
    got = {}
    for mode, model in models.items():
        runner = GraphRunner(model, table, model.static_inputs(), device=device, progress=False)
        runner.capture()
        driver = AllRows(runner, model) if mode == "rows" else runner
        got[mode] = run_schedule(model, driver, seqs, steps)
        stats = runner.stats()
        assert stats["replays_by_mode"]["FULL"] > 0 and stats["replays_by_mode"]["PIECEWISE"] > 0
        if mode == "rows":  # the step's output is the hidden states
            hidden = small_config(family).hidden_size
            assert {s[1] for s in driver.shapes} == {hidden}
        runner.release()
    return got["rows"], got["all"]


@pytest.mark.parametrize(
    "family, fused", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False)]
)
def test_rows_logits_equal_every_rows_logits_through_full_and_piecewise_graphs(family, fused):
    for rows, every in zip(*both_ways(family, fused)):
        assert rows.shape == every.shape
        torch.testing.assert_close(rows, every, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_on_cuda_in_bfloat16_rows_logits_are_every_rows_within_a_rounding(fused):
    """The head's GEMM over the rows alone may accumulate in another order than over every
    token: within two bfloat16 units (2 x 2**-7) of the row's largest logit."""
    for rows, every in zip(*both_ways("llama", fused, "cuda", torch.bfloat16)):
        bound = 2 * 2.0**-7 * every.abs().amax(dim=-1, keepdim=True)
        assert bool(((rows - every).abs() <= bound).all())


def test_a_model_whose_logits_are_more_than_its_head_keeps_every_row_and_says_why(
    monkeypatch, caplog
):
    monkeypatch.setattr(adapter_module, "HEAD_ONLY", frozenset({"GemmaForCausalLM"}))
    hf = load_model(small_config("llama"), seed=0, attn_implementation="eager", random_weights=True)
    with caplog.at_level(logging.WARNING, logger="graphplan.models"):
        model = paged(hf, "rows", False)
    assert model.logits_mode == "all"
    assert model.logits_reason == (
        "LlamaForCausalLM is not one whose logits are its LM head alone (GemmaForCausalLM)"
    )
    assert "every token's logits come from forward" in caplog.text
    batch = model.make_batch([(0, 0, [5, 6, 7])])
    assert model(**batch).shape == (3, 128)
    with pytest.raises(ValueError, match="logits must be 'all' or 'rows', not 'some'"):
        paged(hf, "some", False)


def test_the_server_builds_its_models_with_rows(tmp_path):
    spec = HFSpec(model=str(write_model_dir(tmp_path / "m")), max_model_len=32)
    table = compile_plan(mixed_plan(max_num_seqs=2))
    model = spec.build(table, "cpu")
    assert model.logits_mode == "rows"


def test_the_step_memory_measurement_runs_the_head_on_the_rows_a_step_samples(monkeypatch):
    """step_reserve_bytes is CUDA-only; here its allocator calls are stubbed to run it on the CPU:
    one forward at the token budget, then the LM head over max_num_seqs rows."""
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 1700)
    hf = load_model(small_config("llama"), seed=0, attn_implementation="eager", random_weights=True)
    model = paged(hf, "rows", False)
    calls = []
    real = model.logits
    monkeypatch.setattr(
        model,
        "logits",
        lambda out, rows, **k: calls.append((out.shape, rows.tolist())) or real(out, rows, **k),
    )
    shape = adapter_module.kv_shape(hf.config, torch.float32, 4)
    reserve = step_memory.step_reserve_bytes(model, model._pool, shape, 3, 64, 40)
    assert reserve == 700 + step_memory.SAMPLER_BYTES_PER_LOGIT * 3 * 128
    assert calls == [((40, 64), [0, 1, 2])]  # hidden states of the 40 tokens; 3 sampled rows
    assert not hasattr(model, "cache")  # the measuring pool was taken down
