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


def modules_after(code: str) -> set[str]:
    """Top-level package names in sys.modules after running ``code`` in a fresh interpreter."""
    probe = code + "\nimport sys, json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_compiling_every_kind_of_plan_never_imports_torch():
    loaded = modules_after(
        "import compiler\n"
        "from compiler.cli import main\n"
        "t = compiler.compile_plan('plans/large-65k-lora8-dp8.yaml')\n"
        "compiler.compile_plan('plans/sweep.yaml.j2', {'max_num_seqs': 64, 'spec_tokens': 1})\n"
        "t.route(8, 8, 1).reasons\n"
        "assert main(['diff', 'plans/llama3-8b-h100.yaml', 'plans/eager.yaml']) == 0\n")
    assert "torch" not in loaded
    assert {"compiler", "yaml", "jsonschema", "jinja2"} <= loaded  # the probe did load them


def test_the_table_module_needs_no_yaml_stack(tmp_path):
    table = tmp_path / "t.json"
    subprocess.run([sys.executable, "-m", "compiler.cli", "compile", "plans/llama3-8b-lora8.yaml",
                    "-o", str(table)], cwd=ROOT, check=True, capture_output=True, timeout=120)
    loaded = modules_after(
        "from compiler.table import DispatchTable\n"
        f"t = DispatchTable.load({str(table)!r})\n"
        "r = t.route(8, 8, 1, 3); r.reasons; r.graph; r.to_json()\n")
    assert not loaded & set(YAML_STACK), loaded & set(YAML_STACK)
    assert "torch" not in loaded and "numpy" in loaded


def test_importing_compiler_alone_loads_no_yaml_stack():
    loaded = modules_after("import compiler")
    assert not loaded & set(YAML_STACK + ("torch",))


def test_the_runtime_loads_captures_and_steps_without_the_yaml_stack(tmp_path):
    """runtime/ never imports yaml, jsonschema or jinja2: a server loads table.json, not plans.
    The probe exercises every runtime module: FULL and piecewise capture on the CPU stand-in,
    a step of each, metrics, DP (a group of one) and ubatch slicing."""
    table = tmp_path / "t.json"
    subprocess.run([sys.executable, "-m", "compiler.cli", "compile", "plans/tiny-llama.yaml",
                    "-o", str(table)], cwd=ROOT, check=True, capture_output=True, timeout=120)
    loaded = modules_after(
        "import sys; sys.path.insert(0, 'examples')\n"
        "import runtime, runtime.dp, runtime.dp_runner, runtime.ubatch, runtime.piecewise\n"
        "import runtime.calibrate\n"
        "from tiny_llama import TinyLlama, TinyLlamaConfig, make_batch, static_inputs\n"
        "m = TinyLlama(TinyLlamaConfig(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1,\n"
        "              intermediate=32, max_model_len=16, num_cache_rows=64))\n"
        f"r = runtime.GraphRunner(m, runtime.load_table({str(table)!r}), static_inputs(m),\n"
        "                         progress=False)\n"
        "r.capture()\n"
        "r.step(make_batch(m, [(0, 0, [1, 2, 3])]), 1, 3)\n"
        "r.step(make_batch(m, [(0, 3, [4])]), 1, 1)\n"
        "assert r.stats()['replays_by_mode'] == {'PIECEWISE': 1, 'FULL': 1}\n"
        "runtime.render_prometheus(r.stats())\n"
        "runtime.ubatch.ubatch_slices([3, 5], 8, 2)\n")
    assert not loaded & set(YAML_STACK), loaded & set(YAML_STACK)
    assert {"torch", "runtime", "numpy"} <= loaded
