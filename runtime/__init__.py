"""graphplan's runtime: load a compiled table, capture its graphs, replay them every step.

Needs torch and numpy; never imports pyyaml, jsonschema or jinja2 (a server loads ``table.json``,
not plans). The table format is ``compiler.table``, the one module both halves share.
"""

from graphplan.compiler.errors import BatchError, GraphplanError, TableError
from graphplan.compiler.table import DispatchTable, Route, RuntimeMode
from graphplan.runtime.buffers import StaticInput
from graphplan.runtime.metrics import render_prometheus
from graphplan.runtime.piecewise import SplitError
from graphplan.runtime.runner import CaptureError, GraphRunner, RunnerStateError

__all__ = ["GraphRunner", "StaticInput", "DispatchTable", "Route", "RuntimeMode", "BatchError",
           "CaptureError", "GraphplanError", "RunnerStateError", "SplitError", "TableError",
           "render_prometheus", "load_table"]


def load_table(path) -> DispatchTable:
    """Load a compiled table.json (format version and checksum verified)."""
    return DispatchTable.load(path)
