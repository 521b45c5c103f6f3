"""graphplan's runtime: load a compiled table, capture its graphs, replay them every step.

Needs torch and numpy; never imports pyyaml, jsonschema or jinja2 (a server loads ``table.json``,
not plans). The table format is ``compiler.table``, the one module both halves share.
"""

from graphplan.compiler.errors import BatchError, GraphplanError, TableError
from graphplan.compiler.records import RuntimeMode, TableSettings, Why
from graphplan.compiler.table import DispatchTable, Route

from .buffers import StaticInput
from .capture import CaptureError
from .compiled.model import CompiledModel, ModelCompileError
from .metrics import render_prometheus
from .piecewise.breakable import SplitError, split_point
from .runner import GraphRunner, RunnerStateError

__all__ = [
    "GraphRunner",
    "StaticInput",
    "DispatchTable",
    "Route",
    "RuntimeMode",
    "TableSettings",
    "Why",
    "BatchError",
    "CaptureError",
    "CompiledModel",
    "GraphplanError",
    "ModelCompileError",
    "RunnerStateError",
    "SplitError",
    "TableError",
    "render_prometheus",
    "load_table",
    "split_point",
]


def load_table(path) -> DispatchTable:
    """Load a compiled table.json, verified against itself (graphplan.compiler.table_format)."""
    return DispatchTable.load(path)
