"""Import boundaries (DESIGN.md): the compiler never imports torch; the table module, which the
runtime shares, needs neither the YAML stack nor jsonschema nor Jinja2. Each check runs in a fresh
interpreter so nothing imported by other tests leaks in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
YAML_STACK = ("yaml", "jsonschema", "jinja2")


def compiled_table(plan: str, tmp_path: Path) -> Path:
    """``plan compile`` of a shipped plan, in its own process, to ``tmp_path/t.json``."""
    table = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "graphplan.compiler.cli", "compile", plan, "-o", str(table)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=120)
    return table


def modules_after(code: str, cwd=ROOT) -> set[str]:
    """Module names in sys.modules (top-level names and graphplan's subpackages) after running
    ``code`` in a fresh interpreter."""
    probe = code + (
        "\nimport sys, json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules}"
        " | {'.'.join(m.split('.')[:2]) for m in sys.modules if m.startswith('graphplan.')})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_compiling_every_kind_of_plan_never_imports_torch():
    loaded = modules_after(
        "from graphplan import compiler\n"
        "from graphplan.compiler.cli import main\n"
        "t = compiler.compile_plan('plans/large-65k-lora8-dp8.yaml')\n"
        "compiler.compile_plan('plans/sweep.yaml.j2', {'max_num_seqs': 64, 'spec_tokens': 1})\n"
        "t.route(8, 8, 1).reasons\n"
        "assert main(['diff', 'plans/llama3-8b-h100.yaml', 'plans/eager.yaml']) == 0\n"
    )
    assert "torch" not in loaded
    assert {
        "graphplan.compiler",
        "yaml",
        "jsonschema",
        "jinja2",
    } <= loaded  # the probe did load them


def test_the_table_module_needs_no_yaml_stack(tmp_path):
    table = compiled_table("plans/llama3-8b-lora8.yaml", tmp_path)
    loaded = modules_after(
        "from graphplan.compiler.table import DispatchTable\n"
        f"t = DispatchTable.load({str(table)!r})\n"
        "r = t.route(8, 8, 1, 3); r.reasons; r.graph; r.to_json()\n"
    )
    assert not loaded & set(YAML_STACK), loaded & set(YAML_STACK)
    assert "torch" not in loaded and "numpy" in loaded


def test_importing_compiler_alone_loads_no_yaml_stack():
    loaded = modules_after("import graphplan.compiler")
    assert not loaded & set(YAML_STACK + ("torch",))


def test_the_runtime_loads_captures_and_steps_without_the_yaml_stack(tmp_path):
    """runtime/ never imports yaml, jsonschema or jinja2: a server loads table.json, not plans.
    The probe exercises every runtime module: FULL and piecewise capture on the CPU stand-in,
    a step of each, metrics, DP (a group of one) and ubatch slicing."""
    table = compiled_table("plans/tiny-llama.yaml", tmp_path)
    loaded = modules_after(
        "from graphplan import runtime\n"
        "import graphplan, graphplan.runtime.dp.agreement, graphplan.runtime.dp.runner, graphplan.runtime.dp.ubatch\n"
        "import graphplan.runtime.calibrate\n"
        "from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, make_batch, static_inputs\n"
        "m = TinyLlama(TinyLlamaConfig(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1,\n"
        "              intermediate=32, max_model_len=16, num_cache_rows=64))\n"
        f"r = runtime.GraphRunner(m, runtime.load_table({str(table)!r}), static_inputs(m),\n"
        "                         progress=False)\n"
        "r.capture()\n"
        "r.step(make_batch(m, [(0, 0, [1, 2, 3])]), 1, 3)\n"
        "r.step(make_batch(m, [(0, 3, [4])]), 1, 1)\n"
        "assert r.stats()['replays_by_mode'] == {'PIECEWISE': 1, 'FULL': 1}\n"
        "runtime.render_prometheus(r.stats())\n"
        "graphplan.runtime.dp.ubatch.ubatch_slices([3, 5], 8, 2)\n"
    )
    assert not loaded & set(YAML_STACK), loaded & set(YAML_STACK)
    assert {"torch", "graphplan.runtime", "numpy"} <= loaded


API_PROBE = (
    "from graphplan.compiler import compile_plan\n"
    "from graphplan.runtime import GraphRunner, load_table\n"
    "import graphplan.schemas\n"
)


def test_a_users_schemas_py_and_runtime_folder_do_not_shadow_the_api(tmp_path):
    """Generic top-level names were the old layout's trap: a user's own ``schemas.py`` or
    ``runtime/`` in the working directory must not break graphplan's imports."""
    (tmp_path / "schemas.py").write_text("raise SystemExit('the user schemas.py was imported')\n")
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "__init__.py").write_text(
        "raise SystemExit('the user runtime/ was imported')\n"
    )
    (tmp_path / "compiler.py").write_text("raise SystemExit('the user compiler.py was imported')\n")
    loaded = modules_after(
        API_PROBE + f"compile_plan({str(ROOT / 'plans' / 'eager.yaml')!r})\n", cwd=tmp_path
    )
    assert {"graphplan.compiler", "graphplan.runtime", "graphplan.schemas"} <= loaded


def test_the_old_top_level_names_are_not_installed(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", "import compiler"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "No module named 'compiler'" in out.stderr, out.stderr


def test_a_wheel_installs_only_graphplan_packages(tmp_path):
    """``pip install .`` puts graphplan/{compiler,runtime,schemas} into site-packages and nothing
    else: no generic top-level names, with the schemas and the report template as package data."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
    )
    top = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert top - {"bin"} == {"graphplan"}, top
    assert not (target / "graphplan" / "__init__.py").exists()  # a namespace over the three halves
    assert {p.name for p in (target / "graphplan").iterdir()} >= {"compiler", "runtime", "schemas"}
    assert (target / "graphplan" / "schemas" / "plan.schema.json").is_file()
    assert (target / "graphplan" / "compiler" / "templates" / "report.html.j2").is_file()
    assert not any(
        p.name in {"tests", "examples", "bench", "plans"} for p in (target / "graphplan").iterdir()
    )


BLOCK_PLAN_EXTRA = (
    "import sys, importlib.abc\n"
    "class Block(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('yaml', 'jsonschema', 'jinja2'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, Block())\n"
)


def test_the_runtime_serves_a_table_with_the_plan_extra_absent(tmp_path):
    """A server installs numpy + torch alone: with yaml/jsonschema/jinja2 unimportable, the
    runtime still loads a table, captures and steps."""
    table = compiled_table("plans/tiny-llama.yaml", tmp_path)
    loaded = modules_after(
        BLOCK_PLAN_EXTRA + "from graphplan.runtime import GraphRunner, load_table\n"
        "from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, make_batch, static_inputs\n"
        "m = TinyLlama(TinyLlamaConfig(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1,\n"
        "              intermediate=32, max_model_len=16, num_cache_rows=64))\n"
        f"r = GraphRunner(m, load_table({str(table)!r}), static_inputs(m), progress=False)\n"
        "r.capture(); r.step(make_batch(m, [(0, 0, [1])]), 1, 1)\n",
        cwd=tmp_path,
    )
    assert not loaded & set(YAML_STACK)


def test_the_cli_names_the_extra_to_install_when_the_yaml_stack_is_missing(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCK_PLAN_EXTRA + "from graphplan.compiler.cli import main\n"
            f"sys.exit(main(['validate', {str(ROOT / 'plans' / 'eager.yaml')!r}]))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert (
        "pip install -e '.[plan]' in the graphplan checkout" in out.stderr
        and "Traceback" not in out.stderr
    )
