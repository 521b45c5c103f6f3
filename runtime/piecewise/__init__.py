"""PIECEWISE graphs: the model runs as written and breaks at split points (``breakable``), each
segment between two split points captured as its own graph (``graphs``), the split ops eager."""

from .breakable import SplitError, current_step, split_point

__all__ = ["SplitError", "current_step", "split_point"]
