"""graphplan's models: what the runner steps and the server serves. ``Model`` is the protocol they
implement (``protocol.py``); ``tiny_llama`` is a small Llama with a slot-based KV cache (random
weights from a seed), ``hf`` runs stock transformers causal LMs over a paged KV cache (the
``graphplan[hf]`` extra; importing this package does not import it), ``comm_model`` is the
communication-heavy model of the DBO benchmark."""

from .protocol import BlockPool, Model, ModelLimits, Request, Tokenizer
from .tiny_llama import TinyLlama, TinyLlamaConfig

__all__ = [
    "BlockPool",
    "Model",
    "ModelLimits",
    "Request",
    "Tokenizer",
    "TinyLlama",
    "TinyLlamaConfig",
]
