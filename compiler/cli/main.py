"""The ``plan`` command: validate, compile, explain, diff (report, optimize: ``tuning_cli``).

Exit codes: 0 ok, 2 invalid plan, 1 any other failure. Errors go to stderr as
``path:line:col: error[CODE]: message (hint)``; no traceback for bad input, no partial files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import GraphplanError, did_you_mean, reported, visible
from .inputs import UsageError, load_any, print_diags

PLAN_EXTRA = ("yaml", "jsonschema", "jinja2")  # the `graphplan[plan]` extra (pyproject.toml)
COMMANDS = ("validate", "compile", "explain", "diff", "report", "optimize")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit 2, which we reserve for invalid plans
        hint = ""
        if "invalid choice" in message:
            word = message.split("'")[1] if "'" in message else ""
            hint = did_you_mean(word, COMMANDS)
        raise UsageError(
            f"plan: {message}" + (f" ({hint})" if hint else "") + f"\n{self.format_usage().strip()}"
        )


def cmd_validate(a) -> int:
    table, diags = load_any(a.plan, a.set)
    print_diags(diags)
    if a.format == "json":
        print(
            json.dumps(
                {
                    "ok": True,
                    "fingerprint": table.fingerprint,
                    "diagnostics": list(table.diagnostics),
                },
                sort_keys=True,
            )
        )
    else:
        print(f"{a.plan}: ok ({len(table.graphs)} graphs, {len(diags)} warning(s))")
    return 0


def cmd_compile(a) -> int:
    from ..tools.summary import summary_json, summary_lines
    from .outputs import check_output

    check_output(a.output, [a.plan, a.profile])
    table, diags = load_any(a.plan, a.set)
    print_diags(diags)
    memory = None
    if a.memory or a.profile:  # before writing: a bad profile leaves no table behind
        from .tuning import memory_estimate

        memory = memory_estimate(table, a.profile)
    if a.output:
        table.save(a.output)
    if a.format == "json":
        out = summary_json(table)
        out["output"] = a.output
        if memory:
            out["memory"] = memory
        print(json.dumps(out, sort_keys=True))
        return 0
    print("\n".join(summary_lines(table)))
    if memory:
        from ..tools.memory import estimate_lines

        print("\n" + "\n".join(estimate_lines(memory)))
    if a.output:
        print(f"\nwrote {a.output} ({Path(a.output).stat().st_size // 1024} KiB)")
    else:
        print("\n(no table written; add -o table.json)")
    return 0


def cmd_explain(a) -> int:
    table, _ = load_any(a.plan, a.set)
    route = table.route(a.tokens, a.reqs, a.query_len, a.loras)
    s = table.settings
    ranks = (
        f"every one of the {s.tensor_parallel_size} TP ranks (of DP {s.data_parallel_size} x TP "
        f"{s.tensor_parallel_size}) replays this same route on its shard of the model, the "
        "all-reduces inside the graph"
        if s.tensor_parallel_size > 1
        else ""
    )
    if a.format == "json":
        out = route.to_json()
        out["parallel"] = {
            "data_parallel_size": s.data_parallel_size,
            "tensor_parallel_size": s.tensor_parallel_size,
        }
        print(json.dumps(out, sort_keys=True))
        return 0
    from ..tools.summary import count

    pad = count(route.padded_tokens, "token") + (
        f", {count(route.padded_reqs, 'request')}" if route.padded_reqs is not None else ""
    )
    graph = f"graph #{route.graph_id}" if route.graph_id >= 0 else "eager"
    print(
        f"{route.mode.name} ({graph}), padded to {pad}"
        + (", wants to micro-batch" if route.wants_ubatch else "")
    )
    for i, why in enumerate(route.reasons, 1):
        print(f"  {i}. {why}")
    if ranks:
        print(f"  {ranks}")
    return 0


def cmd_diff(a) -> int:
    from ..tools.diff import diff_json, diff_lines, diff_tables

    before, _ = load_any(a.a, a.set + a.set_a)  # --set: both sides; --set-a / --set-b: one
    after, _ = load_any(a.b, a.set + a.set_b)
    d = diff_tables(before, after)
    print(
        json.dumps(diff_json(d), sort_keys=True)
        if a.format == "json"
        else "\n".join(diff_lines(d, a.a, a.b))
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = _Parser(prog="plan", description="graphplan: compile CUDA-graph execution plans.")
    p.add_argument("--version", action="version", version=f"plan (graphplan) {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)

    def common(sp, sets=True):
        sp.add_argument(
            "--format",
            choices=("text", "json"),
            default="text",
            help="json: one JSON object on stdout (an error object on failure)",
        )
        if sets:
            sp.add_argument(
                "--set",
                action="append",
                metavar="KEY=VALUE",
                default=[],
                help="template variable (.j2 plans) or dotted plan key",
            )

    sp = sub.add_parser("validate", help="check a plan (or table) and print its diagnostics")
    sp.add_argument("plan")
    common(sp)
    sp.set_defaults(fn=cmd_validate)

    sp = sub.add_parser("compile", help="compile a plan into a dispatch table")
    sp.add_argument("plan")
    sp.add_argument("-o", "--output", help="where to write table.json (atomically)")
    sp.add_argument("--memory", action="store_true", help="print the graph-memory estimate")
    sp.add_argument("--profile", help="calibrated memory profile for --memory (implies it)")
    common(sp)
    sp.set_defaults(fn=cmd_compile)

    sp = sub.add_parser("explain", help="show where one batch goes, and why")
    sp.add_argument("plan", help="a plan or a compiled table.json")
    sp.add_argument(
        "--tokens",
        type=int,
        required=True,
        metavar="N",
        help="tokens in the batch (all requests' query tokens together)",
    )
    sp.add_argument(
        "--reqs",
        type=int,
        metavar="R",
        help="requests in the batch (with --query-len: tells uniform decode apart)",
    )
    sp.add_argument(
        "--query-len",
        type=int,
        metavar="L",
        help="the longest request's query length (decode_query_len for a uniform decode batch)",
    )
    sp.add_argument(
        "--loras",
        type=int,
        default=0,
        metavar="K",
        help="active LoRA adapters in the batch (default 0)",
    )
    common(sp)
    sp.set_defaults(fn=cmd_explain)

    sp = sub.add_parser("diff", help="compare two plans or tables")
    sp.add_argument("a", help="the plan or table before")
    sp.add_argument("b", help="the plan or table after")
    common(sp)
    sp.add_argument(
        "--set-a",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="override for A only (diff a plan against itself with --set-b k=v)",
    )
    sp.add_argument(
        "--set-b",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="override for B only; --set applies to both sides",
    )
    sp.set_defaults(fn=cmd_diff)

    from .tuning import add_tuning_commands

    add_tuning_commands(sub, common)
    from .engines import add_engine_commands

    add_engine_commands(sub, common)
    return p


def _wants_json(argv: list[str]) -> bool:
    """``--format json`` on the command line (looked up before parsing, which may fail)."""
    return any(
        a == "--format=json" or (a == "--format" and nxt == "json")
        for a, nxt in zip(argv, argv[1:] + [""])
    )


def _fail(argv: list[str], message: str, exit_code: int, kind: str, diagnostics=()) -> int:
    """Report an error: the message on stderr and, with --format json, a JSON error object on
    stdout (scripts reading stdout get one object either way); returns the exit code. Input
    echoed in the message is made ``visible`` (escapes shown, long values cut) line by line."""
    message = "\n".join(visible(line) for line in message.split("\n"))
    print(message, file=sys.stderr)
    if _wants_json(argv):
        shown, left_out = reported(diagnostics)  # the ones the message shows
        print(
            json.dumps(
                {
                    "ok": False,
                    "error": {
                        "kind": kind,
                        "exit_code": exit_code,
                        "message": message,
                        "diagnostics": [
                            {**d.to_json(), "file": visible(d.file), "line": d.line, "col": d.col}
                            for d in shown
                        ],
                        "diagnostics_left_out": left_out,
                    },
                },
                sort_keys=True,
            )
        )
    return exit_code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        return args.fn(args)
    except GraphplanError as e:
        return _fail(argv, str(e), e.exit_code, type(e).__name__, getattr(e, "diagnostics", ()))
    except ModuleNotFoundError as e:
        if e.name not in PLAN_EXTRA:
            raise
        return _fail(
            argv,
            f"plan: this command needs {e.name!r}, part of the plan extra: "
            "pip install -e '.[plan]' in the graphplan checkout",
            1,
            "MissingExtra",
        )
    except KeyboardInterrupt:
        print("plan: interrupted", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 1
