"""The compiled path: the model compiled once with torch.compile (``model``), its q/k/v and
gate/up projections merged into one GEMM each (``merge_linear``) and its repeated layers compiled
once (``regions``); graphs are then captured of the compiled model."""

from .model import CompiledModel, ModelCompileError

__all__ = ["CompiledModel", "ModelCompileError"]
