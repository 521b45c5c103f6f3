"""LoRA adapters from PEFT directories, read without trusting them.

A PEFT LoRA directory holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) and ``adapter_model.safetensors``, whose tensors are named
``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]). ``read_adapter`` checks it like a checkpoint (``files``, ``weights``): regular files
inside the directory only, a size-bounded JSON object, every tensor named, of the exact shape the
base model needs and a float dtype, the rank at most ``max_rank``; a pickle ``adapter_model.bin``
or ``.pt`` is refused, never opened. Nothing in the directory is executed.

The adapter's update of a projection ``W`` is ``scale * B @ A``: ``scale = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora`` (PEFT's rule).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ModelLoadError
from .files import checked_path, read_json_object
from .weights import CheckpointReader, WeightFiles, match

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PICKLES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_CONFIG_BYTES = 1 << 20
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections of a Llama-family decoder layer an adapter may target."""
PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
}
PREFIX = "base_model.model.model.layers"
NEUTRAL = {
    # adapter_config.json keys that change the math when set; the value that does not
    "bias": "none",
    "use_dora": False,
    "fan_in_fan_out": False,
    "layers_to_transform": None,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
}


class AdapterError(ModelLoadError):
    """A LoRA adapter directory is missing, malformed, or does not fit the base model or the
    limits (``--max-lora-rank``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraAdapter:
    """One adapter, on the host: ``weights[(layer, module)] = (A [r, in], B [out, r])``."""

    name: str
    path: str
    rank: int
    scale: float
    modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def delta(self, layer: int, module: str) -> torch.Tensor | None:
        """``scale * B @ A`` of one projection (float32), or None when it is not adapted."""
        ab = self.weights.get((layer, module))
        if ab is None:
            return None
        a, b = ab
        return self.scale * (b.float() @ a.float())


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of ``config``'s decoder layers."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = config.num_key_value_heads or heads
    d = getattr(config, "head_dim", None) or hidden // heads
    return {
        "q_proj": (heads * d, hidden),
        "k_proj": (kv * d, hidden),
        "v_proj": (kv * d, hidden),
        "o_proj": (hidden, heads * d),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def tensor_name(layer: int, module: str, ab: str) -> str:
    parent = PARENT.get(module, "mlp")
    return f"{PREFIX}.{layer}.{parent}.{module}.lora_{ab}.weight"


def read_adapter(name: str, path, config, *, max_rank: int, dtype=torch.float32) -> LoraAdapter:
    """The adapter in directory ``path`` for a base model of ``config`` (checked: module
    docstring), its tensors in ``dtype`` on the CPU. AdapterError names the file and the fix."""
    directory = Path(os.fspath(path))
    if not directory.is_dir():
        raise AdapterError(
            f"LoRA adapter {name!r}: {directory} is not a directory; give a PEFT adapter "
            f"directory (with {CONFIG} and {WEIGHTS})"
        )
    cfg = _config(directory)
    where = directory / CONFIG
    rank = _rank(cfg, where, max_rank)
    modules = _modules(cfg.get("target_modules"), where)
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1e6:
        raise AdapterError(f"{where}: lora_alpha {alpha!r}: expected a positive number")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{where}: use_rslora {rslora!r}: expected true or false")
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    real = _weights_file(directory)
    limit = _byte_limit(config, modules, rank)
    try:
        if checked_path(directory, WEIGHTS, limit=limit) is None:  # bounded before it opens
            raise AdapterError(f"{directory / WEIGHTS}: disappeared while it was read")
        reader = CheckpointReader(
            WeightFiles(format="safetensors", files=(real,), index=None, where=directory / WEIGHTS)
        )
        shapes = projection_shapes(config)
        expected: dict[str, tuple[int, ...]] = {}
        for layer in range(config.num_hidden_layers):
            for m in modules:
                out, inp = shapes[m]
                expected[tensor_name(layer, m, "A")] = (rank, inp)
                expected[tensor_name(layer, m, "B")] = (out, rank)
        match(expected, {}, reader.infos, where=directory / WEIGHTS, against=CONFIG)
    except ModelLoadError as e:
        raise AdapterError(str(e)) from None
    weights = {}
    for layer in range(config.num_hidden_layers):
        for m in modules:
            a = reader.get(tensor_name(layer, m, "A")).to(dtype)
            b = reader.get(tensor_name(layer, m, "B")).to(dtype)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterError(
                    f"{directory / WEIGHTS}: layer {layer} {m} holds inf or NaN values"
                )
            weights[(layer, m)] = (a, b)
    return LoraAdapter(
        name=name,
        path=str(directory),
        rank=rank,
        scale=float(scale),
        modules=modules,
        weights=weights,
    )


def _config(directory: Path) -> dict:
    try:
        cfg = read_json_object(directory, CONFIG, limit=MAX_CONFIG_BYTES)
    except ModelLoadError as e:
        raise AdapterError(str(e)) from None
    if cfg is None:
        raise AdapterError(
            f"{directory}: no {CONFIG}; a LoRA adapter is a PEFT directory "
            f"(save it with PeftModel.save_pretrained)"
        )
    where = directory / CONFIG
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{where}: peft_type {kind!r}; only LORA adapters are served")
    for key, neutral in NEUTRAL.items():
        value = cfg.get(key)
        if value is not None and value != neutral and value not in ({}, []):
            raise AdapterError(
                f"{where}: {key} is {value!r}; graphplan serves plain LoRA only "
                f"(set {key} to {neutral!r}, or merge the adapter into the model)"
            )
    return cfg


def _rank(cfg: dict, where: Path, max_rank: int) -> int:
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"{where}: r {r!r}: expected a positive integer (the LoRA rank)")
    if r > max_rank:
        raise AdapterError(
            f"{where}: rank r={r} is over the limit of {max_rank}; serve with "
            f"--max-lora-rank {r} (or more), or use an adapter of rank <= {max_rank}"
        )
    return r


def _modules(value, where: Path) -> tuple[str, ...]:
    if value == "all-linear":
        return MODULES
    if isinstance(value, str):
        raise AdapterError(
            f"{where}: target_modules {value!r} is a pattern; list the projections "
            f"({', '.join(MODULES)})"
        )
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise AdapterError(f"{where}: target_modules must be a non-empty list of projection names")
    unknown = sorted({m for m in value if m not in MODULES})
    if unknown:
        raise AdapterError(
            f"{where}: target_modules {unknown} are not projections graphplan adapts "
            f"({', '.join(MODULES)})"
        )
    return tuple(m for m in MODULES if m in value)


def _weights_file(directory: Path) -> Path:
    try:
        real = checked_path(directory, WEIGHTS)
        pickles = [p for p in PICKLES if checked_path(directory, p, allow_dir=True) is not None]
    except ModelLoadError as e:
        raise AdapterError(str(e)) from None
    if real is None:
        found = f"; found {', '.join(pickles)}, a pickle that is never loaded" if pickles else ""
        raise AdapterError(
            f"{directory}: no {WEIGHTS}{found}. Save the adapter with safe_serialization=True "
            "(PEFT's default), or convert it to safetensors"
        )
    return real


def _byte_limit(config, modules: tuple[str, ...], rank: int) -> int:
    shapes = projection_shapes(config)
    elements = sum(rank * (shapes[m][0] + shapes[m][1]) for m in modules)
    return elements * config.num_hidden_layers * 8 + (1 << 20)  # float64 at most, a header
