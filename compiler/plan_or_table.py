"""Paths that name "a plan or a compiled table": the one rule that tells them apart, and loading
either. A ``.json`` file is a compiled table, loaded as it is (``DispatchTable.load``: verified,
no YAML stack); any other path (``.yaml``, ``.yaml.j2``) is a plan, compiled now. Overrides
(``--set``) apply to plans only: with a table they are a UsageError, never silently ignored.

The ``plan`` CLI, the server and the benchmarks take either through here; the runtime reads
tables only (``DispatchTable.load``, ``graphplan.runtime.load_table``).
"""

from __future__ import annotations

import os

from .errors import UsageError
from .table import DispatchTable

TABLE_SUFFIX = ".json"


def is_table_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a compiled table (``.json``) rather than a plan."""
    return str(path).endswith(TABLE_SUFFIX)


def _no_overrides(path, overrides) -> None:
    if overrides:
        raise UsageError(
            f"{path}: --set applies to plans, not to a compiled table (it would be ignored); "
            "compile the plan with --set instead"
        )


def load_table_or_plan(
    path: str | os.PathLike, overrides: dict | None = None
) -> tuple[DispatchTable, list]:
    """(table, diagnostics): a compiled table as it is (no diagnostics), or the plan at ``path``
    compiled now with ``overrides`` (its warnings, located in the plan file)."""
    if is_table_path(path):
        _no_overrides(path, overrides)
        return DispatchTable.load(path), []
    from . import compile_loaded, load_plan  # the YAML stack only for a plan

    return compile_loaded(load_plan(path, overrides))


def load_plan_of(path: str | os.PathLike, overrides: dict | None = None):
    """The LoadedPlan that ``path`` holds: a compiled table's embedded plan, or the plan file
    rendered with ``overrides``."""
    from . import load_plan

    if is_table_path(path):
        _no_overrides(path, overrides)
        return load_plan(DispatchTable.load(path).plan)
    return load_plan(path, overrides)
