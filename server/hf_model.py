"""Serving a stock Hugging Face decoder: ``--model DIR`` builds a ``PagedCausalLM`` (models/hf)
with one sequence seat per ``scheduler.max_num_seqs``, and loads the directory's tokenizer when it
has one (text prompts on /v1/completions). Nothing is fetched from the network. ``HFSpec`` is a
``model.ServingSpec``; the checkpoint's own rules (tokenizer files, EOS ids) live in
``graphplan.models.hf.load``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True, kw_only=True, slots=True)
class HFSpec:
    """A transformers checkpoint directory and how to serve it (a ``model.ServingSpec``)."""

    model: str
    """Directory with config.json and *.safetensors (tokenizer files optional); with config.json
    alone the weights are random from ``seed``."""
    max_model_len: int | None = None
    """Prompt plus generated tokens of one request; default min(max_position_embeddings, 2048)."""
    dtype: str | None = None
    """float32, bfloat16 or float16; default bfloat16 on CUDA, float32 on the CPU."""
    seed: int = 0
    block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_memory_fraction: float | None = None
    """Neither: the KV cache holds exactly max_num_seqs sequences of max_model_len tokens."""
    served_model_name: str | None = None
    """The ``model`` clients name on /v1 (default: the directory's name)."""
    compile: str = ""
    """torch.compile backend of the compiled path (``--compile``); "" runs the model as written."""

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    def _config(self) -> dict:
        return _read_json(str(_directory(self.model) / "config.json"))

    def resolved_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        return min(self._config().get("max_position_embeddings") or 2048, 2048)

    def limits(self) -> dict:
        return {
            "vocab_size": self._config().get("vocab_size", 0),
            "max_model_len": self.resolved_max_model_len(),
        }

    def stop_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence ids (generation_config.json first, then config.json)."""
        from graphplan.models.hf import eos_token_ids

        return eos_token_ids(self.model)

    def check(self) -> None:
        """Raise ModelLoadError / UnsupportedModelError (GraphplanErrors) before anything loads."""
        from graphplan.models.hf import check_supported, load_config

        check_supported(load_config(self.model))

    def load_tokenizer(self):
        """The directory's tokenizer, or None when it has none (ids-only serving)."""
        from graphplan.models.hf import load_tokenizer

        return load_tokenizer(self.model)

    def build(self, table, device):
        import torch

        from graphplan.models.hf import PagedCausalLM

        from .model import dtype_of

        dtype = self.dtype or ("bfloat16" if str(device).startswith("cuda") else "float32")
        return PagedCausalLM.load(
            self.model,
            max_num_seqs=table.max_num_seqs,
            max_model_len=self.resolved_max_model_len(),
            dtype=dtype_of(dtype),
            device=torch.device(device),
            seed=self.seed,
            block_size=self.block_size,
            kv_cache_tokens=self.kv_cache_tokens,
            kv_memory_fraction=self.kv_memory_fraction,
        )


def _directory(model: str) -> Path:
    path = Path(model)
    return path.parent if path.is_file() else path


@lru_cache(maxsize=16)
def _read_json(path: str) -> dict:
    """A small JSON file of the checkpoint, read once ({} when absent or unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
