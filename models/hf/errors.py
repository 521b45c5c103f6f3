"""Why a checkpoint directory is refused: one class per kind of failure, all GraphplanErrors, so the
server prints the message and exits 1 without a traceback."""

from __future__ import annotations

from graphplan.compiler.errors import GraphplanError


class ModelLoadError(GraphplanError):
    """The model directory or one of its files is missing, unreadable or malformed."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint uses an architecture or attention feature the paged adapter cannot run."""


class RemoteCodeError(ModelLoadError):
    """The directory asks to run its own Python code (``auto_map``, ``trust_remote_code``)."""


class ModelConfigError(ModelLoadError):
    """A config value is missing, of the wrong type, out of bounds or inconsistent."""


class CheckpointMismatchError(ModelLoadError):
    """The weight files do not hold exactly the tensors the config describes."""


class ModelMemoryError(ModelLoadError):
    """The weights and the KV cache would not fit in the device's free memory."""


class TensorParallelError(ModelConfigError):
    """The checkpoint cannot be split over the plan's ``tensor_parallel_size`` ranks (a head or
    MLP count the TP size does not divide)."""
