"""graphplan.models.hf on the CPU (fp32, small random configs of Llama, Qwen2 with biased qkv and
tied embeddings, Qwen3 with q/k norms): continuous batches mixing prefill chunks and decodes give
every request the logits of the model's own forward over its whole sequence; uniform decodes replay
FULL graphs (CPU stand-in), mixed batches run eager; loading, refusals and KV-cache sizing."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CPU_FREE_BYTES

from graphplan.compiler import compile_plan
from graphplan.models.hf import (
    KVCacheSizeError,
    ModelLoadError,
    PagedCausalLM,
    UnsupportedModelError,
)
from graphplan.models.paged_kv import BlockTables
from graphplan.runtime import GraphRunner

from hf_models import (
    FAMILIES,
    LENS,
    STEPS,
    generated,
    plan,
    reference_logits,
    reference_model,
    run_schedule,
    serve_greedy,
    small_config,
    tokens,
)

ROOT = Path(__file__).resolve().parents[1]
TABLE = compile_plan(plan())


def build(family: str, seed: int = 0, **cache):
    model = PagedCausalLM.load(
        small_config(family),
        max_num_seqs=4,
        max_model_len=32,
        block_size=4,
        seed=seed,
        random_weights=True,
        **cache,
    )
    runner = GraphRunner(model, TABLE, model.static_inputs(), progress=False)
    runner.capture()
    return model, runner


def run(model, runner, seqs):
    for seat in range(len(seqs)):  # a fresh schedule: every seat starts a new sequence
        model.release(seat)
    return run_schedule(model, runner, seqs, STEPS)


@pytest.fixture(scope="module", params=FAMILIES)
def built(request):
    model, runner = build(request.param)
    return model, runner, reference_model(model)


def test_schedule_runs_each_token_once():
    for i, n in enumerate(LENS):
        assert sum(k for step in STEPS for j, k in step if j == i) == n


def test_every_requests_logits_equal_the_models_own_forward_over_its_sequence(built):
    model, runner, ref = built
    seqs = [tokens(n, seed=10 + i) for i, n in enumerate(LENS)]
    before = runner.stats()
    got = run(model, runner, seqs)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(
            got[i],
            reference_logits(ref, seq),
            atol=1e-4,
            rtol=1e-4,
            msg=lambda m: f"request {i}: {m}",
        )
    stats = runner.stats()
    full = stats["replays_by_mode"]["FULL"] - before["replays_by_mode"]["FULL"]
    eager = sum(stats["eager_steps"].values()) - sum(before["eager_steps"].values())
    assert (full, eager) == (6, 2)
    assert {g["num_tokens"] for g in stats["graphs"]} == {1, 2, 4}


def test_changing_a_requests_earlier_token_changes_its_logits_and_no_other_requests(built):
    model, runner, _ = built
    seqs = [tokens(n, seed=10 + i) for i, n in enumerate(LENS)]
    base = run(model, runner, seqs)
    changed = [list(s) for s in seqs]
    changed[1][2] = (changed[1][2] + 1) % 128
    got = run(model, runner, changed)
    assert torch.equal(got[1][:2], base[1][:2])  # before the change: causal
    assert all((got[1][p] - base[1][p]).abs().max() > 1e-3 for p in range(2, LENS[1]))
    for i in (0, 2):  # batched with the change, never reading it
        assert torch.equal(got[i], base[i]), f"request {i} moved when request 1 changed"


def test_greedy_continuous_batching_equals_transformers_generate(built):
    """The batcher (server/core/batching.py) over the runner, against transformers' generate."""
    from graphplan.server.core.batching import ContinuousBatcher

    model, runner, ref = built
    prompts = [tokens(n, seed=30 + n) for n in (7, 3, 11)]
    batcher = ContinuousBatcher(max_num_seqs=4, token_budget=8, max_model_len=32, num_cache_rows=4)
    serve_greedy(model, runner, batcher, prompts, 6)
    for i, p in enumerate(prompts):
        assert batcher.finished[i] == generated(ref, p, 6), f"prompt {i}"


# ---- loading ------------------------------------------------------------------------------


def test_a_model_directory_loads_its_safetensors_offline(tmp_path):
    from hf_models import reference_model as _ref

    src = PagedCausalLM.load(
        small_config("qwen2"), max_num_seqs=2, max_model_len=16, seed=3, random_weights=True
    )
    _ref(src).save_pretrained(tmp_path)  # config.json + model.safetensors
    assert list(tmp_path.glob("*.safetensors"))
    loaded = PagedCausalLM.load(tmp_path, max_num_seqs=2, max_model_len=16, seed=99)
    for (name, a), (_, b) in zip(src.hf.state_dict().items(), loaded.hf.state_dict().items()):
        assert torch.equal(a, b), name  # the file's weights, not the seed's


def test_a_config_alone_is_refused_unless_random_weights_are_asked_for(tmp_path):
    small_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no weights: expected model.safetensors"):
        PagedCausalLM.load(tmp_path, max_num_seqs=2, max_model_len=16)
    with pytest.raises(ModelLoadError, match="carries no weights.*random_weights=True"):
        PagedCausalLM.load(small_config("llama"), max_num_seqs=2, max_model_len=16)
    a, b, c = (
        PagedCausalLM.load(src, max_num_seqs=2, max_model_len=16, seed=seed, random_weights=True)
        for src, seed in ((tmp_path / "config.json", 1), (tmp_path, 1), (tmp_path, 2))
    )
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.hf.state_dict()[w], b.hf.state_dict()[w])
    assert not torch.equal(a.hf.state_dict()[w], c.hf.state_dict()[w])


def test_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        PagedCausalLM.load(tmp_path, max_num_seqs=2, max_model_len=16)
    with pytest.raises(ModelLoadError, match="no such directory"):
        PagedCausalLM.load(tmp_path / "nowhere", max_num_seqs=2, max_model_len=16)


@pytest.mark.parametrize(
    "family, extra, match",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope type 'dynamic'",
        ),
    ],
)
def test_unsupported_attention_features_are_refused_at_load(family, extra, match):
    with pytest.raises(UnsupportedModelError, match=match):
        PagedCausalLM.load(small_config(family, **extra), max_num_seqs=2, max_model_len=16)


def test_an_unsupported_architecture_is_refused_at_load():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="'gpt2'.*supported: llama"):
        PagedCausalLM.load(
            GPT2Config(n_layer=1, n_embd=32, n_head=2), max_num_seqs=2, max_model_len=16
        )


# ---- KV cache -----------------------------------------------------------------------------


def load_random(cfg, **kw):
    return PagedCausalLM.load(cfg, random_weights=True, **kw)


def test_a_kv_pool_smaller_than_one_sequence_is_an_error_and_one_sequence_is_enough():
    with pytest.raises(KVCacheSizeError, match=r"one sequence of max_model_len=32 needs 8 blocks"):
        load_random(
            small_config("llama"),
            max_num_seqs=4,
            max_model_len=32,
            block_size=4,
            kv_cache_tokens=28,
        )
    # blocks are handed out on demand: 4 seats share a pool of one sequence's blocks
    m = load_random(
        small_config("llama"), max_num_seqs=4, max_model_len=32, block_size=4, kv_cache_tokens=32
    )
    assert m.cfg.num_blocks == 8 and m.kv_pool.num_free() == 8


def test_the_default_pool_holds_every_seat_at_its_longest_when_memory_allows(monkeypatch):
    from graphplan.models import paged_kv

    m = load_random(small_config("llama"), max_num_seqs=4, max_model_len=32, block_size=4)
    assert m.cfg.num_blocks == 4 * 8
    # with little free memory, the default is what fits (less the headroom), not a refusal
    per_block = m.cache.shape.bytes_per_token * 4
    monkeypatch.setattr(paged_kv, "free_memory_bytes", lambda device: 21 * per_block)
    m = load_random(small_config("llama"), max_num_seqs=4, max_model_len=32, block_size=4)
    assert m.cfg.num_blocks == int(21 * per_block * 0.9) // per_block - 1 == 17


def test_every_test_sees_the_same_free_cpu_memory_and_threads_whatever_the_host():
    """conftest.host_independent: what a KV cache is sized from, and how many threads reduce."""
    from graphplan.models import paged_kv
    from graphplan.models.hf import config_check

    assert paged_kv.free_memory_bytes("cpu") == CPU_FREE_BYTES
    assert config_check.free_memory_bytes(torch.device("cpu")) == CPU_FREE_BYTES
    assert torch.get_num_threads() == 2


def test_kv_cache_sized_from_a_token_budget_or_a_memory_fraction():
    cfg = small_config("llama")
    m = load_random(cfg, max_num_seqs=4, max_model_len=32, block_size=4, kv_cache_tokens=400)
    assert m.cfg.num_blocks == 100 and m.cache.kv.shape[2] == 101  # + the padding block
    m = load_random(
        cfg, max_num_seqs=4, max_model_len=32, block_size=4, kv_memory_fraction=1e-5
    )  # of the free memory every test sees (conftest.CPU_FREE_BYTES): 168 KiB
    per_block = m.cache.shape.bytes_per_token * 4
    assert m.cfg.num_blocks == int(CPU_FREE_BYTES * 1e-5) // per_block - 1 == 82
    with pytest.raises(KVCacheSizeError, match="memory fraction 1e-12 of"):
        load_random(cfg, max_num_seqs=4, max_model_len=32, kv_memory_fraction=1e-12)
    with pytest.raises(KVCacheSizeError, match="not both"):
        load_random(
            cfg, max_num_seqs=4, max_model_len=32, kv_cache_tokens=400, kv_memory_fraction=0.1
        )


def test_block_tables_grow_by_block_and_recycle_a_seats_blocks_on_a_new_sequence():
    t = BlockTables(num_blocks=6, block_size=4, num_seats=2, max_blocks_per_seq=3)
    t.reserve(0, 0, 5)
    assert t.slots(0, 0, 5) == [0, 1, 2, 3, 4] and t.row(0) == [0, 1, 6]
    t.reserve(1, 0, 2)
    t.reserve(0, 5, 4)  # positions 5..8: a third block
    assert t.row(0) == [0, 1, 3] and t.slots(0, 8, 1) == [12]
    t.reserve(0, 0, 1)  # a new sequence on seat 0
    assert t.num_free() == 6 - 2 and t.row(1) == [2, 6, 6]
    with pytest.raises(KVCacheSizeError, match="exceed"):
        t.reserve(1, 2, 11)


def test_padding_rows_write_only_the_padding_block():
    model, runner = build("llama")
    runner.step(model.make_batch([(0, 0, [5]), (1, 0, [1, 2, 3]), (2, 0, [4])]), 3, 3)
    kv_before = model.cache.kv.clone()
    replays = runner.stats()["replays_by_mode"]["FULL"]
    # 3 decodes replay the FULL graph of 4: one padded token and one padded request
    runner.step(model.make_batch([(0, 1, [6]), (1, 3, [7]), (2, 1, [8])]), 3, 1)
    assert runner.stats()["replays_by_mode"]["FULL"] == replays + 1
    changed = (model.cache.kv != kv_before).flatten(3).any(-1)  # [layers, 2, blocks + 1, slot]
    touched = {int(b) for b in changed.nonzero()[:, 2]}
    real = {model.tables.row(seat)[0] for seat in range(3)}
    assert touched == real | {model.cache.pad_block}


# ---- import boundary ----------------------------------------------------------------------


def test_the_runtime_and_models_import_without_transformers_and_hf_names_the_extra():
    block = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'safetensors'):\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    code = block + (
        "import graphplan.runtime, graphplan.models.paged_kv\n"
        "try:\n    import graphplan.models.hf\n"
        "except ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "ERR graphplan.models.hf needs transformers" in out.stdout
    assert "pip install 'graphplan[hf]'" in out.stdout


def test_the_hf_benchmark_program_runs_on_the_cpu(tmp_path, capsys):
    """bench/hf_bench.py's graphplan path at smoke size (the GPU run compares the baselines)."""
    import hf_bench

    out, table = tmp_path / "hf.md", tmp_path / "table.json"
    TABLE.save(table)
    assert (
        hf_bench.main(
            [
                "--device",
                "cpu",
                "--smoke",
                "--systems",
                "graphplan",
                "--requests",
                "4",
                "--new-tokens",
                "3",
                "--plan",
                str(table),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = out.read_text()
    assert "| graphplan | 12 |" in text and "FULL replays" in text
