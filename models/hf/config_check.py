"""Bounds on a checkpoint's config, checked on the raw values before transformers builds anything,
and the memory check that runs before the weights and the KV cache are allocated.

Every supported family (Llama, Qwen2, Qwen3) names its shape the same way; the bounds are far above
any released model of these families and far below what would exhaust a machine by accident."""

from __future__ import annotations

import math

import torch

from ..paged_kv import GiB, free_memory_bytes
from .errors import ModelConfigError, ModelMemoryError

# key: (lowest, highest, required)
SHAPE = {
    "vocab_size": (1, 1 << 22, True),
    "hidden_size": (1, 65536, True),
    "intermediate_size": (1, 1 << 20, True),
    "num_hidden_layers": (1, 1024, True),
    "num_attention_heads": (1, 1024, True),
    "num_key_value_heads": (1, 1024, False),
    "head_dim": (2, 1024, False),
    "max_position_embeddings": (1, 1 << 24, False),
}
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "auto")
MAX_TOKEN_IDS = 1024


def _int(values: dict, key: str, where) -> int | None:
    lo, hi, required = SHAPE[key]
    v = values.get(key)
    if v is None:
        if required:
            raise ModelConfigError(
                f"{where}: {key} is missing; a {key} is needed to size the model"
            )
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelConfigError(f"{where}: {key} must be an integer, not {_show(v)}")
    if not lo <= v <= hi:
        raise ModelConfigError(f"{where}: {key}={_show(v)} is outside [{lo}, {hi}]")
    return v


def _show(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def check_values(values: dict, where) -> None:
    """ModelConfigError naming ``where`` and the key for a value a real checkpoint never has."""
    n = {key: _int(values, key, where) for key in SHAPE}
    hidden, heads, vocab = n["hidden_size"], n["num_attention_heads"], n["vocab_size"]
    assert hidden is not None and heads is not None and vocab is not None  # required: _int raised
    kv = n["num_key_value_heads"] or heads
    if n["head_dim"] is None and hidden % heads:
        raise ModelConfigError(
            f"{where}: hidden_size={hidden} is not a multiple of "
            f"num_attention_heads={heads} (and no head_dim is given)"
        )
    if heads % kv:
        raise ModelConfigError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
        )
    head_dim = n["head_dim"] or hidden // heads
    if head_dim % 2:
        raise ModelConfigError(
            f"{where}: the head dimension {head_dim} is odd; rotary needs it even"
        )
    for key in POSITIVE_FLOATS:
        v = values.get(key)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
        ):
            raise ModelConfigError(f"{where}: {key} must be a positive number, not {_show(v)}")
    for key in BOOLS:
        v = values.get(key)
        if v is not None and not isinstance(v, bool):
            raise ModelConfigError(f"{where}: {key} must be true or false, not {_show(v)}")
    for key in ("torch_dtype", "dtype"):
        v = values.get(key)
        if v is not None and not (isinstance(v, str) and v in DTYPE_NAMES):
            raise ModelConfigError(f"{where}: {key} must be one of {', '.join(DTYPE_NAMES)}")
    if values.get("quantization_config") is not None:
        raise ModelConfigError(
            f"{where}: quantization_config is set; quantized checkpoints are not supported "
            "(serve float16/bfloat16/float32 weights)"
        )
    token_ids(values.get("bos_token_id"), "bos_token_id", where, vocab)
    token_ids(values.get("eos_token_id"), "eos_token_id", where, vocab)
    pad = values.get("pad_token_id")
    if pad is not None and (
        isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab
    ):
        raise ModelConfigError(
            f"{where}: pad_token_id={_show(pad)} is not a token id below {vocab}"
        )


def token_ids(value, key: str, where, vocab: int) -> tuple[int, ...]:
    """``value`` (None, an id or a list of ids, each in [0, vocab)) as a tuple."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if len(ids) > MAX_TOKEN_IDS or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids
    ):
        raise ModelConfigError(
            f"{where}: {key} must be a token id or a list of token ids in [0, {vocab}), "
            f"not {_show(value)}"
        )
    return tuple(ids)


def check_memory(
    *, weights: int, params: int, kv: int, dtype: torch.dtype, device, config, where
) -> None:
    """ModelMemoryError when the weights plus the KV cache exceed what ``device`` has free."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        return
    free = free_memory_bytes(device)
    if weights + kv <= free:
        return
    shape = ", ".join(
        f"{k}={getattr(config, k)}"
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    )
    raise ModelMemoryError(
        f"{where}: the model needs {(weights + kv) / GiB:.2f} GiB (weights {weights / GiB:.2f} GiB: "
        f"{params / 1e9:.3f} B parameters in {str(dtype).removeprefix('torch.')} from {shape}; "
        f"KV cache {kv / GiB:.2f} GiB) but {device} has {free / GiB:.2f} GiB free: use a smaller "
        "model or dtype, a smaller KV cache (max_model_len, max_num_seqs, --kv-cache-tokens), or "
        "another device"
    )
