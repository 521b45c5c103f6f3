"""The ``plan`` command: one module per group of subcommands (``main``: validate, compile, explain,
diff; ``tuning``: optimize, report, workload tools; ``engines``: import, export, engines), sharing
``inputs`` (usage errors, ``--set``, plan-or-table loading) and ``outputs`` (where ``-o`` may write)."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
