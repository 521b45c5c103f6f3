"""What every ``plan`` subcommand shares: the usage error, ``--set`` parsing, and reading a plan
or a compiled table. Its own module so the subcommand modules (cli, tuning_cli, engine_cli) need
not import one another."""

from __future__ import annotations

import sys

from ..errors import UsageError, left_out_line, reported
from ..plan_or_table import load_table_or_plan

__all__ = ["UsageError", "load_any", "parse_overrides", "print_diags"]


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


def load_any(path: str, sets=None):
    """(table, diagnostics) from a compiled table (``.json``) or a plan (anything else) and its
    ``--set`` pairs (plan_or_table.load_table_or_plan)."""
    return load_table_or_plan(path, parse_overrides(sets, path))


def print_diags(diags) -> None:
    """Warnings on stderr: the first ones (``errors.reported``) and a count of the rest (a plan
    with 4096 sizes past its token budget has a warning for each; ``--format json`` and the
    table hold them all)."""
    shown, left_out = reported(diags)
    for d in shown:
        print(d.format(), file=sys.stderr)
    if left_out:
        print(left_out_line(left_out, "warning"), file=sys.stderr)
