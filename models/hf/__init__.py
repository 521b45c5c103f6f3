"""Run stock transformers causal LMs (Llama, Qwen2, Qwen3) under GraphRunner, attention through a
paged KV cache. Needs the ``graphplan[hf]`` extra (transformers, safetensors); ``graphplan.runtime``
itself never imports this package. (transformers itself imports pyyaml and jinja2; graphplan's
code here imports neither.)

    from . import PagedCausalLM
    model = PagedCausalLM.load("path/to/model", max_num_seqs=64, max_model_len=2048,
                               dtype=torch.bfloat16, device="cuda", kv_memory_fraction=0.5)
    runner = GraphRunner(model, table, model.static_inputs())
    logits = runner.step(model.make_batch([(seat, start, token_ids), ...]), num_reqs, max_query_len)
"""

try:
    import transformers  # noqa: F401 - fail here, with the extra to install
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "graphplan.models.hf needs transformers and safetensors: pip install 'graphplan[hf]'"
    ) from e

from ..paged_kv import KVCacheSizeError
from .adapter import PagedCausalLM, PagedConfig
from .attention import ATTN_IMPLEMENTATION
from .errors import (
    CheckpointMismatchError,
    ModelConfigError,
    ModelLoadError,
    ModelMemoryError,
    RemoteCodeError,
    UnsupportedModelError,
)
from .load import (
    check_checkpoint,
    check_supported,
    eos_token_ids,
    load_config,
    load_model,
    load_tokenizer,
)

__all__ = [
    "PagedCausalLM",
    "PagedConfig",
    "ATTN_IMPLEMENTATION",
    "ModelLoadError",
    "UnsupportedModelError",
    "RemoteCodeError",
    "ModelConfigError",
    "CheckpointMismatchError",
    "ModelMemoryError",
    "KVCacheSizeError",
    "check_checkpoint",
    "check_supported",
    "load_config",
    "load_model",
    "load_tokenizer",
    "eos_token_ids",
]
