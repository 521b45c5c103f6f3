"""graphplan's inference server: HTTP (the OpenAI API and ``/generate``), one engine thread doing
continuous batching through the runtime, plan swaps between steps. ``graphplan-serve --help``."""

from .core.batching import ContinuousBatcher, TokenEvent
from .core.engine import Engine
from .core.hf_model import HFSpec
from .core.model import ModelSpec, ServingSpec, build_model, load_table
from .errors import RequestError
from .frontend.app import Server

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
