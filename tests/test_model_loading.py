"""Model loading that cannot be tricked (issue 26): a checkpoint directory either loads exactly its
checkpoint's weights or is refused before anything is allocated, with an error naming the file and
the key; nothing from the directory runs, stdin is never read, only regular files inside the
directory are opened. Checkpoints are small Llama / Qwen2 / Qwen3 models written by transformers'
save_pretrained (or torch.save for .bin), tokenizers built with ``tokenizers``."""

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from graphplan.models.hf import (
    CheckpointMismatchError,
    ModelConfigError,
    ModelLoadError,
    ModelMemoryError,
    PagedCausalLM,
    RemoteCodeError,
    UnsupportedModelError,
    load_model,
    load_tokenizer,
)
from graphplan.models.hf import load as load_module
from graphplan.models.hf.config_check import SHAPE, check_values
from graphplan.server.core.hf_model import HFSpec

from hf_models import FAMILIES, small_config, write_model_dir, write_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PLAN = (
    "version: 1\nname: hf-t\nscheduler: {max_num_seqs: 2, max_num_batched_tokens: 16}\n"
    "cudagraph: {mode: FULL_DECODE_ONLY, attention_support: ALWAYS, capture_sizes: [1, 2]}\n"
)
FORMATS = ("safetensors", "sharded", "bin", "sharded-bin")
MARKER_CODE = "open({marker!r}, 'w').write('the repository code ran')\n"


@pytest.fixture(autouse=True)
def stdin_is_never_read(monkeypatch):
    def refuse(*_):
        raise AssertionError("stdin was consulted")

    monkeypatch.setattr("builtins.input", refuse)


def forbid_allocation(monkeypatch) -> None:
    """From now on, building a model anywhere but on the meta device fails the test."""
    build = load_module._build

    def meta_only(config, dtype, device, attn):
        assert torch.device(device).type == "meta", "a model was allocated"
        return build(config, dtype, device, attn)

    monkeypatch.setattr(load_module, "_build", meta_only)


def load(src, **kw):
    return PagedCausalLM.load(src, max_num_seqs=2, max_model_len=16, **kw)


def random_model(family: str, seed: int = 7, **config):
    return load_model(
        small_config(family, **config), seed=seed, attn_implementation="eager", random_weights=True
    )


def save(model, path: Path, fmt: str) -> Path:
    """The model's checkpoint in ``fmt``: save_pretrained (single or sharded safetensors), or
    torch.save of its state dict (transformers 5 writes no .bin), whole or in two shards."""
    path.mkdir(parents=True, exist_ok=True)
    if fmt in ("safetensors", "sharded"):
        model.save_pretrained(path, **({"max_shard_size": "40KB"} if fmt == "sharded" else {}))
        assert (path / "model.safetensors.index.json").is_file() == (fmt == "sharded")
        return path
    model.config.save_pretrained(path)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if fmt == "bin":
        torch.save(sd, path / "pytorch_model.bin")
        return path
    names, wmap = list(sd), {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({n: sd[n] for n in part}, path / shard)
        wmap |= dict.fromkeys(part, shard)
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wmap}))
    return path


def written(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's weight files, read back independently."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(f)
    for f in sorted(path.glob("*.bin")):
        out |= torch.load(f, weights_only=True)
    return out


def edit_json(path: Path, **changes) -> None:
    obj = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            obj.pop(k, None)
        else:
            obj[k] = v
    path.write_text(json.dumps(obj))


# ---- weights: exactly the checkpoint's --------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_loads_exactly_its_weights(tmp_path, family, fmt):
    src = random_model(family)
    files = written(save(src, tmp_path, fmt))
    got = load(tmp_path).hf.state_dict()
    tied = src.config.tie_word_embeddings
    assert set(got) == set(src.state_dict())
    for name, want in src.state_dict().items():
        assert torch.equal(got[name], want), name
    for name, t in files.items():  # every tensor the files hold is the one served
        assert torch.equal(got[name], t), name
    assert ("lm_head.weight" in files) == (not tied or fmt in ("bin", "sharded-bin"))


def test_weights_load_in_the_asked_dtype_and_agree_with_transformers_own_loader(tmp_path):
    from transformers import AutoModelForCausalLM

    src = random_model("qwen2")
    save(src, tmp_path, "sharded")
    got = load(tmp_path, dtype=torch.bfloat16).hf.state_dict()
    for name, want in src.state_dict().items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want.bfloat16()), name
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).state_dict()
    ours = load(tmp_path).hf.state_dict()
    assert set(theirs) == set(ours)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name


def test_a_directory_without_weights_is_refused_unless_random_weights_are_asked_for(tmp_path):
    small_config("llama").save_pretrained(tmp_path)
    (tmp_path / "consolidated.00.pth").write_bytes(b"")
    with pytest.raises(ModelLoadError) as e:
        load(tmp_path)
    msg = str(e.value)
    assert "no weights: expected model.safetensors, model.safetensors.index.json, " in msg
    assert "pytorch_model.bin" in msg and "found only consolidated.00.pth" in msg
    assert "--random-weights" in msg
    with pytest.raises(ModelLoadError, match="no weights"):
        HFSpec(model=str(tmp_path)).check()
    HFSpec(model=str(tmp_path), random_weights=True).check()
    assert load(tmp_path, random_weights=True, seed=3).cfg.vocab_size == 128


def test_random_weights_are_a_pure_function_of_the_seed_in_any_dtype():
    """init_random: the same seed gives the same float32 bits (and their bf16 rounding), another
    seed other weights; norms 1, embeddings std 1, the rest std 0.02, centred, no two rows alike
    (an element's counter, not its position in a repeated block, decides it)."""
    a, b = random_model("qwen3", seed=5), random_model("qwen3", seed=5)
    bf = load_model(small_config("qwen3"), seed=5, attn_implementation="eager",
                    random_weights=True, dtype=torch.bfloat16)  # fmt: skip
    other = random_model("qwen3", seed=6)
    for (name, p), q, r, o in zip(a.named_parameters(), b.parameters(), bf.parameters(),
                                  other.parameters()):  # fmt: skip
        assert torch.equal(p, q) and torch.equal(p.bfloat16(), r), name
        if "norm" in name.split(".")[-2]:
            assert torch.equal(p, torch.ones_like(p)) and torch.equal(o, p), name
            continue
        std = 1.0 if "embed" in name else 0.02
        assert not torch.equal(p, o), name
        assert abs(p.std().item() - std) < 0.1 * std and abs(p.mean().item()) < 0.1 * std, name
        assert p.abs().max().item() <= 3.47 * std, name  # four 16-bit words: within sqrt(12) std
        if p.dim() == 2:
            assert torch.unique(p, dim=0).shape[0] == p.shape[0], name


# ---- weights: mismatches are named ------------------------------------------------------------


def test_missing_and_unexpected_tensors_are_named_with_a_count(tmp_path):
    save(random_model("llama"), tmp_path, "safetensors")
    sd = load_file(tmp_path / "model.safetensors")
    gone = sorted(n for n in sd if n.startswith("model.layers.1."))  # 9 tensors
    for n in gone:
        del sd[n]
    sd["model.layers.7.mlp.up_proj.weight"] = torch.zeros(2, 2)
    sd["model.rotary_emb.inv_freq"] = torch.zeros(8)  # older checkpoints: recomputed, tolerated
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError) as e:
        load(tmp_path)
    msg = str(e.value)
    assert (
        f"model.safetensors: the weights do not match config.json: {len(gone)} tensors missing: "
        in msg
    )
    shown = msg.split("tensors missing: ")[1].split(f", and {len(gone) - 4} more.")[0]
    assert len(shown.split("; ")) == 4 and set(shown.split("; ")) <= set(gone)
    assert "1 tensors unexpected: model.layers.7.mlp.up_proj.weight" in msg
    assert "inv_freq" not in msg
    with pytest.raises(CheckpointMismatchError, match="9 tensors missing"):
        HFSpec(model=str(tmp_path)).check()  # the server refuses before capturing


@pytest.mark.parametrize(
    "name, tensor, match",
    [
        (
            "model.embed_tokens.weight",
            torch.zeros(100, 64),
            r"1 tensors with the wrong shape: model.embed_tokens.weight: \[100, 64\] in "
            r"model.safetensors, the config needs \[128, 64\]",
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            torch.zeros(64, 64, dtype=torch.int32),
            "1 tensors not float16/bfloat16/float32 .quantized checkpoints are not supported.: "
            "model.layers.0.self_attn.q_proj.weight: I32",
        ),
        (
            "lm_head.weight",
            None,
            r"\(config.json's tie_word_embeddings is false\): 1 tensors missing: lm_head.weight",
        ),
    ],
)
def test_a_tensor_of_the_wrong_shape_or_dtype_or_a_missing_head_is_named(
    tmp_path, name, tensor, match
):
    save(random_model("llama"), tmp_path, "safetensors")
    sd = load_file(tmp_path / "model.safetensors")
    if tensor is None:
        del sd[name]
    else:
        sd[name] = tensor
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match=match):
        load(tmp_path)


def test_a_tied_head_that_differs_from_the_embedding_is_refused(tmp_path):
    save(random_model("qwen2"), tmp_path, "bin")  # tied: the .bin holds lm_head.weight too
    sd = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(
        CheckpointMismatchError,
        match="lm_head.weight differs from model.embed_tokens.weight, but config.json's "
        "tie_word_embeddings is true",
    ):
        load(tmp_path)


def test_a_sharded_index_must_agree_with_its_shards_and_stay_in_the_directory(tmp_path):
    save(random_model("llama"), tmp_path, "sharded")
    index = tmp_path / "model.safetensors.index.json"
    wmap = json.loads(index.read_text())["weight_map"]
    shards = sorted(set(wmap.values()))
    moved = next(n for n, f in wmap.items() if f == shards[0])
    index.write_text(json.dumps({"weight_map": {**wmap, moved: shards[1]}}))
    with pytest.raises(
        ModelLoadError, match=f"the index does not match its shards for 1 tensors: {moved}"
    ):
        load(tmp_path)
    for bad in ("../outside.safetensors", "/etc/passwd", "nowhere.safetensors", "x.bin"):
        index.write_text(json.dumps({"weight_map": {**wmap, moved: bad}}))
        with pytest.raises(ModelLoadError, match="model.safetensors.index.json: "):
            load(tmp_path)
    index.write_text(json.dumps({"weight_map": ["not", "an", "object"]}))
    with pytest.raises(ModelLoadError, match="weight_map must be an object"):
        load(tmp_path)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_bin_checkpoint_is_unpickled_weights_only_so_its_code_never_runs(tmp_path):
    model_dir, marker = tmp_path / "m", tmp_path / "ran"
    save(random_model("llama"), model_dir, "bin")
    sd = torch.load(model_dir / "pytorch_model.bin", weights_only=True)
    with open(model_dir / "pytorch_model.bin", "wb") as f:
        torch.save({**sd, "evil": _RunsCode(marker)}, f, pickle_module=pickle)
    with pytest.raises(ModelLoadError, match="pytorch_model.bin: cannot read the weights: "):
        load(model_dir)
    assert not marker.exists()
    torch.save(list(sd.values()), model_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="holds a list, not a state dict"):
        load(model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"not a zip file")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin: cannot read the weights"):
        load(model_dir)


# ---- remote code: refused, never run ----------------------------------------------------------


def remote_code_dir(path: Path, marker: Path) -> Path:
    """A valid Llama checkpoint with a tokenizer, and Python files that leave ``marker`` if run."""
    save(random_model("llama"), path, "safetensors")
    write_tokenizer(path)
    for module in ("configuration_x", "modeling_x", "tokenization_x"):
        (path / f"{module}.py").write_text(MARKER_CODE.format(marker=str(marker)))
    return path


AUTO_MAP = {
    "AutoConfig": "configuration_x.XConfig",
    "AutoModelForCausalLM": "modeling_x.XForCausalLM",
}


@pytest.mark.parametrize("model_type", ["llama", "x-custom"])
def test_auto_map_in_config_json_is_refused_and_its_code_never_runs(tmp_path, model_type):
    d, marker = remote_code_dir(tmp_path / "m", tmp_path / "ran"), tmp_path / "ran"
    edit_json(d / "config.json", auto_map=AUTO_MAP, model_type=model_type)
    match = r"config.json: auto_map asks to run the repository's own Python code \(it points to "
    match += (
        r"configuration_x.py, modeling_x.py\); graphplan never runs code from a model directory"
    )
    for attempt in (
        lambda: load(d),
        lambda: HFSpec(model=str(d)).check(),
        lambda: load_tokenizer(str(d)),  # AutoTokenizer could follow config.json's auto_map
        lambda: load(d, random_weights=True),
    ):
        with pytest.raises(RemoteCodeError, match=match):
            attempt()
    assert not marker.exists()


def test_trust_remote_code_and_a_tokenizer_auto_map_are_refused(tmp_path):
    d, marker = remote_code_dir(tmp_path / "m", tmp_path / "ran"), tmp_path / "ran"
    edit_json(
        d / "tokenizer_config.json", auto_map={"AutoTokenizer": ["tokenization_x.XTok", None]}
    )
    match = r"tokenizer_config.json: auto_map asks to run .* \(it points to tokenization_x.py\)"
    with pytest.raises(RemoteCodeError, match=match):
        load_tokenizer(str(d))
    with pytest.raises(RemoteCodeError, match=match):
        HFSpec(model=str(d)).check()
    load(d)  # the model itself has no remote code
    edit_json(d / "config.json", trust_remote_code=True)
    with pytest.raises(RemoteCodeError, match="config.json: trust_remote_code asks to run"):
        load(d)
    assert not marker.exists()


# ---- hostile configs: refused before allocating -----------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_attention_heads": 0}, r"num_attention_heads=0 is outside \[1, 1024\]"),
        ({"vocab_size": 10**9}, r"vocab_size=1000000000 is outside \[1, 4194304\]"),
        (
            {"hidden_size": 10**40},
            r"hidden_size=1000000000000000000000000000000000000\.\.\. is outside",
        ),
        ({"num_hidden_layers": -2}, r"num_hidden_layers=-2 is outside \[1, 1024\]"),
        ({"num_attention_heads": "4"}, "num_attention_heads must be an integer, not '4'"),
        ({"hidden_size": 64.0}, "hidden_size must be an integer, not 64.0"),
        ({"intermediate_size": True}, "intermediate_size must be an integer, not True"),
        ({"vocab_size": ...}, "vocab_size is missing"),
        ({"hidden_size": 66, "head_dim": ...}, "hidden_size=66 is not a multiple of num_att"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value"),
        ({"head_dim": 15}, "the head dimension 15 is odd"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be a positive number, not -1"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"eos_token_id": [1, 10**6]}, r"eos_token_id must be a token id .* in \[0, 128\)"),
        (
            {"quantization_config": {"quant_method": "gptq"}},
            "quantization_config is set; quantized checkpoints are not",
        ),
        ({"max_position_embeddings": 1 << 40}, "max_position_embeddings=1099511627776 is out"),
    ],
)
def test_a_hostile_config_is_refused_before_anything_is_allocated(
    tmp_path, monkeypatch, changes, match
):
    save(random_model("llama"), tmp_path, "safetensors")
    edit_json(tmp_path / "config.json", **changes)
    forbid_allocation(monkeypatch)
    start = time.perf_counter()
    for attempt in (lambda: load(tmp_path), lambda: HFSpec(model=str(tmp_path)).check()):
        with pytest.raises(ModelConfigError, match=f"config.json: {match}"):
            attempt()
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"model_type": "llama", "rms_norm_eps": NaN}', "not valid JSON: NaN is not a number"),
        ('{"vocab_size": ' + "9" * 5000 + "}", "not valid JSON: Exceeds the limit"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON: nested too deeply|maximum recursion"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"model_type": 1', "not valid JSON: Expecting"),
        (b"\xff\xfe{}", "not UTF-8 text"),
        (" " * (5 << 20), r"5242880 bytes; at most 4194304 are read"),
        ('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}', "model type 'gpt2'"),
    ],
)
def test_a_config_json_that_is_not_a_config_is_refused_with_its_name(
    tmp_path, monkeypatch, text, match
):
    forbid_allocation(monkeypatch)
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ModelLoadError, match=f"config.json: {match}"):
        load(tmp_path)


def test_a_model_too_large_for_memory_is_refused_before_allocating(tmp_path, monkeypatch):
    save(random_model("llama"), tmp_path, "safetensors")  # small weights, for a huge KV cache
    forbid_allocation(monkeypatch)
    big = small_config(
        "llama", vocab=1 << 22, hidden=65536, layers=1024, heads=64, kv_heads=8, tied=False
    )
    big.intermediate_size = 1 << 20
    start = time.perf_counter()
    with pytest.raises(ModelMemoryError) as e:
        load(big, random_weights=True)
    msg = str(e.value)
    assert "vocab_size=4194304, hidden_size=65536, intermediate_size=1048576, " in msg
    assert "num_hidden_layers=1024" in msg and "GiB free" in msg
    with pytest.raises(ModelMemoryError, match=r"KV cache \d+\.\d\d GiB\) but cpu has"):
        load(tmp_path, kv_cache_tokens=10**12)
    assert time.perf_counter() - start < 30


HOSTILE = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 3, 65537, 1 << 22, (1 << 22) + 1]),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
    st.lists(st.integers(0, 8), max_size=2),
)


@st.composite
def configs(draw):
    """A plausible shape with up to three of its values replaced by hostile ones."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    values = {
        "vocab_size": draw(st.integers(1, 1 << 22)),
        "hidden_size": heads * draw(st.sampled_from([2, 4, 16, 64])),
        "intermediate_size": draw(st.integers(1, 1 << 20)),
        "num_hidden_layers": draw(st.integers(1, 1024)),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([None, 1, 2, 4, 8])),
        "head_dim": draw(st.sampled_from([None, 2, 64, 1024])),
        "max_position_embeddings": draw(st.sampled_from([None, 1, 1 << 24])),
    }
    for key in draw(st.sets(st.sampled_from(sorted(SHAPE)), max_size=3)):
        values[key] = draw(HOSTILE)
    return values


@settings(max_examples=300, deadline=None)
@given(configs())
def test_check_values_passes_only_bounded_consistent_shapes(values):
    """Whatever the values, check_values raises ModelConfigError or they make a buildable shape."""
    try:
        check_values(values, "config.json")
    except ModelConfigError as e:
        assert str(e).startswith("config.json: ")
        return
    for key, (lo, hi, required) in SHAPE.items():
        v = values[key]
        assert (v is None and not required) or (type(v) is int and lo <= v <= hi), key
    heads = values["num_attention_heads"]
    assert heads % (values["num_key_value_heads"] or heads) == 0
    head_dim = values["head_dim"] or values["hidden_size"] // heads
    assert values["head_dim"] or values["hidden_size"] == heads * head_dim
    assert head_dim % 2 == 0


# ---- files: regular files inside the directory only -------------------------------------------


def test_only_regular_files_inside_the_directory_are_read(tmp_path):
    d = save(random_model("llama"), tmp_path / "m", "safetensors")
    config = (d / "config.json").read_text()
    outside = tmp_path / "outside.json"
    outside.write_text(config)
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(outside)
    with pytest.raises(
        ModelLoadError, match=r"config.json: is a symlink to .*outside.json, outside"
    ):
        load(d)
    (d / "config.json").unlink()
    (d / "real-config.json").write_text(config)
    (d / "config.json").symlink_to("real-config.json")  # inside the directory: fine
    load(d)
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(d / "gone.json")
    with pytest.raises(ModelLoadError, match="config.json: is a dangling symlink"):
        load(d)
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    with pytest.raises(ModelLoadError, match="config.json: is a directory, where a file belongs"):
        load(d)
    (d / "config.json").rmdir()
    (d / "config.json").write_text(config)
    (d / "model.safetensors").rename(tmp_path / "weights")
    (d / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(ModelLoadError, match="model.safetensors: is a symlink to /dev/zero"):
        load(d)


@pytest.mark.parametrize(
    "name",
    ["model.safetensors", "config.json", "tokenizer.json", "generation_config.json", "extra"],
)
@pytest.mark.parametrize("loop", ["itself", "two links"])
def test_a_symlink_loop_in_place_of_any_file_is_a_one_line_error(tmp_path, capsys, name, loop):
    from graphplan.server.cli import main

    d = write_model_dir(tmp_path / "m")
    (d / name).unlink(missing_ok=True)
    if loop == "itself":
        (d / name).symlink_to(name)
    else:
        (d / name).symlink_to("other")
        (d / "other").symlink_to(name)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    capsys.readouterr()
    assert main(["--model", str(d), "--plan", str(plan), "--port", "0", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"server: {d}/"), err
    assert "is a symlink loop (its links lead back to themselves)" in err[0]


def test_a_model_directory_that_is_a_symlink_loop_is_a_one_line_error(tmp_path):
    link = tmp_path / "m"
    link.symlink_to("m")
    with pytest.raises(
        ModelLoadError, match=r"m: is a symlink that leads nowhere \(dangling, or a loop\)"
    ):
        load(link)


def test_a_model_given_by_its_config_json_is_named_after_its_directory(tmp_path):

    d = write_model_dir(tmp_path / "my-model")
    assert HFSpec(model=str(d / "config.json")).name == "my-model"
    assert HFSpec(model=f"{d}/").name == "my-model"
    assert HFSpec(model=str(d / "config.json"), served_model_name="x").name == "x"


def test_a_hugging_face_cache_snapshot_reads_its_blobs(tmp_path):
    """snapshots/REV/name -> ../../blobs/HASH, as huggingface_hub lays out its cache."""
    d = save(random_model("qwen3"), tmp_path / "src", "safetensors")
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in d.iterdir():
        f.rename(blobs / f"blob-{f.name}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"blob-{f.name}"))
    assert load(snap).cfg.vocab_size == 128


FIFO_SCRIPT = """
import os, sys
from pathlib import Path
from graphplan.models.hf import ModelLoadError, PagedCausalLM
from graphplan.models.hf import load_tokenizer
from graphplan.server.core.hf_model import HFSpec
d = Path(sys.argv[1])
for name in sys.argv[2:]:
    os.replace(d / name, d / (name + ".bak"))
    os.mkfifo(d / name)
    for what, call in (
        ("check", lambda: HFSpec(model=str(d)).check()),
        ("tokenizer", lambda: load_tokenizer(str(d))),
        ("load", lambda: PagedCausalLM.load(d, max_num_seqs=2, max_model_len=16)),
    ):
        try:
            call()
            print(name, what, "loaded", flush=True)
        except ModelLoadError as e:
            print(name, what, e, flush=True)
    os.unlink(d / name)
    os.replace(d / (name + ".bak"), d / name)
"""


def test_a_fifo_in_place_of_any_file_is_refused_without_blocking(tmp_path):
    d = write_model_dir(tmp_path / "m")
    names = ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors"]
    (d / "tokenizer.model").write_bytes(b"")  # read by nothing here; transformers might
    names.append("tokenizer.model")
    out = subprocess.run(
        [sys.executable, "-c", FIFO_SCRIPT, str(d), *names],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3 * len(names), out.stdout
    for line in lines:
        name, what = line.split()[:2]
        if what == "load" and name not in ("config.json", "model.safetensors"):
            assert line.endswith("loaded"), line  # the model reads only config and weights
        elif what == "tokenizer" and name == "model.safetensors":
            assert "is a FIFO" in line, line  # transformers may open any file there
        else:
            assert f"{name}: is a FIFO (named pipe); a model directory is read only" in line, line


# ---- tokenizer files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("tokenizer.json", "{not json", r"tokenizer.json: not valid JSON: Expecting"),
        ("tokenizer.json", "[]", "tokenizer.json: holds a JSON list, not an object"),
        ("tokenizer.json", '{"version": "1.0"}', "tokenizer.json: has no 'model' object"),
        ("tokenizer_config.json", "{", "tokenizer_config.json: not valid JSON"),
        ("tokenizer_config.json", '{"eos_token": 5}', "tokenizer_config.json: eos_token must be"),
        ("tokenizer_config.json", '{"chat_template": 3}', "chat_template must be a string or"),
        ("tokenizer_config.json", '{"model_max_length": "x"}', "model_max_length must be a num"),
        ("tokenizer_config.json", '{"tokenizer_class": ["a"]}', "tokenizer_class must be a str"),
        (
            "tokenizer_config.json",
            '{"added_tokens_decoder": {"x": {}}}',
            r"added_tokens_decoder\['x'\] must map a token id",
        ),
        ("special_tokens_map.json", "nope", "special_tokens_map.json: not valid JSON"),
    ],
)
def test_a_bad_tokenizer_file_is_an_error_naming_it(tmp_path, name, text, match):
    d = write_model_dir(tmp_path / "m")
    assert load_tokenizer(str(d)) is not None
    (d / name).write_text(text)
    with pytest.raises(ModelLoadError, match=match):
        load_tokenizer(str(d))
    with pytest.raises(ModelLoadError, match=match):
        HFSpec(model=str(d)).check()  # the server's check, before it listens


def test_what_transformers_still_refuses_in_a_tokenizer_is_an_error_naming_the_files(tmp_path):
    d = write_model_dir(tmp_path / "m")
    (d / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    with pytest.raises(
        ModelLoadError,
        match=r"m: cannot load the tokenizer \(tokenizer.json, tokenizer_config.json\): KeyError",
    ):
        load_tokenizer(str(d))


def test_generation_config_eos_ids_are_checked(tmp_path):
    d = write_model_dir(tmp_path / "m")
    edit_json(d / "generation_config.json", eos_token_id=[1, 2])
    assert HFSpec(model=str(d)).stop_token_ids() == (1, 2)
    d2 = write_model_dir(tmp_path / "m2")
    edit_json(d2 / "generation_config.json", eos_token_id="1")
    with pytest.raises(ModelConfigError, match="generation_config.json: eos_token_id must be"):
        HFSpec(model=str(d2)).check()


# ---- through the server CLI -------------------------------------------------------------------


def serve(model_dir: Path, tmp_path: Path, *extra: str, stdin=subprocess.DEVNULL, timeout=120):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    cmd = [sys.executable, "-m", "graphplan.server", "--model", str(model_dir), "--plan", str(plan)]
    cmd += ["--port", "0", "--device", "cpu", "--no-progress", *extra]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, stdin=stdin, cwd=tmp_path
    )


def test_the_server_refuses_remote_code_with_one_line_and_never_reads_stdin(tmp_path):
    d, marker = remote_code_dir(tmp_path / "m", tmp_path / "ran"), tmp_path / "ran"
    edit_json(d / "config.json", auto_map=AUTO_MAP)
    read_end, write_end = os.pipe()  # stdin that blocks a reader: nothing is ever written
    try:
        out = serve(d, tmp_path, stdin=read_end)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"server: {d / 'config.json'}: auto_map asks")
    assert not marker.exists()


def test_the_server_refuses_a_fifo_generation_config_without_hanging(tmp_path):
    d = write_model_dir(tmp_path / "m")
    (d / "generation_config.json").unlink()
    os.mkfifo(d / "generation_config.json")
    out = serve(d, tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"server: {d / 'generation_config.json'}: is a FIFO (named pipe); a model directory is "
        "read only from regular files"
    ]


@pytest.mark.parametrize(
    "breakage, match",
    [
        ("tokenizer", "tokenizer.json: not valid JSON"),
        ("tokenizer-content", "cannot load the tokenizer (tokenizer.json, tokenizer_config.json)"),
        ("tensors", "the weights do not match config.json: 1 tensors missing: model.norm.weight"),
        ("weights", "no weights: expected model.safetensors"),
        ("config", "config.json: num_attention_heads=0 is outside"),
    ],
)
def test_the_server_cli_prints_one_line_and_exits_1(tmp_path, capsys, breakage, match):
    from graphplan.server.cli import main

    d = write_model_dir(tmp_path / "m")
    if breakage == "tokenizer":
        (d / "tokenizer.json").write_text("{")
    elif breakage == "tokenizer-content":
        (d / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    elif breakage == "tensors":
        sd = load_file(d / "model.safetensors")
        del sd["model.norm.weight"]
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    elif breakage == "weights":
        (d / "model.safetensors").unlink()
    else:
        edit_json(d / "config.json", num_attention_heads=0)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    capsys.readouterr()
    assert main(["--model", str(d), "--plan", str(plan), "--port", "0", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("server: ") and match in err[0], err


def test_the_server_reports_a_model_too_large_for_memory_and_exits_1(tmp_path, capsys, caplog):
    from graphplan.server.cli import main

    d = write_model_dir(tmp_path / "m")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    argv = ["--model", str(d), "--plan", str(plan), "--port", "0", "--device", "cpu"]
    assert main([*argv, "--no-progress", "--kv-cache-tokens", str(10**12)]) == 1
    failed = [r for r in caplog.records if "start-up failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None  # one line, no traceback
    assert "ModelMemoryError: " in failed[0].getMessage() and "KV cache" in failed[0].getMessage()
    assert "Traceback" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--plan", str(plan), "--random-weights"])
    assert "--random-weights applies to --model" in capsys.readouterr().err


def test_unsupported_models_are_still_refused_as_before(tmp_path):
    small_config("qwen2", use_sliding_window=True, sliding_window=8).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        load(tmp_path, random_weights=True)


def test_text_files_a_tokenizer_reads_whole_are_size_bounded(tmp_path):
    d = write_model_dir(tmp_path / "m")
    (d / "additional_chat_templates").mkdir()
    big = d / "additional_chat_templates" / "tool_use.jinja"
    with open(big, "wb") as f:
        f.truncate(300 << 20)  # sparse: no disk used
    with pytest.raises(ModelLoadError, match=r"tool_use.jinja: 314572800 bytes; at most 268435456"):
        load_tokenizer(str(d))
    big.unlink()
    os.mkfifo(d / "merges.txt")
    with pytest.raises(ModelLoadError, match="merges.txt: is a FIFO"):
        load_tokenizer(str(d))
