"""Load a stock transformers causal LM for the paged adapter from a local directory, trusting none
of it and running none of its code:

1. ``config.json`` (a regular file, size-bounded) is refused if it asks for the repository's own
   code (``auto_map``), names an unsupported type, or holds a value no real model has (``config_check``);
2. the model is built on the meta device (no memory) to list the tensors it needs; the weight
   files' headers must hold exactly those (``weights.match``: missing, unexpected, wrong shape or
   dtype are named), tied weights counted once;
3. the weights plus the caller's KV cache are checked against the device's free memory;
4. only then is the model allocated (uninitialised, in ``dtype`` on ``device``) and every tensor
   copied from the checkpoint. Random weights from a seed only when asked (``random_weights``).

No network, no stdin: nothing here calls transformers' ``from_pretrained``."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..counter_hash import M32, mix32, seed_key
from .config_check import check_memory, check_values
from .errors import ModelConfigError, ModelLoadError, UnsupportedModelError
from .files import model_dir, read_json_object, refuse_remote_code
from .weights import CheckpointReader, find_weights, match, no_weights_message

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
# rope types whose frequencies are fixed at load (dynamic/longrope change with the sequence length)
STATIC_ROPE = ("default", "linear", "llama3")
# older checkpoints saved the rotary frequencies; the model recomputes them from the config
RECOMPUTED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def read_config(directory: Path) -> dict:
    """config.json's raw values, checked: no remote code, a supported type, bounded shape."""
    raw = read_json_object(directory, "config.json")
    if raw is None:
        raise ModelLoadError(
            f"{directory}: no config.json there; give a local model directory (config.json, "
            "model.safetensors or its shards, tokenizer files)"
        )
    _check_values(raw, directory / "config.json")
    return raw


def _check_values(values: dict, where) -> None:
    refuse_remote_code(where, values)
    model_type = values.get("model_type")
    if model_type not in SUPPORTED:
        archs = values.get("architectures")
        archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
        raise UnsupportedModelError(
            f"{where}: model type {_show(model_type)} ({', '.join(archs) or 'no architectures'}) "
            "is not supported by graphplan's paged adapter; supported: "
            f"{', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}"
        )
    check_values(values, where)


def _show(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def load_config(source):
    """A checked ``PretrainedConfig`` from a directory or its ``config.json`` path (or a copy of
    one passed in, checked the same way)."""
    import transformers

    if isinstance(source, transformers.PretrainedConfig):  # a copy: its attention is its own
        config = copy.deepcopy(source)
        _check_values(config.to_dict(), f"{type(config).__name__}")
        return config
    directory = model_dir(source)
    raw = read_config(directory)
    try:
        return getattr(transformers, CONFIGS[raw["model_type"]]).from_dict(raw)
    except Exception as e:  # transformers' field validation raises several kinds
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelConfigError(f"{directory / 'config.json'}: {first}") from None


def check_supported(config) -> None:
    """Raise UnsupportedModelError for anything the adapter would run wrongly."""
    name = f"{config.model_type!r} ({', '.join(config.architectures or []) or 'no architectures'})"
    if config.model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model type {name} is not supported by graphplan's paged adapter; supported: "
            f"{', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}"
        )
    archs = config.architectures or [SUPPORTED[config.model_type]]
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise UnsupportedModelError(f"model {name} is not a causal LM (needs a *ForCausalLM head)")
    if not getattr(config, "is_causal", True):
        raise UnsupportedModelError(f"model {name} sets is_causal=false (bidirectional attention)")
    if getattr(config, "use_sliding_window", False) or (
        config.model_type == "llama" and getattr(config, "sliding_window", None)
    ):
        raise UnsupportedModelError(
            f"model {name} uses sliding-window attention (sliding_window="
            f"{getattr(config, 'sliding_window', None)}); the paged adapter attends to the whole "
            "sequence: set use_sliding_window=false only if the checkpoint was trained that way"
        )
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise UnsupportedModelError(
            f"model {name} has layers of type {other}; the paged adapter "
            "runs only full_attention layers"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type: object = "default"  # whatever the config holds: checked just below
    if isinstance(rope, dict):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE:
        raise UnsupportedModelError(
            f"model {name} uses rope type {rope_type!r}; supported: {', '.join(STATIC_ROPE)}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    """What ``check_checkpoint`` found: everything ``load_model`` needs before it allocates."""

    config: object
    """The checked ``PretrainedConfig``."""
    where: str
    """The directory (or the config's class name) for messages."""
    expected: dict[str, tuple[int, ...]]
    """Every tensor the model needs (tied aliases left out), name -> shape."""
    params: int
    weight_bytes: int
    """Parameters and buffers in the load dtype."""
    reader: CheckpointReader | None
    """None: random weights were asked for."""


def check_checkpoint(
    source, *, dtype: torch.dtype = torch.float32, random_weights: bool = False
) -> Checkpoint:
    """Everything ``load_model`` checks before it allocates: the config, the architecture and
    the weight files' tensors (from their headers), with nothing allocated or executed."""
    import transformers

    config = load_config(source)
    check_supported(config)
    directory = None if isinstance(source, transformers.PretrainedConfig) else model_dir(source)
    meta = _build(config, dtype, torch.device("meta"), "eager")
    aliases: dict[str, str] = {}  # a tied name -> the name the checkpoint holds it under
    seen: dict[int, str] = {}  # id(parameter) -> its first name
    for name, p in meta.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # a tied weight: the checkpoint holds it once, under the first name
            aliases[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    expected = {n: tuple(t.shape) for n, t in meta.state_dict().items() if n not in aliases}
    tensors = [*meta.parameters(), *meta.buffers()]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    reader = None
    if not random_weights:
        if directory is None:
            raise ModelLoadError(
                f"a {type(config).__name__} object carries no weights: give the checkpoint's "
                "directory, or pass random_weights=True for weights drawn from the seed"
            )
        weights = find_weights(directory)
        if weights is None:
            raise ModelLoadError(no_weights_message(directory))
        reader = CheckpointReader(weights)
        match(expected, aliases, reader.infos, where=weights.where, ignored=RECOMPUTED.search)
        _check_ties(reader, aliases, weights.where)
    return Checkpoint(
        config=config,
        where=str(directory or type(config).__name__),
        expected=expected,
        params=sum(p.numel() for p in meta.parameters()),
        weight_bytes=weight_bytes,
        reader=reader,
    )


def _check_ties(reader: CheckpointReader, aliases: dict[str, str], where) -> None:
    from .errors import CheckpointMismatchError

    for alias, source in aliases.items():
        if alias in reader.infos and not torch.equal(reader.get(alias), reader.get(source)):
            raise CheckpointMismatchError(
                f"{where}: {alias} differs from {source}, but config.json's "
                f"tie_word_embeddings is true, so {source} would serve as both: set "
                "tie_word_embeddings to false"
            )


def _build(config, dtype: torch.dtype, device: torch.device, attn_implementation: str):
    """The model class of ``config``, uninitialised (weights are copied in or drawn after)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(config)  # from_config writes its dtype and attention into it
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=False
        )
    model.tie_weights()  # init_weights ties them, and no_init_weights skips it
    return model


def build_model(config, dtype: torch.dtype, device, attn_implementation: str):
    """``config``'s model class in ``dtype`` on ``device``, uninitialised (models/hf/tp_load.py
    builds a tensor-parallel rank's model with it)."""
    return _build(config, dtype, torch.device(device), attn_implementation)


def load_model(
    source,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attn_implementation: str,
    random_weights: bool = False,
    reserve_bytes: int = 0,
):
    """The model in eval mode, no grads, on ``device`` in ``dtype``, every tensor from the
    directory's checkpoint; with ``random_weights``, drawn from ``seed`` (``init_random``)
    instead. ``reserve_bytes``: what the caller allocates next (its KV cache), counted in the
    memory check."""
    from .attention import ATTN_IMPLEMENTATION, register

    if attn_implementation == ATTN_IMPLEMENTATION:
        register()
    ckpt = check_checkpoint(source, dtype=dtype, random_weights=random_weights)
    check_memory(
        weights=ckpt.weight_bytes,
        params=ckpt.params,
        kv=max(reserve_bytes, 0),
        dtype=dtype,
        device=device,
        config=ckpt.config,
        where=ckpt.where,
    )
    model = _build(ckpt.config, dtype, torch.device(device), attn_implementation)
    with torch.no_grad():
        if ckpt.reader is None:
            init_random(model, seed)
        else:
            targets = model.state_dict()
            for name in ckpt.expected:
                targets[name].copy_(ckpt.reader.get(name))
    return model.eval().requires_grad_(False)


_CHUNK = 1 << 22  # 32 MiB int64 temporaries: little for the allocator to keep
_IRWIN_HALL_MEAN = 2 * 0xFFFF  # of four 16-bit uniforms: mean 2 * 65535,
_IRWIN_HALL_STD = math.sqrt(4 * (0x10000**2 - 1) / 12)  # variance 4 * (65536**2 - 1) / 12


@torch.no_grad()
def init_random(model, seed: int) -> None:
    """Same weights for a seed on any device and dtype, drawn on the parameter's own device (an 8B
    model in about a second on a GPU, where a CPU generator takes a minute): element ``j`` of the
    ``i``-th parameter is the sum of four 16-bit words of a counter hash of (seed, i, j), centred
    and scaled to the parameter's std (Irwin-Hall, close to normal); the integer sum is exact in
    float32 and the scale one rounded multiply, so every device gives the same bits. Norm
    weights 1; embeddings std 1 (so the context, not only the last token, moves the argmax); every
    other weight and bias std 0.02. A tied head shares the embedding."""
    for name, p, std in random_params(model, seed):
        if std is None:
            p.fill_(1.0)
            continue
        flat = p.view(-1)
        if flat.numel() > M32:
            raise ModelLoadError(f"{name}: {flat.numel()} elements, more than random weights index")
        for lo in range(0, flat.numel(), _CHUNK):
            j = torch.arange(lo, min(lo + _CHUNK, flat.numel()), dtype=torch.int64, device=p.device)
            flat[lo : lo + j.numel()].copy_(random_values(std, j))


def random_params(model, seed: int):
    """(name, parameter, std or None for a norm weight of 1) for every parameter ``init_random``
    draws, ``std`` carrying the parameter's key (see ``random_values``); a tied head is listed
    once, as the embedding."""
    key = seed_key(seed)
    embed = model.get_input_embeddings().weight
    for i, (name, p) in enumerate(model.named_parameters()):
        if "norm" in name.split(".")[-2]:
            yield name, p, None
            continue
        p_key = mix32(key ^ mix32((i * 0x2545F491 + 0x68E31DA4) & M32))
        yield name, p, (1.0 if p is embed else 0.02, p_key)


def random_values(std, j: torch.Tensor) -> torch.Tensor:
    """float32 values of the elements at flat indices ``j`` (int64, on the parameter's device) of
    the parameter whose ``(std, key)`` ``random_params`` gave: the same for a whole parameter and
    for any part of it (a tensor-parallel shard draws only its own elements)."""
    std, p_key = std
    scale = torch.tensor(std / _IRWIN_HALL_STD, dtype=torch.float32, device=j.device)
    h1 = mix32(j ^ p_key)
    h2 = mix32(h1 ^ 0x5BD1E995)
    s = (h1 & 0xFFFF) + (h1 >> 16) + (h2 & 0xFFFF) + (h2 >> 16) - _IRWIN_HALL_MEAN
    return s.float() * scale


def eos_token_ids(source) -> tuple[int, ...]:
    """The model's end-of-sequence ids: ``generation_config.json``'s ``eos_token_id`` first, then
    ``config.json``'s (``source``: a directory or ``config.json`` path, or a ``PretrainedConfig``),
    each checked to be token ids of the vocabulary. Read from the files alone (regular files
    only), so the server knows them before the weights load."""
    import transformers

    from .config_check import token_ids
    from .files import read_json_object

    if isinstance(source, transformers.PretrainedConfig):
        eos = getattr(source, "eos_token_id", None)
        return token_ids(eos, "eos_token_id", type(source).__name__, source.vocab_size)
    directory = model_dir(source)
    config = read_config(directory)
    where, eos = directory / "generation_config.json", None
    generation = read_json_object(directory, "generation_config.json") or {}
    eos = generation.get("eos_token_id")
    if eos is None:
        where, eos = directory / "config.json", config.get("eos_token_id")
    return token_ids(eos, "eos_token_id", where, config["vocab_size"])


def load_tokenizer(source):
    """The checkpoint directory's tokenizer, or None when it has no tokenizer files (ids-only
    serving); its files are checked first and every failure is a ModelLoadError naming them.
    Local files only, no repository code (``tokenizer_files``)."""
    from .tokenizer_files import load

    return load(model_dir(source))
