"""Write an engine's command-line options as graphplan's flag data (run by hand, never imported).

Builds the parser the engine itself builds and prints every option string with what it consumes:

    python dump_flags.py vllm 0.11 vllm-0.11.json     # with that vLLM release installed
    python dump_flags.py sglang 0.5 sglang-0.5.json   # with that SGLang release installed

(engines log to stdout while they import, so the data goes to a file).

vLLM: the ``vllm serve`` parser (``vllm/entrypoints/openai/cli_args.py`` ``make_arg_parser``:
the serve options, ``FrontendArgs`` and ``AsyncEngineArgs.add_cli_args`` of
``vllm/engine/arg_utils.py``). SGLang: ``python -m sglang.launch_server``'s parser
(``python/sglang/srt/server_args.py`` ``ServerArgs.add_cli_args`` on an ``ArgumentParser``).
The engine and its Python dependencies must import; no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version as dist_version

SWITCHES = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse._AppendConstAction,
    argparse._CountAction,
    argparse._HelpAction,
    argparse._VersionAction,
    argparse.BooleanOptionalAction,
)


def arity(action: argparse.Action) -> int | str:
    """0 (a switch), 1, an int N, or argparse's '?', '*', '+'."""
    if isinstance(action, SWITCHES):
        return 0
    if action.nargs is None:
        return 1
    if isinstance(action.nargs, int) or action.nargs in ("?", "*", "+"):
        return action.nargs
    raise SystemExit(f"{action.option_strings}: nargs {action.nargs!r} is not handled")


def vllm_parser() -> argparse.ArgumentParser:
    import vllm.platforms

    # without a GPU vLLM finds no platform and its config defaults raise; the CPU platform
    # changes defaults only, never which options exist
    vllm.platforms.builtin_platform_plugins["cpu"] = lambda: "vllm.platforms.cpu.CpuPlatform"
    from vllm.entrypoints.openai.cli_args import make_arg_parser

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM <= 0.11.0
        from vllm.utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    return parser


SOURCES = {
    "vllm": "vllm/entrypoints/openai/cli_args.py make_arg_parser (vllm serve): serve options, "
    "FrontendArgs.add_cli_args, AsyncEngineArgs.add_cli_args (vllm/engine/arg_utils.py)",
    "sglang": "python/sglang/srt/server_args.py ServerArgs.add_cli_args "
    "(python -m sglang.launch_server)",
}


def main(engine: str, label: str, path: str) -> None:
    parser = vllm_parser() if engine == "vllm" else sglang_parser()
    options: dict[str, int | str] = {}
    deprecated: list[str] = []
    for action in parser._actions:
        for opt in action.option_strings:
            options[opt] = arity(action)
        if getattr(action, "deprecated", False):
            deprecated += action.option_strings
    out = {
        "_source": f"{engine} {dist_version(engine)} (PyPI release): {SOURCES[engine]}; "
        "written by compiler/engines/flags_data/dump_flags.py from the parser the engine builds",
        "engine": engine,
        "label": label,
        "release": dist_version(engine),
        "allow_abbrev": parser.allow_abbrev,
        "options": dict(sorted(options.items())),
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
