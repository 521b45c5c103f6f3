"""The engine half of the ``plan`` CLI: ``export``, ``import`` and ``engines``.

``compiler.cli.build_parser`` calls ``add_engine_commands``; exit codes and error style are the
CLI's (0 ok, 2 invalid plan or engine input, 1 anything else; no traceback for bad input; nothing
is written when anything is wrong, and files are written atomically).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FORMATS = ("args", "yaml", "json")


def _loaded(path: str, sets):
    """(LoadedPlan, table, located diagnostics) from a plan or a compiled table.json."""
    from .. import compile_loaded
    from ..plan_or_table import load_plan_of
    from .inputs import parse_overrides

    loaded = load_plan_of(path, parse_overrides(sets, path))
    table, diags = compile_loaded(loaded)
    return loaded, table, diags


def _emit(text: str, output: str | None) -> None:
    if output:
        from ..fileio import write_atomic

        write_atomic(output, text.encode("utf-8"))
    else:
        sys.stdout.write(text)


def _prediction(path: str) -> dict | None:
    """What ``plan optimize`` predicted for a tuned plan (its header), if it is one."""
    from ..limits import MAX_PLAN_BYTES, read_regular_file
    from ..plan_or_table import is_table_path
    from ..tools.tuned_plan import read_prediction

    if is_table_path(path):
        return None
    raw = read_regular_file(Path(path), MAX_PLAN_BYTES)
    return read_prediction(raw[:MAX_PLAN_BYTES].decode("utf-8", "replace"))


def cmd_export(a) -> int:
    from ..engines import export_plan
    from ..engines.flags import ENGINE_NAMES
    from ..tools.tuned_plan import prediction_text
    from .inputs import UsageError, print_diags

    pred = _prediction(a.plan)
    engine = a.engine or (pred or {}).get("engine")
    if engine not in ("vllm", "sglang", "trtllm"):
        raise UsageError(
            "plan export: give --engine vllm|sglang|trtllm"
            + (
                " (the tuned plan's workload came from graphplan's own server: serve the plan "
                "itself, or export it for another engine)"
                if engine == "graphplan"
                else " (the plan records no engine: it was not tuned from an engine's metrics)"
            )
        )
    loaded, table, diags = _loaded(a.plan, a.set)
    out = export_plan(loaded, table.capture_sizes, engine, a.format, a.engine_version)
    print_diags(list(diags) + list(out.diagnostics))
    _emit(out.text, a.output)
    if a.output:
        print(f"wrote {a.output} ({out.version}, {len(out.lost)} lost feature(s))", file=sys.stderr)
    if pred is not None:
        same = list(table.capture_sizes) == pred["sizes"]
        print(
            f"{ENGINE_NAMES[engine]}: "
            + (
                prediction_text(pred)
                if same
                else "the plan's capture sizes are not the ones plan optimize chose (edited "
                "since?): no prediction"
            ),
            file=sys.stderr,
        )
    return 0


def cmd_import(a) -> int:
    from ..engines import import_plan
    from .inputs import UsageError, parse_overrides, print_diags

    args = list(a.args or [])
    if args and args[0] == "--":
        args = args[1:]
    if args and (a.config or a.log):
        raise UsageError("plan import: give --config, --log or -- ARGS..., not two of them")
    out = import_plan(
        a.engine,
        args=args if args or not (a.config or a.log) else None,
        config=a.config,
        log=a.log,
        version=a.engine_version,
        sets=parse_overrides(a.set, a.output or a.config or a.log or f"<{a.engine} flags>"),
        allow_unknown=a.ignore_unknown,
    )
    print_diags(out.diagnostics)
    _emit(out.text, a.output)
    if a.output:
        print(f"wrote {a.output}", file=sys.stderr)
    return 0


def cmd_engines(a) -> int:
    from ..tools.engine_compare import compare, compare_lines

    loaded, table, _ = _loaded(a.plan, a.set)
    work = None
    if a.trace:
        from .tuning import _workload

        work = _workload(a.trace, table)
    rows = compare(loaded, table, work)
    if a.format == "json":
        print(json.dumps([r.to_json() for r in rows], sort_keys=True))
    else:
        print("\n".join(compare_lines(rows, a.plan, a.trace)))
    return 0


def add_engine_commands(sub, common) -> None:
    sp = sub.add_parser("export", help="write a plan as vLLM, SGLang or TensorRT-LLM settings")
    sp.add_argument("plan", help="a plan or a compiled table.json")
    sp.add_argument(
        "--engine",
        choices=("vllm", "sglang", "trtllm"),
        help="the engine; default: the one a tuned plan's workload came from (plan optimize "
        "records it when the workload came from an engine's metrics)",
    )
    sp.add_argument(
        "--format",
        choices=FORMATS,
        help="args (flags, one per line), yaml (a "
        "--config file) or json (the engine's argument dict); default: the engine's "
        "first",
    )
    sp.add_argument(
        "--engine-version", help="engine version to spell flags for (docs/engines.md lists them)"
    )
    sp.add_argument("-o", "--output", help="where to write (atomically); default stdout")
    sp.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="template variable (.j2 plans) or dotted plan key",
    )
    sp.set_defaults(fn=cmd_export)

    sp = sub.add_parser("import", help="build a plan from engine flags, a config file or a log")
    sp.add_argument("--engine", required=True, choices=("vllm", "sglang", "trtllm"))
    sp.add_argument(
        "--config",
        help="the engine's config file (vllm serve --config YAML, "
        "SGLang --config YAML, TensorRT-LLM extra LLM API options YAML)",
    )
    sp.add_argument("--log", help="a vLLM start-up log (non-default args / engine config lines)")
    sp.add_argument("--engine-version", help="engine version whose rules and spellings to read")
    sp.add_argument(
        "-o", "--output", help="where to write the plan YAML (atomically); default stdout"
    )
    sp.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="a plan value the source lacks, e.g. --set scheduler.max_num_seqs=128",
    )
    sp.add_argument(
        "--ignore-unknown",
        action="store_true",
        help="skip flags graphplan does not know (a note each) instead of failing",
    )
    sp.add_argument("args", nargs=argparse.REMAINDER, help="-- then the engine's flags")
    sp.set_defaults(fn=cmd_import)

    sp = sub.add_parser(
        "engines", help="a plan's padding under each engine's default capture list, side by side"
    )
    sp.add_argument("plan", help="a plan or a compiled table.json")
    sp.add_argument("--trace", help="a JSONL trace: adds the padding that workload pays")
    common(sp)
    sp.set_defaults(fn=cmd_engines)
