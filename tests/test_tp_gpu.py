"""Tensor parallelism on 2 and 4 GPUs (each size skips without its GPUs): an 8B-shaped Llama (hidden
4096, 32 heads, 8 KV heads, intermediate 14336, vocabulary 128,256; 2 layers, random weights drawn
directly sharded on each rank) over NCCL, the all-reduces and the LM head's all-gather captured
inside FULL and FULL_AND_PIECEWISE graphs: TP=2 and TP=4 logits of decode and mixed steps within
the bf16 bound (2% of the largest logit, as hf_models.bf16_errors) of TP=1 on the same weights, and
every row's greedy pick equal to TP=1's or a near-tie: its TP=1 logit within that bound of the
row's best (a random 128,256-word head has top-2 gaps of that size, and one of 9 rows differed at
TP=4); the same with the all-reduces by torch symmetric memory, one-shot and two-shot
(models/hf/tp_symm.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _run(model, mode: str) -> list[torch.Tensor]:
    from graphplan.compiler import compile_plan
    from graphplan.runtime import GraphRunner

    from hf_models import mixed_plan, mixed_schedule, run_schedule, tokens

    runner = GraphRunner(
        model, compile_plan(mixed_plan(mode, max_tokens=32)), model.static_inputs(), progress=False
    )
    runner.capture()
    steps, _ = mixed_schedule((13, 9, 5), prompts=(8, 6, 1), budget=8, seed=3)
    seqs = [tokens(n, seed=40 + i, vocab=128256) for i, n in enumerate((13, 9, 5))]
    out = [t.float().cpu() for t in run_schedule(model, runner, seqs, steps)]
    for seat in range(3):
        model.release(seat)
    return out


def _load(tp=None):
    from graphplan.models.hf import PagedCausalLM

    return PagedCausalLM.load(
        _config(),
        max_num_seqs=4,
        max_model_len=64,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        random_weights=True,
        kv_cache_tokens=256,
        tp=tp,
    )


def _rank(rank: int, world: int, symm: bool = False, modes=("FULL", "FULL_AND_PIECEWISE")):
    import torch.distributed as dist

    from graphplan.models.hf.tp import TPGroup
    from graphplan.models.hf.tp_symm import symm_reducer

    reducer = symm_reducer(dist.group.WORLD, torch.device("cuda", rank)) if symm else None
    model = _load(TPGroup(rank, world, dist.group.WORLD, reducer))
    result: dict = {"symm": reducer is not None}
    for mode in modes:
        got = _run(model, mode)
        if rank == 0:
            one = _run(_load(), mode)
            rows = []
            for g, w in zip(got, one, strict=True):
                top = w.abs().max().item()
                # how far below TP=1's best logit TP's pick lies (0 where the argmax agrees)
                pick = w.gather(-1, g.argmax(-1, keepdim=True)).squeeze(-1)
                short = (w.max(-1).values - pick).max().item()
                rows.append(((g - w).abs().max().item(), 0.02 * top, short))
            result[mode] = rows
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_tp_logits_of_an_8b_shape_are_within_bf16_of_tp1_full_and_piecewise(tmp_path, world):
    """TP=2, and TP=4 (2 of the 8 KV heads and 8 of the 32 query heads a rank) where 4 GPUs are."""
    from test_dp_gpu import _spawn  # NCCL ranks, multicast off

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    result = _spawn(_rank, tmp_path, world=world)[0]
    for mode in ("FULL", "FULL_AND_PIECEWISE"):
        for err, bound, short in result[mode]:
            assert err <= bound and short <= bound, (mode, err, bound, short)


@pytest.mark.parametrize("algo", ["one_shot", "two_shot"])
@pytest.mark.parametrize("world", [2, 4])
def test_tp_with_symmetric_memory_all_reduce_is_within_bf16_of_tp1(
    tmp_path, world, algo, monkeypatch
):
    """As the server runs it (server/core/tp_worker.tp_group): symmetric memory in FULL graphs and
    in the pieces of FULL_AND_PIECEWISE ones; these steps' messages are <= 64 KiB, so auto would
    take one-shot for all of them: each algorithm is forced once."""
    from test_dp_gpu import _spawn

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    monkeypatch.setenv("GRAPHPLAN_TP_SYMM_ALGO", algo)  # the spawned ranks inherit it
    result = _spawn(_rank, tmp_path, True, world=world)[0]
    if not result["symm"]:
        pytest.skip("torch symmetric memory is unavailable on these GPUs")
    for mode in ("FULL", "FULL_AND_PIECEWISE"):
        for err, bound, short in result[mode]:
            assert err <= bound and short <= bound, (mode, err, bound, short)
