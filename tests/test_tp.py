"""Tensor parallelism on the CPU (models/hf/tp.py): each rank loads only its part of a saved
checkpoint, and two Gloo ranks (spawned as test_dp.py spawns them) give the logits of one rank
(TP=1) within the suite's float32 bound, for decode steps (FULL graphs) and mixed steps (eager and
PIECEWISE), on a Llama (one KV head, replicated; a vocabulary of 127 that two ranks split
unevenly), a Qwen2 (biased q/k/v, tied embeddings) and a Qwen3 (q/k norms, transformers'
forward); the greedy tokens are identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_dp import _spawn

from graphplan.compiler import compile_plan
from graphplan.models.hf import PagedCausalLM, load_model
from graphplan.models.hf.errors import TensorParallelError
from graphplan.models.hf.tp import TPGroup, part_of, split_of
from graphplan.models.hf.tp_load import load_tp_model
from graphplan.models.hf.weights import CheckpointReader
from graphplan.runtime import GraphRunner

from hf_models import (
    LENS,
    STEPS,
    mixed_plan,
    mixed_schedule,
    plan,
    run_schedule,
    serve_greedy,
    small_config,
    tokens,
)

TOL = dict(atol=1e-4, rtol=1e-4)  # test_fused_ops.py's float32 bound
CASES = {  # name -> (family, config changes, fused_ops)
    "llama-fused": ("llama", dict(vocab=127, kv_heads=1), True),
    "llama": ("llama", dict(vocab=127, kv_heads=1), False),
    "qwen2-fused": ("qwen2", {}, True),
    "qwen3": ("qwen3", {}, None),
}


def save(path: Path, family: str, **config) -> Path:
    model = load_model(
        small_config(family, **config), seed=0, attn_implementation="eager", random_weights=True
    )
    model.save_pretrained(path)
    return path


def load(path, fused, tp=None):
    return PagedCausalLM.load(
        path, max_num_seqs=4, max_model_len=32, block_size=4, fused_ops=fused, tp=tp
    )


@torch.no_grad()
def outputs(model) -> dict:
    """Decode (FULL graphs) and mixed (eager) steps of STEPS, mixed steps under PIECEWISE
    graphs, and greedy tokens through the batcher."""
    from graphplan.server.core.batching import ContinuousBatcher

    out = {}
    runner = GraphRunner(model, compile_plan(plan()), model.static_inputs(), progress=False)
    runner.capture()
    seqs = [tokens(n, seed=10 + i, vocab=127) for i, n in enumerate(LENS)]
    out["full"] = [g.tolist() for g in run_schedule(model, runner, seqs, STEPS)]
    for seat in range(3):
        model.release(seat)
    prompts = [tokens(n, seed=30 + n, vocab=127) for n in (7, 3, 11)]
    batcher = ContinuousBatcher(max_num_seqs=4, token_budget=8, max_model_len=32, num_cache_rows=4)
    serve_greedy(model, runner, batcher, prompts, 8)
    out["greedy"] = [batcher.finished[i] for i in range(3)]
    for seat in range(4):
        model.release(seat)
    pw = GraphRunner(
        model, compile_plan(mixed_plan("PIECEWISE")), model.static_inputs(), progress=False
    )
    pw.capture()
    steps, _ = mixed_schedule((13, 9, 5), prompts=(8, 6, 1), budget=8, seed=3)
    seqs = [tokens(n, seed=40 + i, vocab=127) for i, n in enumerate((13, 9, 5))]
    out["piecewise"] = [g.tolist() for g in run_schedule(model, pw, seqs, steps)]
    out["piecewise_replays"] = pw.stats()["replays_by_mode"].get("PIECEWISE", 0)
    return out


def _tp_worker(rank, world, dirs: dict):
    tp = TPGroup(rank, world, dist.group.WORLD)
    result = {}
    for name, (_, _, fused) in CASES.items():
        model = load(dirs[name], fused, tp)
        result[name] = {"fused": model.fused_ops, **outputs(model)}
    return result


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    base, dirs = tmp_path_factory.mktemp("tp"), {}
    for family, config, _ in CASES.values():
        if family not in dirs:
            dirs[family] = str(save(base / family, family, **config))
    return {name: dirs[family] for name, (family, _, _) in CASES.items()}


@pytest.fixture(scope="module")
def two_ranks(saved, tmp_path_factory):
    return _spawn(_tp_worker, 2, tmp_path_factory.mktemp("ranks"), saved)


@pytest.mark.parametrize("name", list(CASES))
def test_two_gloo_ranks_give_the_logits_and_greedy_tokens_of_one(name, saved, two_ranks):
    one = outputs(load(saved[name], CASES[name][2]))
    for rank in two_ranks:
        got = rank[name]
        assert got["fused"] is (name.endswith("fused"))
        for key in ("full", "piecewise"):
            for g, want in zip(got[key], one[key], strict=True):
                torch.testing.assert_close(torch.tensor(g), torch.tensor(want), **TOL)
        assert got["greedy"] == one["greedy"] and all(len(t) == 8 for t in got["greedy"])
        assert got["piecewise_replays"] == one["piecewise_replays"] > 0
    assert two_ranks[0][name]["full"] == two_ranks[1][name]["full"]  # every rank, full logits


# -- loading: each rank its own part, and nothing else -------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_rank_reads_only_its_slices_and_holds_the_shards_of_the_whole_model(
    family, tmp_path, monkeypatch
):
    """Every split tensor comes from ``get_part`` (``get`` of it fails the test); the rank's
    tensors are exactly the whole model's parts (row-parallel biases zero off rank 0, the last
    rank's vocabulary rows past the end zero), and random weights drawn on a rank equal the
    same parts of the whole model's random weights."""
    config = small_config(family, vocab=127, kv_heads=1)
    path = save(tmp_path, family, vocab=127, kv_heads=1)
    whole = load_model(path, attn_implementation="eager").state_dict()
    get = CheckpointReader.get
    for rank in range(2):
        split = split_of(config, 2, rank)

        def whole_only(self, name, split=split):
            assert part_of(name, split).dim is None, f"{name} read whole"
            return get(self, name)

        monkeypatch.setattr(CheckpointReader, "get", whole_only)
        for source, random in ((path, False), (config, True)):
            part = load_tp_model(
                source, TPGroup(rank, 2), attn_implementation="eager", random_weights=random
            )
            assert part.config.vocab_size == 127
            for name, t in part.state_dict().items():
                p, w = part_of(name, split), whole[name]
                if p.zero:
                    w = torch.zeros_like(w)
                elif p.dim is not None:
                    w = w.narrow(p.dim, p.start, p.stop - p.start)
                    w = torch.cat([w, w.new_zeros(p.pad, *w.shape[1:])])
                assert torch.equal(t, w), (name, rank, random)
        monkeypatch.setattr(CheckpointReader, "get", get)
    q = part.model.layers[0].self_attn.q_proj.weight
    assert q.shape[0] == whole["model.layers.0.self_attn.q_proj.weight"].shape[0] // 2


@pytest.mark.parametrize(
    "changes,tp,match",
    [
        (
            dict(heads=4, kv_heads=2),
            3,
            r"tensor_parallel_size=3 does not divide num_attention_heads=4, "
            r"num_key_value_heads=2 \(nor is it a multiple of it\), intermediate_size=128: "
            r".*among \[1, 2, 4\]",
        ),
        (
            dict(heads=6, kv_heads=6, hidden=48),
            4,
            r"does not divide num_attention_heads=6, num_key_value_heads=6 \(nor",
        ),
    ],
)
def test_a_checkpoint_whose_heads_tp_does_not_divide_is_refused_by_name(
    tmp_path, changes, tp, match
):
    path = save(tmp_path, "llama", **changes)
    with pytest.raises(TensorParallelError, match=match):
        load(path, None, TPGroup(0, tp))


def test_fewer_kv_heads_than_ranks_replicate_each_to_the_ranks_of_its_query_heads(tmp_path):
    path = save(tmp_path, "llama", heads=8, kv_heads=2)  # head_dim 8; ranks 0-3 read KV head 0
    whole = load_model(path, attn_implementation="eager").model.layers[0].self_attn
    for rank, head in ((0, 0), (3, 0), (4, 1), (7, 1)):
        attn = load_tp_model(path, TPGroup(rank, 8), attn_implementation="eager")
        attn = attn.model.layers[0].self_attn
        assert torch.equal(attn.k_proj.weight, whole.k_proj.weight[head * 8 : head * 8 + 8])
        assert torch.equal(attn.q_proj.weight, whole.q_proj.weight[rank * 8 : rank * 8 + 8])
