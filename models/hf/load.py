"""Load a stock transformers causal LM for the paged adapter, with no network access: a local
directory's ``config.json`` + ``*.safetensors``, or a ``config.json`` alone with random weights
drawn from a seed. What the adapter cannot run is refused here, before any weight is read."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from graphplan.compiler.errors import GraphplanError

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# rope types whose frequencies are fixed at load (dynamic/longrope change with the sequence length)
STATIC_ROPE = ("default", "linear", "llama3")


class UnsupportedModelError(GraphplanError):
    """The checkpoint uses an architecture or attention feature the paged adapter cannot run."""


class ModelLoadError(GraphplanError):
    """The model directory is missing or unreadable."""


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach for the Hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_config(source):
    """A ``PretrainedConfig`` from a directory or a ``config.json`` path (or one passed through)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):  # a copy: the model's attention setting is its own
        return copy.deepcopy(source)
    _offline()
    path = Path(source)
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{source}: no config.json there; give a local model directory "
            "(config.json, optional *.safetensors and tokenizer files)"
        )
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None


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
    rope_type = "default"
    if isinstance(rope, dict):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE:
        raise UnsupportedModelError(
            f"model {name} uses rope type {rope_type!r}; supported: {', '.join(STATIC_ROPE)}"
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_directory(source) -> Path:
    """The checkpoint directory of a directory or a ``config.json`` path."""
    path = Path(source)
    return path.parent if path.is_file() else path


def _read_json(path: Path) -> dict:
    """A small JSON file of the checkpoint ({} when absent or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def eos_token_ids(source) -> tuple[int, ...]:
    """The model's end-of-sequence ids: ``generation_config.json``'s ``eos_token_id`` first, then
    ``config.json``'s (``source``: a directory or ``config.json`` path, or a ``PretrainedConfig``).
    Read from the files alone, so the server knows them before the weights load."""
    if isinstance(source, (str, os.PathLike)):
        path = model_directory(source)
        eos = _read_json(path / "generation_config.json").get("eos_token_id")
        if eos is None:
            eos = _read_json(path / "config.json").get("eos_token_id")
    else:
        eos = getattr(source, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def load_tokenizer(source):
    """The directory's tokenizer, or None when it has no tokenizer files (ids-only serving).
    Local files only: nothing is fetched."""
    path = model_directory(source)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors"))


def load_model(
    source,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attn_implementation: str,
):
    """The model in eval mode, no grads, on ``device`` in ``dtype``. Weights from the directory's
    safetensors when it has any, else random from ``seed`` (``init_random``)."""
    from transformers import AutoModelForCausalLM

    from .attention import ATTN_IMPLEMENTATION, register

    if attn_implementation == ATTN_IMPLEMENTATION:
        register()
    config = load_config(source)
    check_supported(config)
    path = None if not isinstance(source, (str, os.PathLike)) else Path(source)
    if path is not None and path.is_file():
        path = path.parent
    if path is not None and _has_weights(path):
        _offline()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path),
                config=config,
                local_files_only=True,
                dtype=dtype,
                attn_implementation=attn_implementation,
            )
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot load the weights: {e}") from None
    else:
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation
        )
        init_random(model, seed)
        model = model.to(dtype)
    return model.to(device).eval().requires_grad_(False)


@torch.no_grad()
def init_random(model, seed: int) -> None:
    """Same weights for a seed on any device and dtype: drawn in float32 on the CPU in parameter
    order. Norm weights 1; embeddings std 1 (so the context, not only the last token, moves the
    argmax); every other weight and bias std 0.02. A tied head shares the embedding."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    embed = model.get_input_embeddings().weight
    for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
        if "norm" in name.split(".")[-2]:
            p.fill_(1.0)
        else:
            std = 1.0 if p is embed else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)
