"""graphplan's compiler: YAML plan -> validated, explained dispatch table. Never imports torch.

``compile_plan`` pulls in the YAML stack lazily, so ``import graphplan.compiler.table`` (what the
runtime uses) stays light.
"""

from __future__ import annotations

from .errors import BatchError, Diagnostic, GraphplanError, OutputError, PlanError, TableError
from .records import BatchDescriptor, CudagraphMode, Graph, RuntimeMode, TableSettings, Why
from .table import DispatchTable, Route
from .table_format import COMPILER_VERSION as __version__

__all__ = [
    "compile_plan",
    "load_plan",
    "DispatchTable",
    "Route",
    "BatchDescriptor",
    "Graph",
    "RuntimeMode",
    "CudagraphMode",
    "TableSettings",
    "Why",
    "Diagnostic",
    "GraphplanError",
    "PlanError",
    "TableError",
    "BatchError",
    "OutputError",
    "__version__",
]


def compile_plan(source, overrides: dict | None = None) -> DispatchTable:
    """Compile a plan (a path to ``.yaml``/``.yaml.j2``, or a dict) into a DispatchTable.

    Raises PlanError listing every problem, each with file:line:col and a fix. Warnings (downgrades,
    dropped sizes) are kept in ``table.diagnostics``.
    """
    return compile_loaded(load_plan(source, overrides))[0]


def compile_loaded(loaded):
    """(table, located diagnostics) for a LoadedPlan; the CLI prints the diagnostics."""
    from .resolve import resolve

    try:
        parts, diags = resolve(loaded.spec, loaded.plan)
    except PlanError as e:
        raise PlanError([loaded.locate(d) for d in e.diagnostics]) from None
    return DispatchTable(**parts), [loaded.locate(d) for d in diags]


def load_plan(source, overrides: dict | None = None):
    from .load import load_plan as _load

    return _load(source, overrides)
