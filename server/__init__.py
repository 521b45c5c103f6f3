"""graphplan's inference server: HTTP (the OpenAI API and ``/generate``), one engine thread doing
continuous batching through the runtime, plan swaps between steps. ``graphplan-serve --help``."""

from .app import Server
from .batching import ContinuousBatcher, TokenEvent
from .engine import Engine
from .hf_model import HFSpec
from .model import ModelSpec, ServingSpec, build_model, load_table
from .protocol import RequestError

__all__ = [
    "Server",
    "Engine",
    "RequestError",
    "ModelSpec",
    "ServingSpec",
    "HFSpec",
    "ContinuousBatcher",
    "TokenEvent",
    "build_model",
    "load_table",
]
