"""An inference server around graphplan's runtime: HTTP (standard library), one engine thread doing
continuous batching over the tiny Llama, plan swaps between steps. ``python -m examples.server``."""

import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parents[1])
if _EXAMPLES not in sys.path:  # tiny_llama.py lives next to this package
    sys.path.insert(0, _EXAMPLES)

from examples.server.app import Server  # noqa: E402
from examples.server.engine import Engine  # noqa: E402
from examples.server.model import ModelSpec, build_model, load_table  # noqa: E402
from examples.server.protocol import RequestError  # noqa: E402

__all__ = ["Server", "Engine", "RequestError", "ModelSpec", "build_model", "load_table"]
