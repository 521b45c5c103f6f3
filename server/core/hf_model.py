"""Serving a stock Hugging Face decoder: ``--model DIR`` builds a ``PagedCausalLM`` (models/hf)
with one sequence seat per ``scheduler.max_num_seqs``, and loads the directory's tokenizer when it
has one (text prompts on /v1/completions). Nothing is fetched from the network, no code from the
directory runs, and only its regular files are read (models/hf/files.py and tokenizer_files.py).
``HFSpec`` is a ``model.ServingSpec``; the checkpoint's own rules (tokenizer files, EOS ids) live in
``graphplan.models.hf.load``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True, kw_only=True, slots=True)
class HFSpec:
    """A transformers checkpoint directory and how to serve it (a ``model.ServingSpec``)."""

    model: str
    """Directory with config.json and model.safetensors (or its shards, or pytorch_model.bin);
    tokenizer files optional."""
    max_model_len: int | None = None
    """Prompt plus generated tokens of one request; default min(max_position_embeddings, 2048)."""
    dtype: str | None = None
    """float32, bfloat16 or float16; default bfloat16 on CUDA, float32 on the CPU."""
    seed: int = 0
    random_weights: bool = False
    """Weights drawn from ``seed`` instead of read from the directory (``--random-weights``:
    benchmarks, tests); without it a directory with no weights is refused."""
    block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_memory_fraction: float | None = None
    """Neither: every seat at max_model_len when memory allows, else what fits (blocks on demand)."""
    served_model_name: str | None = None
    """The ``model`` clients name on /v1 (default: the directory's name)."""
    compile: str = ""
    """torch.compile backend of the compiled path (``--compile``); "" runs the model as written."""
    fused_ops: bool | None = None
    """Llama-family models: the fused decoder (``PagedCausalLM``'s ``fused_ops``); None: on CUDA."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """(name, PEFT directory) of the LoRA adapters loaded at start (``--lora-modules``)."""
    max_loras: int | None = None
    """Adapter slots on the device (``--max-loras``); default the plan's ``lora.max_loras``."""
    max_lora_rank: int | None = None
    """The highest adapter rank served (``--max-lora-rank``; default 16)."""

    @property
    def name(self) -> str:
        """``served_model_name``, else the directory's name (of DIR for ``DIR/config.json``)."""
        if self.served_model_name:
            return self.served_model_name
        from graphplan.compiler.errors import GraphplanError
        from graphplan.models.hf.files import model_dir

        try:
            return model_dir(self.model).resolve().name
        except (GraphplanError, OSError, RuntimeError):  # not a directory: check() says so
            return Path(self.model).name

    def _config(self) -> dict:
        return _checked_config(self.model)

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
        """Raise ModelLoadError and its kinds (GraphplanErrors) before anything loads: the config,
        the architecture, the weight files' tensors (headers only), generation_config.json and
        the tokenizer files."""
        import torch

        from graphplan.models.hf import check_checkpoint
        from graphplan.models.hf.tokenizer_files import check as check_tokenizer
        from graphplan.models.hf.tokenizer_files import has_tokenizer

        from .model import DTYPES

        check_checkpoint(
            self.model,
            dtype=DTYPES.get(self.dtype or "float32", torch.float32),
            random_weights=self.random_weights,
        )
        self.stop_token_ids()
        if self.lora_modules:  # each adapter against the base model's config, before any load
            from graphplan.models.hf.load import load_config
            from graphplan.models.hf.lora import read_adapter

            config = load_config(self.model)
            for name, path in self.lora_modules:
                read_adapter(name, path, config, max_rank=self.max_lora_rank or 16)
        if has_tokenizer(_directory(self.model)):
            check_tokenizer(_directory(self.model))

    def chat_template(self):
        """The directory's chat template (chat_template.jinja, else tokenizer_config.json's
        ``chat_template``: a string, or the entry named "default" of a list), or None."""
        return read_chat_template(_directory(self.model))

    def load_tokenizer(self):
        """The directory's tokenizer, or None when it has none (ids-only serving)."""
        from graphplan.models.hf import load_tokenizer

        return load_tokenizer(self.model)

    def build(self, table, device, tp=None):
        """``tp``: this rank's ``TPGroup`` (tensor-parallel serving: server/core/tp_serving.py):
        only its shard loads, and the LM head runs inside the step on every rank."""
        import torch

        from graphplan.models.hf import PagedCausalLM
        from graphplan.models.hf.lora import read_adapter

        from .lora_serving import settings
        from .model import dtype_of

        lora = settings(table, self.lora_modules, self.max_loras, self.max_lora_rank)
        if lora and tp is not None:
            from graphplan.compiler.errors import GraphplanError

            raise GraphplanError(
                "LoRA with parallel.tensor_parallel_size > 1: adapters' weights are not sharded; "
                "serve adapters with --set parallel.tensor_parallel_size=1"
            )
        if lora and self.compile:
            from graphplan.compiler.errors import GraphplanError

            raise GraphplanError(
                "--compile with LoRA: the compiled path runs transformers' forward, which has no "
                "LoRA kernels; drop --compile (LoRA runs in the fused decoder)"
            )
        dtype = self.dtype or ("bfloat16" if str(device).startswith("cuda") else "float32")
        model = PagedCausalLM.load(
            self.model,
            max_num_seqs=table.max_num_seqs,
            max_model_len=self.resolved_max_model_len(),
            dtype=dtype_of(dtype),
            device=torch.device(device),
            seed=self.seed,
            random_weights=self.random_weights,
            block_size=self.block_size,
            kv_cache_tokens=self.kv_cache_tokens,
            kv_memory_fraction=self.kv_memory_fraction,
            fused_ops=True if lora and self.fused_ops is None else self.fused_ops,  # LoRA's path
            max_step_tokens=table.max_tokens,
            # the LM head on the rows a step reads, outside the graphs; with TP inside every
            # rank's step (its all-gather: server/wire/ranks.py's ``follow``)
            logits="rows" if tp is None else "all",
            tp=tp,
            max_loras=lora.max_loras if lora else 0,
            max_lora_rank=lora.max_rank if lora else 16,
        )
        for name, path in self.lora_modules if lora else ():
            config, rank = model.hf.config, lora.max_rank
            model.lora.add(read_adapter(name, path, config, max_rank=rank, dtype=dtype_of(dtype)))
        return model


def _directory(model: str) -> Path:
    from graphplan.models.hf.files import model_dir

    return model_dir(model)


def read_chat_template(directory: Path):
    from graphplan.compiler.limits import read_regular_file
    from graphplan.models.hf.errors import ModelLoadError
    from graphplan.models.hf.files import checked_path, read_json_object
    from graphplan.models.hf.tokenizer_files import MAX_TOKENIZER_CONFIG_BYTES

    from ..frontend.chat import ChatTemplateSource

    limit = MAX_TOKENIZER_CONFIG_BYTES
    tc = read_json_object(directory, "tokenizer_config.json", limit=limit) or {}
    tokens = {k: _token_text(tc.get(k)) for k in ("bos_token", "eos_token")}
    real = checked_path(directory, "chat_template.jinja", limit=limit)
    if real is not None:
        raw = read_regular_file(real, limit, "chat template", "", error=ModelLoadError)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{real}: not UTF-8 text ({e.reason})") from None
        return ChatTemplateSource(template=text, where=str(directory / real.name), **tokens)
    t = tc.get("chat_template")
    if isinstance(t, list):
        t = next(
            (x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"),
            None,
        )
    if not isinstance(t, str) or not t:
        return None
    return ChatTemplateSource(template=t, where=str(directory / "tokenizer_config.json"), **tokens)


def _token_text(v) -> str:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else ""


@lru_cache(maxsize=16)
def _checked_config(model: str) -> dict:
    """config.json's values, checked (models/hf/load.read_config), read once."""
    from graphplan.models.hf.load import read_config

    return read_config(_directory(model))
