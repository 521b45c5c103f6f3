"""What every ``plan`` subcommand shares: the usage error, ``--set`` parsing, and reading a plan
or a compiled table. Its own module so the subcommand modules (cli, tuning_cli, engine_cli) need
not import one another."""

from __future__ import annotations

import sys

from ..errors import GraphplanError


class UsageError(GraphplanError):
    exit_code = 1


def parse_overrides(pairs: list[str], file: str = "<plan>") -> dict:
    """``--set KEY=VALUE`` pairs -> {key: YAML-parsed value}, under the plan file's bounds; every
    error names ``file``, the plan the values apply to."""
    from ..load import parse_set_value

    out = {}
    for pair in pairs or []:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise UsageError(
                f"plan: {file}: --set {pair!r}: expected KEY=VALUE (e.g. --set max_num_seqs=128)"
            )
        out[key.strip()] = parse_set_value(value, key.strip(), file)
    return out


def is_table(path: str) -> bool:
    return path.endswith(".json")


def load_any(path: str, sets=None):
    """A DispatchTable from a compiled table (``.json``) or a plan (anything else)."""
    from ..table import DispatchTable

    if is_table(path):
        if sets:
            raise UsageError(
                f"plan: {path}: --set applies to plans, not to a compiled table "
                "(it would be ignored); compile the plan with --set instead"
            )
        return DispatchTable.load(path), []
    from .. import compile_loaded, load_plan

    return compile_loaded(load_plan(path, parse_overrides(sets, path)))


def print_diags(diags) -> None:
    for d in diags:
        print(d.format(), file=sys.stderr)
