"""LoRA adapters on the CPU: PEFT directories read and checked (hostile ones refused with a named
error), and a continuous batch mixing three adapters and the base model giving every request the
logits of transformers' forward with its adapter merged into the weights, through FULL and
FULL_AND_PIECEWISE graphs (CPU stand-in) of every LoRA case layout, each step replaying the graph
``plan explain`` names for its descriptor."""

import json

import pytest
import torch
from lora_adapters import LENS, STEPS, merged_model, plan, run_mixed, write_adapter
from safetensors.torch import save_file

from graphplan.compiler import compile_plan
from graphplan.models.hf import PagedCausalLM
from graphplan.models.hf.lora import AdapterError, read_adapter, tensor_name
from graphplan.models.hf.lora_slots import LoraSlotError
from graphplan.runtime import GraphRunner

from hf_models import reference_logits, reference_model, small_config, tokens


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    cfg = small_config("llama")
    root = tmp_path_factory.mktemp("adapters")
    return cfg, [
        write_adapter(root / "a", cfg, rank=4, seed=1),
        write_adapter(root / "b", cfg, rank=8, alpha=4.0, seed=2, rslora=True),
        write_adapter(root / "c", cfg, rank=2, seed=3, modules=("q_proj", "v_proj", "down_proj")),
    ]


@pytest.fixture(scope="module")
def model(adapters):
    cfg, dirs = adapters
    m = PagedCausalLM.load(
        cfg,
        max_num_seqs=4,
        max_model_len=32,
        block_size=4,
        random_weights=True,
        fused_ops=True,
        max_loras=3,
        max_lora_rank=8,
    )
    for name, d in zip("abc", dirs):
        m.lora.add(read_adapter(name, d, cfg, max_rank=8))
    return m


@pytest.fixture(scope="module")
def references(model, adapters):
    ref = reference_model(model)
    return [merged_model(ref, d) for d in adapters[1]] + [ref]


def test_the_schedule_runs_each_token_once():
    assert [sum(n for step in STEPS for j, n in step if j == i) for i in range(4)] == list(LENS)


CASES = [
    ("FULL", {}),
    ("FULL", {"specialize_count": False}),
    ("FULL_AND_PIECEWISE", {}),
    ("FULL_AND_PIECEWISE", {"separate_base": False}),
]


@pytest.mark.parametrize(("mode", "lora"), CASES, ids=[f"{m}-{o}" for m, o in CASES])
def test_mixed_adapters_give_each_request_its_merged_models_logits(model, references, mode, lora):
    table = compile_plan(plan(mode, **lora))
    runner = GraphRunner(model, table, model.static_inputs(), progress=False)
    runner.capture()
    seqs = [tokens(n, seed=20 + i) for i, n in enumerate(LENS)]
    got, seen = run_mixed(model, runner, table, seqs)
    for i, (seq, ref) in enumerate(zip(seqs, references)):
        torch.testing.assert_close(
            got[i], reference_logits(ref, seq), atol=1e-4, rtol=1e-4, msg=lambda m: f"req {i}: {m}"
        )
    assert [s[2] for s in seen] == [2, 3, 3, 0, 2, 1, 3]
    for want, replayed, _ in seen:  # every step replays the graph plan explain names, and only it
        assert want >= 0 and replayed == [want]
    cases = {table.graphs[w].key.num_active_loras for w, _, _ in seen}
    expect = {
        ("FULL", ()): {0, 1, 2, 4},
        ("FULL", ("specialize_count",)): {0, 4},
        ("FULL_AND_PIECEWISE", ()): {0, 1, 2, 4},
        ("FULL_AND_PIECEWISE", ("separate_base",)): {1, 2, 4},
    }[(mode, tuple(lora))]
    assert cases == expect
    runner.release()


def test_the_base_model_alone_gives_the_models_own_logits_and_differs_with_an_adapter(
    model, references
):
    table = compile_plan(plan("FULL"))
    runner = GraphRunner(model, table, model.static_inputs(), progress=False)
    runner.capture()
    seq = tokens(6, seed=5)
    with torch.no_grad():
        for name, ref in (("a", references[0]), (None, references[3])):
            model.release(0)
            model.lora.bind(0, name)
            reqs = [(0, 0, seq)]
            out = runner.step(model.make_batch(reqs), 1, 6, model.num_active_loras(reqs))
            torch.testing.assert_close(out, reference_logits(ref, seq), atol=1e-4, rtol=1e-4)
        for ref in references[:3]:  # every adapter moves the logits 100x past the tolerance
            assert (reference_logits(ref, seq) - out).abs().max() > 1e-2
    model.lora.bind(0, None)
    runner.release()


# ---- the LRU of device slots ---------------------------------------------------------------
def test_slots_hold_at_most_max_loras_and_evict_the_least_recently_used_idle_one(adapters, model):
    cfg, dirs = adapters
    lora = model.lora
    lora.assign([(s, None) for s in range(4)])
    lora.add(read_adapter("d", dirs[0], cfg, max_rank=8))
    for name in "abc":
        lora.acquire(name)
    assert list(lora.resident) == ["a", "b", "c"]
    lora.bind(0, "b")  # bound to a seat: kept
    lora.acquire("a")  # a is now the most recent
    slot_c = lora.resident["c"]
    assert lora.bind(1, "d") == slot_c and "c" not in lora.resident
    with pytest.raises(LoraSlotError, match="all 3 LoRA slots hold adapters in use"):
        lora.acquire("c", keep={"a", "b", "d"})
    assert lora.assign([(0, "c"), (1, "a"), (2, "a"), (3, None)]) == 2  # evicts b, the LRU
    assert lora.seat_slot == [lora.resident["c"], lora.resident["a"], lora.resident["a"], -1]
    assert set(lora.resident) == {"a", "c", "d"}
    with pytest.raises(LoraSlotError, match="a step with 4 adapters; at most 3"):
        lora.assign([(0, "a"), (1, "b"), (2, "c"), (3, "d")])
    lora.remove("d")
    assert "d" not in lora.adapters and "d" not in lora.resident
    lora.assign([(s, None) for s in range(4)])


# ---- hostile adapter directories ---------------------------------------------------------
def _read(path, cfg, max_rank=8):
    return read_adapter("x", path, cfg, max_rank=max_rank)


def test_a_good_adapter_reads_with_its_rank_scale_and_modules(adapters):
    cfg, dirs = adapters
    b = _read(dirs[1], cfg)
    assert (b.rank, b.scale, len(b.weights)) == (8, 4.0 / 8**0.5, 2 * 7)
    c = _read(dirs[2], cfg)
    assert (c.rank, c.scale, c.modules) == (2, 4.0, ("q_proj", "v_proj", "down_proj"))


def test_rank_over_the_limit_is_refused_naming_the_flag(adapters):
    cfg, dirs = adapters
    with pytest.raises(
        AdapterError,
        match=r"adapter_config.json: rank r=8 is over the limit of 4; serve with --max-lora-rank 8",
    ):
        _read(dirs[1], cfg, max_rank=4)


def test_wrong_shapes_and_missing_tensors_are_refused(tmp_path, adapters):
    cfg = adapters[0]
    a = tensor_name(1, "k_proj", "A")
    write_adapter(tmp_path / "shape", cfg, rank=4, shapes={a: (4, 32)})
    with pytest.raises(
        AdapterError,
        match=r"1 tensors with the wrong shape: .*k_proj.lora_A.weight: \[4, 32\] in adapter_model.safetensors, the config needs \[4, 64\]",
    ):
        _read(tmp_path / "shape", cfg)
    b = tensor_name(0, "down_proj", "B")
    write_adapter(tmp_path / "missing", cfg, rank=4, drop=b)
    with pytest.raises(
        AdapterError, match=r"do not match adapter_config.json: 1 tensors missing: " + b
    ):
        _read(tmp_path / "missing", cfg)
    write_adapter(tmp_path / "rank", cfg, rank=4, extra={"r": 2})
    with pytest.raises(AdapterError, match="wrong shape"):
        _read(tmp_path / "rank", cfg)


def test_a_pickle_adapter_is_refused_and_never_opened(tmp_path, adapters):
    cfg = adapters[0]
    d = tmp_path / "pickle"
    d.mkdir()
    (d / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    (d / "adapter_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'touch /tmp/pwned'\ntR.")
    with pytest.raises(
        AdapterError,
        match=r"no adapter_model.safetensors; found adapter_model.bin, a pickle that is never loaded",
    ):
        _read(d, cfg)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"peft_type": "PREFIX_TUNING"}, "peft_type 'PREFIX_TUNING'; only LORA"),
        ({"use_dora": True}, "use_dora is True; graphplan serves plain LoRA only"),
        ({"target_modules": ["lm_head"]}, r"target_modules \['lm_head'\] are not projections"),
        ({"target_modules": ".*proj"}, "is a pattern"),
        ({"r": 0}, "r 0: expected a positive integer"),
        ({"lora_alpha": "8"}, "lora_alpha '8': expected a positive number"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern is"),
    ],
)
def test_config_values_that_change_the_math_are_refused(tmp_path, adapters, change, message):
    cfg = adapters[0]
    write_adapter(tmp_path / "a", cfg, rank=4, extra=change)
    with pytest.raises(AdapterError, match=message):
        _read(tmp_path / "a", cfg)


def test_missing_dir_and_bad_json_and_float_types(tmp_path, adapters):
    cfg = adapters[0]
    with pytest.raises(AdapterError, match="is not a directory"):
        _read(tmp_path / "nope", cfg)
    d = write_adapter(tmp_path / "json", cfg, rank=4)
    (d / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match="holds a JSON list, not an object"):
        _read(d, cfg)
    d = write_adapter(tmp_path / "ints", cfg, rank=4, modules=("q_proj",))
    t = {
        tensor_name(i, "q_proj", ab): torch.zeros(
            (4, 64) if ab == "A" else (64, 4), dtype=torch.int32
        )
        for i in range(2)
        for ab in "AB"
    }
    save_file(t, str(d / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="not float16/bfloat16/float32"):
        _read(d, cfg)


def test_a_graph_of_lora_case_0_records_no_lora_kernels(model, references):
    """A descriptor of no active adapter replays a graph without LoRA kernels (separate_base): the
    same batch with its adapter bound but routed as case 0 gives the base model's logits."""
    table = compile_plan(plan("FULL"))
    runner = GraphRunner(model, table, model.static_inputs(), progress=False)
    runner.capture()
    seq = tokens(4, seed=6)
    model.release(0)
    model.lora.bind(0, "a")
    reqs = [(0, 0, seq)]
    with torch.no_grad():
        base = runner.step(model.make_batch(reqs), 1, 4, num_active_loras=0).clone()
        model.release(0)
        with_a = runner.step(model.make_batch(reqs), 1, 4, num_active_loras=1)
    torch.testing.assert_close(base, reference_logits(references[3], seq), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(with_a, reference_logits(references[0], seq), atol=1e-4, rtol=1e-4)
    model.lora.bind(0, None)
    runner.release()


# ---- plan import of the engines' LoRA flags -------------------------------------------------
@pytest.mark.parametrize(
    ("engine", "flags", "lora"),
    [
        (
            "vllm",
            "--enable-lora --max-loras 3 --max-lora-rank 64 --lora-modules a=/x b=/y",
            {"enabled": True, "max_loras": 3, "specialize_count": False, "separate_base": True},
        ),
        (
            "sglang",
            "--enable-lora --max-loras-per-batch 2 --max-lora-rank 16 --lora-paths a=/x",
            {"enabled": True, "max_loras": 2, "specialize_count": False, "separate_base": False},
        ),
    ],
)
def test_plan_import_of_served_lora_flags_fills_the_lora_block(engine, flags, lora):
    from graphplan.compiler.engines import import_plan
    from graphplan.server.core.lora_serving import LoraSettings, settings

    out = import_plan(engine, args=flags)
    assert out.plan["lora"] == lora
    notes = " ".join(d.message for d in out.diagnostics)
    assert "do not shape CUDA graphs, ignored" in notes and "--max-lora-rank" in notes
    table = compile_plan(out.plan)
    top = 1 + lora["max_loras"]  # no count specialisation: one LoRA case, max_loras + 1
    assert list(table.settings.lora_cases) == ([0, top] if lora["separate_base"] else [top])
    assert settings(table, (("a", "/x"),), None, 64) == LoraSettings(lora["max_loras"], 64)


def test_the_triton_kernels_equal_the_torch_path_under_tritons_interpreter():
    from interpreted import run_interpreted

    run_interpreted("lora_interpreted.py")


def test_an_oversized_weights_file_is_refused_before_it_is_opened(tmp_path, adapters):
    cfg = adapters[0]
    d = write_adapter(tmp_path / "big", cfg, rank=4, modules=("q_proj",))
    (d / "adapter_model.safetensors").write_bytes(b"\0" * (2 << 20))
    with pytest.raises(AdapterError, match=r"adapter_model.safetensors: 2097152 bytes; at most"):
        _read(d, cfg)
