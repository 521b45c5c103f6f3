"""Docs that tell the truth (issue 27): what the README and the code say about themselves holds.

- graphplan installs from a clone (it is on no public index): the README says ``pip install -e``;
- names the README's examples use exist in the code;
- the server's ``Server`` header carries the package's one version;
- the GPU-only benchmarks say so, in their docstrings and in the README's list;
- the table's enums print their names (``FULL``, not ``2``);
- the usage line of ``plan export --engine vllm`` works when pasted into a shell.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

from graphplan.compiler import CudagraphMode, RuntimeMode, __version__, compile_plan
from graphplan.compiler.cli import main
from graphplan.compiler.records import AttentionSupport, Why

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_installs_from_a_clone_not_from_a_public_index():
    assert not re.search(r"pip install '?graphplan\[", README)
    assert 'pip install -e ".[hf]"' in README and 'pip install -e ".[runtime]"' in README


def test_the_runtime_example_pads_slot_mapping_with_a_name_the_model_defines():
    from graphplan.models.tiny_llama import TinyLlama

    assert "DUMMY_SLOT" not in README
    assert "pad=model.dummy_slot" in README and isinstance(TinyLlama.dummy_slot, property)


def test_the_server_header_carries_the_package_version():
    from graphplan.server.frontend.http_app import SERVER_HEADER

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert __version__ == re.search(r'(?m)^version = "([^"]+)"', pyproject).group(1)
    assert SERVER_HEADER == f"graphplan-server/{__version__}"


def _gpu_only() -> set[str]:
    out = set()
    for path in sorted((ROOT / "bench").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "GPU only:" in doc:
            out.add(path.name)
    return out


def test_gpu_only_benchmarks_say_so_in_their_docstrings_and_in_the_readme():
    gpu = _gpu_only()
    assert {"runtime_bench.py", "dbo_bench.py", "hf_bench.py"} <= gpu
    assert not gpu & {"compile_bench.py", "optimize_bench.py", "dp_sync_bench.py"}
    listed = README[README.index("The benchmark programs (`bench/`)") :]
    marked = set()
    for line in re.findall(r"- \*\*GPU\*\*[^\n]*(?:\n  [^\n]*)*", listed):
        marked |= set(re.findall(r"`(\w+\.py)`", line))
    assert marked == gpu


def test_the_enums_print_their_names():
    t = compile_plan(ROOT / "plans" / "llama3-8b-h100.yaml")
    route = t.route(num_tokens=24, num_reqs=24, max_query_len=1)
    assert str(route.mode) == f"{route.mode}" == "FULL" and route.mode == 2
    assert f"{RuntimeMode.PIECEWISE:>10}|" == " PIECEWISE|"
    assert f"{RuntimeMode.FULL:d}" == "2" and json.dumps([RuntimeMode.FULL]) == "[2]"
    assert str(CudagraphMode.FULL_AND_PIECEWISE) == "FULL_AND_PIECEWISE"
    assert f"{AttentionSupport.UNIFORM_BATCH}" == "UNIFORM_BATCH"
    assert str(Why.TOO_BIG) == "TOO_BIG"
    assert repr(RuntimeMode.FULL) == "<RuntimeMode.FULL: 2>"


def test_the_vllm_export_usage_line_works_when_pasted_into_a_shell(capsys):
    assert main(["export", str(ROOT / "plans" / "tiny-llama.yaml"), "--engine", "vllm"]) == 0
    text = capsys.readouterr().out
    use = next(ln for ln in text.splitlines() if ln.startswith("# use: "))
    words = shlex.split(use.removeprefix("# use: "))
    assert words[:3] == ["vllm", "serve", "MODEL"]
    flags = [w for ln in text.splitlines() if not ln.startswith("#") for w in shlex.split(ln)]
    assert words[3:] == flags
    cc = json.loads(words[words.index("--compilation-config") + 1])
    assert cc["cudagraph_mode"] == "FULL_AND_PIECEWISE" and cc["max_cudagraph_capture_size"] == 128
