"""Hostile input through the real ``plan`` CLI (issue 27): each is a clear error naming the file,
exit code 2 (1 for a malformed command line), and nothing written.

- echoed input shows escapes as visible text (``\\x1b``) and long values cut with their length
  (``errors.visible``, applied where diagnostics and errors are printed);
- a ``--set`` template value is data: text that YAML would read as structure is refused;
- ``--set`` errors name the plan they apply to;
- a table's ``diagnostics`` are checked like the rest of the table; ``1e999`` and deep nesting in a
  table, a trace or an engine flag's JSON are errors, not tracebacks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_table import resealed  # the forger's helper

from graphplan.compiler import compile_plan
from graphplan.compiler.cli import main
from graphplan.compiler.errors import MAX_REPORT, MAX_REPORTED, visible

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "plans" / "tiny-llama.yaml")
ESC = "\x1b[2J\x1b]0;owned\x07"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny() -> dict:
    return json.loads(compile_plan(TINY).dumps())


def forged(tmp_path, data: dict, name: str = "t.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(resealed(data)))
    return path


# -- what errors echo -----------------------------------------------------------------------------


def test_visible_shows_escapes_and_cuts_long_runs_saying_their_length():
    assert visible("a\x1b[31mb\nc\u202ed") == "a\\x1b[31mb\\x0ac\\u202ed"
    shown = visible("key " + "k" * 1_000_000 + " end")
    assert "[1000000 characters]" in shown and shown.endswith(" end") and len(shown) < 200


def test_escape_sequences_in_a_plan_are_printed_visibly(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(f'version: 1\nname: x\n"{ESC.replace(chr(7), "")}": 1\n'.replace("\x1b", "\\e"))
    out = tmp_path / "table.json"
    code, stdout, err = run(capsys, "compile", plan, "-o", out)
    assert code == 2 and stdout == "" and not out.exists()
    assert "\x1b" not in err and "\\x1b[2J\\x1b]0;owned" in err
    assert f"{plan}:3:1: error[unknown-key]" in err


def test_a_megabyte_value_is_echoed_cut_with_its_length(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("version: 1\nname: x\ncudagraph: {mode: " + "K" * 1_000_000 + "}\n")
    code, _, err = run(capsys, "validate", plan)
    assert code == 2 and "[1000002 characters]" in err and len(err) < 1000
    assert "is not one of NONE, PIECEWISE" in err  # the message around it survives


def test_a_megabyte_escape_laden_set_value_is_echoed_visibly_and_short(capsys):
    code, _, err = run(capsys, "validate", TINY, "--set", "scheduler.max_num_seqs=" + ESC * 50_000)
    assert code == 2 and "\x1b" not in err and "\\x1b[2J" in err and len(err) < 4000
    assert err.startswith(f"{TINY}:") and "scheduler.max_num_seqs" in err


# -- --set -------------------------------------------------------------------------------------------


def template(tmp_path) -> Path:
    path = tmp_path / "plan.yaml.j2"
    path.write_text(
        "version: 1\nname: {{ n }}\nscheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}\n"
    )
    return path


@pytest.mark.parametrize(
    "value",
    ["x\nlimits: {max_graphs: 1}", "x\r\nlimits: {max_graphs: 1}", "a, b", "x]", "[ok, 'y\nz: 1']"],
)
def test_a_set_template_value_cannot_inject_yaml(tmp_path, capsys, value):
    path, out = template(tmp_path), tmp_path / "table.json"
    code, stdout, err = run(capsys, "compile", path, "--set", f"n={value}", "-o", out)
    assert code == 2 and stdout == "" and not out.exists()
    assert err.startswith(f"{path}: error[template-value]: --set n=")
    assert "which YAML would read as structure" in err and "max_graphs" not in err.split("(")[-1]


def test_a_set_template_value_that_is_data_renders(tmp_path, capsys):
    code, _, err = run(capsys, "validate", template(tmp_path), "--set", "n=my-plan.v2")
    assert code == 0, err


def test_a_set_list_renders_as_json_whatever_its_strings(tmp_path):
    path = tmp_path / "plan.yaml.j2"
    path.write_text(
        "version: 1\nname: x\nscheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}\n"
        "cudagraph: {capture_sizes: {{ sizes }}, splitting_ops: {{ ops }}}\n"
    )
    t = compile_plan(path, {"sizes": [1, 2, 4], "ops": ["attention"]})
    assert list(t.capture_sizes) == [1, 2, 4]


def test_set_errors_name_the_plan_they_apply_to(capsys, tmp_path):
    code, _, err = run(capsys, "validate", TINY, "--set", "lora=" + "[" * 3000)
    assert code == 2 and err.startswith(f"{TINY}: error[too-deep]: --set lora=[[[")
    code, _, err = run(capsys, "validate", TINY, "--set", "scheduler.max_num_seqs=1.0e+999")
    assert code == 2 and err.startswith(f"{TINY}: error[not-finite]: --set scheduler.max_num_seqs=")
    code, _, err = run(capsys, "compile", TINY, "--set", "novalue", "-o", tmp_path / "t.json")
    assert code == 1 and f"{TINY}: --set 'novalue': expected KEY=VALUE" in err
    assert not (tmp_path / "t.json").exists()


# -- tables ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "diagnostics,message",
    [
        ([{"code": "x"}], "diagnostics[0]: missing 'severity'"),
        ([7], "diagnostics[0]: expected an object, got int"),
        (
            [{"code": 1, "severity": "warning", "path": "", "message": "", "hint": ""}],
            "diagnostics[0].code: expected str, got int",
        ),
        (
            [{"code": "Bad Code", "severity": "warning", "path": "", "message": "", "hint": ""}],
            "diagnostics[0].code: 'Bad Code' is not a kebab-case code",
        ),
        (
            [{"code": "x", "severity": "fatal", "path": "", "message": "", "hint": ""}],
            "diagnostics[0].severity: 'fatal' is not warning or error",
        ),
        (
            [{"code": "x", "severity": "warning", "path": "", "message": "m" * 10**5, "hint": ""}],
            "diagnostics[0].message: 100000 characters",
        ),
    ],
)
def test_a_tables_malformed_diagnostics_are_refused_before_report(
    tiny, tmp_path, capsys, diagnostics, message
):
    path, out = forged(tmp_path, {**tiny, "diagnostics": diagnostics}), tmp_path / "r.html"
    code, _, err = run(capsys, "report", path, "-o", out)
    assert code == 2 and not out.exists() and f"{path}: {message}" in err, err


def test_1e999_in_a_table_is_an_error_not_a_traceback(tiny, tmp_path, capsys):
    path = forged(tmp_path, tiny)
    text = path.read_text().replace('"sync_timeout_s": ', '"sync_timeout_s": 1e999, "x": ')
    path.write_text(text)
    out = tmp_path / "r.html"
    code, _, err = run(capsys, "report", path, "-o", out)
    assert code == 2 and not out.exists()
    assert "the number 1e999 is out of range (not a finite float)" in err


@pytest.mark.parametrize("depth", [40, 985, 5000])
def test_a_deeply_nested_table_is_an_error_not_a_recursion_error(tiny, tmp_path, capsys, depth):
    path = forged(tmp_path, tiny)
    text = path.read_text().replace(
        '"diagnostics": []', f'"diagnostics": [{"[" * depth}{"]" * depth}]'
    )
    path.write_text(text)
    out = tmp_path / "r.html"
    code, _, err = run(capsys, "report", path, "-o", out)
    assert code == 2 and not out.exists() and "nested more than 32 levels" in err, err


def test_a_deeply_nested_trace_line_is_an_error(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("[" * 100_000 + "\n")
    out = tmp_path / "r.html"
    code, _, err = run(capsys, "report", TINY, "--trace", trace, "-o", out)
    assert code == 1 and not out.exists() and f"{trace}:1: not a trace step (nested too" in err


def test_deep_json_in_an_engine_flag_is_an_error_not_a_recursion_error(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    for deep in ("[" * 100_000, "[" * 500 + "]" * 500):
        code, _, err = run(
            capsys, "import", "--engine", "vllm", "-o", out, "--", "--compilation-config", deep
        )
        assert code == 2 and not out.exists() and "argument 1 (--compilation-config)" in err


def test_the_installed_plan_command_prints_hostile_input_visibly(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text('version: 1\nname: x\ncudagraph: {mode: "\\e[2J' + "K" * 300_000 + '"}\n')
    exe = Path(sys.executable).with_name("plan")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "graphplan.compiler.cli"]
    out = tmp_path / "t.json"
    done = subprocess.run(
        cmd + ["compile", str(plan), "-o", str(out)], capture_output=True, timeout=120
    )
    assert done.returncode == 2 and not out.exists() and done.stdout == b""
    assert b"\x1b" not in done.stderr and b"\\x1b[2J" in done.stderr
    assert b"[300009 characters]" in done.stderr and len(done.stderr) < 1000


# -- bounded reports ------------------------------------------------------------------------------


def test_a_plan_with_49000_unknown_keys_reports_the_first_and_counts_the_rest(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("version: 1\nname: x\n" + "".join(f"k{i}: 1\n" for i in range(49_000)))
    code, out, err = run(capsys, "validate", plan)
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == MAX_REPORTED + 1
    assert lines[0] == f"{plan}:3:1: error[unknown-key]: k0: unknown key 'k0' (known keys: " + (
        "version, name, scheduler, cudagraph, lora, parallel, limits)"
    )
    assert lines[-1] == f"... and {49_000 - MAX_REPORTED} more errors (the first are shown above)"
    code, out, err = run(capsys, "validate", plan, "--format", "json")
    error = json.loads(out)["error"]
    assert len(error["diagnostics"]) == MAX_REPORTED
    assert error["diagnostics_left_out"] == 49_000 - MAX_REPORTED
    assert len(out) < 16_000 and len(err) < 4_000


def test_a_report_of_long_errors_stays_under_64_kib_in_text_and_json(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    key = " ".join(["\\e[2J"] * 700)  # long, with spaces (no run to cut), and escapes
    plan.write_text(
        "version: 1\nname: x\nscheduler:\n"
        + "".join(f'  ? "{key} {i}"\n  : 1\n' for i in range(600))
    )
    code, out, err = run(capsys, "validate", plan, "--format", "json")
    assert code == 2 and "\x1b" not in out + err
    assert len(err) < MAX_REPORT + 5_000 and len(out) < 64 * 1024
    error = json.loads(out)["error"]
    assert error["diagnostics_left_out"] == 600 - len(error["diagnostics"]) > 500
    assert err.splitlines()[-1].startswith(f"... and {error['diagnostics_left_out']} more errors")


def test_thousands_of_warnings_print_the_first_and_a_count(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "version: 1\nname: x\nscheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}\n"
        f"cudagraph: {{capture_sizes: {list(range(1, 4097))}}}\n"
    )
    code, out, err = run(capsys, "validate", plan)
    lines = err.splitlines()
    assert code == 0 and len(lines) == MAX_REPORTED + 1 and out.startswith(f"{plan}: ok")
    assert "warning[size-dropped]: cudagraph.capture_sizes[64]: size 65 is above" in lines[0]
    assert lines[-1] == f"... and {4032 - MAX_REPORTED} more warnings (the first are shown above)"
    code, out, _ = run(capsys, "validate", plan, "--format", "json")
    assert len(json.loads(out)["diagnostics"]) == 4032  # the data keeps them all


# -- --set values are reported at the --set ----------------------------------------------------


def test_a_set_value_the_schema_refuses_is_reported_at_the_set_not_the_files_line(capsys):
    code, out, err = run(capsys, "validate", TINY, "--set", "cudagraph.capture_sizes=[0]")
    assert code == 2 and out == ""
    assert err == (
        f"{TINY}: error[out-of-range]: cudagraph.capture_sizes[0]: "
        "--set cudagraph.capture_sizes=[0]: 0 must be >= 1\n"
    )
    code, _, err = run(capsys, "validate", TINY, "--set", "scheduler.max_seqs=4")
    assert code == 2 and err == (
        f"{TINY}: error[unknown-key]: scheduler.max_seqs: --set scheduler.max_seqs=4: "
        "unknown key 'max_seqs' (did you mean 'max_num_seqs'?)\n"
    )


def test_a_long_set_value_is_shown_cut_in_its_error(capsys):
    code, _, err = run(
        capsys, "validate", TINY, "--set", f"cudagraph.capture_sizes={[1] * 4000 + [0]}"
    )
    assert code == 2 and len(err) < 1000
    assert "--set cudagraph.capture_sizes=[1, 1, 1" in err and "[12003 characters]" in err
