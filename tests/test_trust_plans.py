"""Plans from a hostile author: templates cannot run code or hang, numbers are what the schema
says, every input is bounded the same way, and ``-o`` never destroys an input or a device."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from graphplan.compiler import PlanError, compile_plan, load_plan
from graphplan.compiler import template as T
from graphplan.compiler.cli import main
from graphplan.compiler.limits import MAX_DEPTH, MAX_PLAN_BYTES

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "plans" / "sweep.yaml.j2"
SWEEP_SETS = ["--set", "max_num_seqs=64", "--set", "spec_tokens=2"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def plan_error(path, overrides=None) -> list:
    with pytest.raises(PlanError) as e:
        compile_plan(path, overrides)
    return e.value.diagnostics


def template(tmp_path, body: str, name="plan.yaml.j2") -> Path:
    p = tmp_path / name
    p.write_text("version: 1\nname: t\n" + body)
    return p


# -- templates ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr",
    [
        "cycler.__init__.__globals__.os.system('touch PWNED')",
        "joiner.__init__.__globals__.os.system('touch PWNED')",
        "namespace.__init__.__globals__.os.system('touch PWNED')",
        "''.__class__.__mro__[1].__subclasses__()",
        "(''|attr('__class__'))",
        "'{0.__class__}'.format('')",
        "range.__self__",
        "lipsum()",
    ],
)
def test_a_template_cannot_reach_python_internals_or_run_commands(tmp_path, monkeypatch, expr):
    monkeypatch.chdir(tmp_path)
    p = template(tmp_path, f"x-note: {{{{ {expr} }}}}\n")
    [d] = plan_error(p)
    assert d.file == str(p) and d.line == 3 and d.code.startswith("template"), d
    assert not (tmp_path / "PWNED").exists()


def test_a_template_cannot_include_import_or_extend_files(tmp_path):
    for tag in ('{% include "/etc/passwd" %}', '{% import "x" as y %}', '{% extends "x" %}'):
        [d] = plan_error(template(tmp_path, f"\n{tag}\n"))
        assert (d.code, d.line) == ("template", 4) and "may not include" in d.message


def test_a_huge_range_fails_at_once_with_its_line(tmp_path):
    t0 = time.monotonic()
    [d] = plan_error(template(tmp_path, "{% for i in range(10**9) %}{% endfor %}\n"))
    assert time.monotonic() - t0 < 2
    assert (d.code, d.line) == ("template-limit", 3) and "range" in d.message


def test_a_slow_template_hits_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "MAX_RENDER_SECONDS", 0.3)
    body = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}\n"
    t0 = time.monotonic()
    [d] = plan_error(template(tmp_path, body))
    assert time.monotonic() - t0 < 3
    assert d.code == "template-limit" and "took more than 0.3 s" in d.message and d.line == 3


@pytest.mark.parametrize(
    "body",
    [
        "# {{ 'x' * (10 ** 8) }}\n",
        "# {% set s = 'x' * 4000000 %}{{ s ~ s }}\n",
        "# {% set s = 'x' * 4000000 %}{{ [s, s, s] }}\n",
        "# {{ 2 ** 100000 }}\n",
        "{% for i in range(10000) %}# {{ 'y' * 1000 }}\n{% endfor %}",
        "# {{ '%0999999999d' % 1 }}\n",
    ],
)
def test_a_template_cannot_build_text_past_the_plan_size_limit(tmp_path, body):
    [d] = plan_error(template(tmp_path, body))
    assert d.code == "template-limit" and d.line >= 3, d


@pytest.mark.parametrize(
    "body",
    [
        "# {{ 'a'|center(10**9) }}\n",
        "# {{ 'a'.ljust(10**9) }}\n",
        "# {{ '%s'|format(1) }}\n",
        "# {{ 'a'|indent(10**9) }}\n",
    ],
)
def test_filters_and_methods_that_build_unbounded_text_are_not_available(tmp_path, body):
    [d] = plan_error(template(tmp_path, body))
    assert d.code in ("template", "template-unsafe") and d.line == 3, d


def test_ordinary_template_features_still_work(tmp_path):
    p = template(
        tmp_path,
        "scheduler:\n  max_num_seqs: {{ [seqs, 8]|max }}\n"
        "cudagraph:\n  capture_sizes: [{% for i in range(1, 4) %}{{ 2 ** i }}"
        "{{ ', ' if not loop.last }}{% endfor %}]\n"
        "  mode: {{ modes|join('_') ~ '' }}\n"
        "# {% for k, v in d.items() %}{{ k }}={{ v|string|upper }} {% endfor %}\n",
    )
    t = compile_plan(p, {"seqs": 16, "modes": ["FULL", "AND", "PIECEWISE"], "d": {"a": "b"}})
    assert t.plan["scheduler"]["max_num_seqs"] == 16
    assert (
        list(t.settings.capture_sizes) == [2, 4, 8] and t.settings.mode.name == "FULL_AND_PIECEWISE"
    )


def test_a_reload_thread_is_not_wedged_by_a_slow_template(tmp_path, monkeypatch):
    """The time limit applies wherever a plan is compiled (the server's reload included)."""
    monkeypatch.setattr(T, "MAX_RENDER_SECONDS", 0.2)
    p = template(
        tmp_path, "{% for i in range(9999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}\n"
    )
    t0 = time.monotonic()
    with pytest.raises(
        PlanError,
        match=r"plan.yaml.j2:\d+:\d+: error\[template-limit\]: "
        r"template refused: rendering took more than",
    ):
        load_plan(p)
    assert time.monotonic() - t0 < 3


# -- --set on templates and tables (issue 17) -----------------------------------------------------


def test_a_dotted_set_on_a_template_is_an_error_naming_the_key(capsys):
    code, _, err = run(
        capsys, "validate", str(SWEEP), *SWEEP_SETS, "--set", "scheduler.max_num_seqs=8"
    )
    assert (
        code == 2
        and "--set scheduler.max_num_seqs: a dotted plan key cannot be set on a template" in err
        and "max_num_seqs, spec_tokens" in err
        and "Traceback" not in err
    )


def test_an_unused_template_variable_is_an_error(capsys):
    code, _, err = run(capsys, "validate", str(SWEEP), *SWEEP_SETS, "--set", "extra=3")
    assert code == 2 and "--set extra: the template has no variable 'extra'" in err
    assert "remove --set extra" in err


def test_set_on_a_compiled_table_is_an_error(capsys, tmp_path):
    table = tmp_path / "t.json"
    assert run(capsys, "compile", str(ROOT / "plans" / "tiny-llama.yaml"), "-o", str(table))[0] == 0
    for cmd in (["explain", str(table), "--tokens", "3"], ["validate", str(table)]):
        code, out, err = run(capsys, *cmd, "--set", "scheduler.max_num_seqs=8")
        assert code == 1 and out == "" and "--set applies to plans, not to a compiled table" in err


# -- numbers --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,path,fix",
    [
        ("scheduler: {max_num_seqs: 64.0}", "scheduler.max_num_seqs", "write 64"),
        ("cudagraph: {capture_sizes: [1.0, 2.0]}", "cudagraph.capture_sizes[0]", "write 1"),
        ("parallel: {data_parallel_size: 2.0}", "parallel.data_parallel_size", "write 2"),
        ("version: 1.0", "version", "write 1"),
    ],
)
def test_integral_floats_are_refused_with_a_located_error(tmp_path, text, path, fix):
    p = tmp_path / "plan.yaml"
    head = "name: x\n" if text.startswith("version") else "version: 1\nname: x\n"
    p.write_text(head + text + "\n")
    d = plan_error(p)[0]
    assert (d.code, d.path) == ("wrong-type", path) and d.line > 0 and fix in d.hint, d
    with pytest.raises(PlanError, match="expected integer"):  # the same rule for a dict plan
        compile_plan({"version": 1, "name": "x", "scheduler": {"max_num_seqs": 64.0}})


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_nan_and_infinity_are_refused_everywhere(tmp_path, value, capsys):
    p = tmp_path / "plan.yaml"
    p.write_text(f"version: 1\nname: x\nparallel: {{sync_timeout_s: {value}}}\n")
    d = plan_error(p)[0]
    assert d.path == "parallel.sync_timeout_s" and d.line == 3, d
    code, _, err = run(
        capsys,
        "validate",
        str(ROOT / "plans" / "tiny-llama.yaml"),
        "--set",
        f"parallel.sync_timeout_s={value}",
    )
    assert code == 2 and "parallel.sync_timeout_s" in err
    number = float(value.replace(".", ""))  # nan, inf, -inf
    with pytest.raises(
        PlanError,
        match=r"parallel.sync_timeout_s: -?(nan|inf) is not a finite "
        r"number",
    ):
        compile_plan({"version": 1, "name": "x", "parallel": {"sync_timeout_s": number}})


def test_a_5000_digit_integer_is_a_located_error_not_a_traceback(tmp_path, capsys):
    p = tmp_path / "plan.yaml"
    p.write_text("version: 1\nname: x\nscheduler: {max_num_seqs: " + "9" * 5000 + "}\n")
    d = plan_error(p)[0]
    assert (d.code, d.line) == ("out-of-range", 3)
    code, _, err = run(
        capsys,
        "validate",
        str(ROOT / "plans" / "tiny-llama.yaml"),
        "--set",
        "scheduler.max_num_seqs=" + "9" * 5000,
    )
    assert code == 2 and "Traceback" not in err and len(err) < 2000


# -- one set of bounds for files, --set values and rendered templates -----------------------------


def test_a_deep_set_value_is_an_error_not_a_recursion_error(capsys):
    deep = "[" * 3000 + "]" * 3000
    code, out, err = run(
        capsys, "validate", str(ROOT / "plans" / "tiny-llama.yaml"), "--set", f"lora={deep}"
    )
    assert code == 2 and out == "" and "too-deep" in err and "--set lora" in err


def test_an_alias_bomb_in_set_is_refused_quickly(capsys):
    levels = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    t0 = time.monotonic()
    code, _, err = run(
        capsys,
        "validate",
        str(ROOT / "plans" / "tiny-llama.yaml"),
        "--set",
        "lora={" + ", ".join(levels) + "}",
    )
    assert time.monotonic() - t0 < 5
    assert code == 2 and "too-large" in err


def test_api_overrides_and_dict_plans_get_the_same_bounds():
    deep: list = []
    node = deep
    for _ in range(MAX_DEPTH + 5):
        node.append([])
        node = node[0]
    with pytest.raises(PlanError, match="too-deep"):
        compile_plan(ROOT / "plans" / "tiny-llama.yaml", {"lora": deep})
    with pytest.raises(PlanError, match="too-deep"):
        compile_plan({"version": 1, "name": "x", "lora": deep})
    with pytest.raises(PlanError, match="not-finite"):
        compile_plan(SWEEP, {"max_num_seqs": float("nan"), "spec_tokens": 0})


def test_template_variables_are_bounded_like_the_file(tmp_path):
    with pytest.raises(PlanError, match="too-large"):
        compile_plan(SWEEP, {"max_num_seqs": "x" * (MAX_PLAN_BYTES + 1), "spec_tokens": 0})


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    code, _, err = run(capsys, "validate", str(fifo))
    assert time.monotonic() - t0 < 2
    assert code == 2 and "is a FIFO" in err and "regular files" in err


def test_a_device_is_refused_without_reading_it(capsys):
    code, _, err = run(capsys, "validate", "/dev/zero")
    assert code == 2 and "/dev/zero: error[not-a-file]: is a character device" in err


def test_a_file_above_the_limit_is_refused_from_its_size(tmp_path, monkeypatch):
    p = tmp_path / "plan.yaml"
    with open(p, "wb") as f:  # sparse: a huge size without writing it
        f.truncate(10 * MAX_PLAN_BYTES)
    reads = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    d = plan_error(p)[0]
    assert d.code == "too-large" and str(10 * MAX_PLAN_BYTES) in d.message and reads == []


# -- graph limits ---------------------------------------------------------------------------------

HUGE = (
    "version: 1\nname: huge\nscheduler: {max_num_seqs: 1024, max_num_batched_tokens: 1048576,"
    " decode_query_len: 64}\ncudagraph: {mode: PIECEWISE, capture_sizes: {preset: vllm, "
    "ceiling: 1048576}}\nlora: {enabled: true, max_loras: 256}\n"
)


def test_a_preset_with_a_huge_ceiling_is_refused_quickly(tmp_path):
    p = tmp_path / "plan.yaml"
    p.write_text(HUGE)
    t0 = time.monotonic()
    d = plan_error(p)[0]
    assert time.monotonic() - t0 < 3
    assert d.code == "too-many-sizes" and "at most 4096" in d.message


def test_too_many_graphs_names_the_limit_and_how_to_raise_it(tmp_path):
    p = tmp_path / "plan.yaml"
    p.write_text(
        "version: 1\nname: many\nscheduler: {max_num_seqs: 256, max_num_batched_tokens: "
        "8192}\ncudagraph: {capture_sizes: {ranges: [{from: 1, to: 4096, step: 1}]}}\n"
        "lora: {enabled: true, max_loras: 8}\n"
    )
    t0 = time.monotonic()
    d = plan_error(p)[0]
    assert time.monotonic() - t0 < 3
    assert d.code == "too-many-graphs" and "the limit is 4096" in d.message
    count = int(d.message.split(" graphs")[0].split()[-1])
    assert f"set limits.max_graphs: {count}" in d.hint
    t = compile_plan(p, {"limits.max_graphs": count})  # raised on purpose
    assert len(t.graphs) == count


def test_the_shipped_plans_are_within_the_default_graph_limit():
    for p in sorted((ROOT / "plans").glob("*.yaml")):
        assert len(compile_plan(p).graphs) <= 4096, p


# -- -o never destroys an input or a device -------------------------------------------------------


@pytest.fixture
def plan_copy(tmp_path) -> Path:
    p = tmp_path / "in.yaml"
    p.write_bytes((ROOT / "plans" / "tiny-llama.yaml").read_bytes())
    (tmp_path / "sub").mkdir()
    return p


@pytest.mark.parametrize("out", ["in.yaml", "sub/../in.yaml", "link.yaml", "hard.yaml"])
@pytest.mark.parametrize("cmd", ["compile", "report"])
def test_output_onto_an_input_is_refused_and_the_input_kept(
    capsys, plan_copy, monkeypatch, out, cmd
):
    monkeypatch.chdir(plan_copy.parent)
    (plan_copy.parent / "link.yaml").symlink_to("in.yaml")
    os.link(plan_copy, plan_copy.parent / "hard.yaml")
    before = plan_copy.read_bytes()
    code, _, err = run(capsys, cmd, "in.yaml", "-o", out)
    assert code == 1 and "is an input of this command" in err, err
    assert plan_copy.read_bytes() == before and (plan_copy.parent / "link.yaml").is_symlink()


def test_optimize_refuses_to_write_over_its_trace_or_plan(capsys, plan_copy, monkeypatch):
    monkeypatch.chdir(plan_copy.parent)
    trace = plan_copy.parent / "trace.jsonl"
    trace.write_text('{"num_tokens": 3, "num_reqs": 3, "max_query_len": 1}\n')
    for out in ("in.yaml", "trace.jsonl"):
        before = (plan_copy.parent / out).read_bytes()
        code, _, err = run(capsys, "optimize", "in.yaml", "--trace", "trace.jsonl", "-o", out)
        assert code == 1 and "is an input of this command" in err
        assert (plan_copy.parent / out).read_bytes() == before


def test_output_onto_a_device_or_a_symlink_to_one_is_refused(capsys, plan_copy, monkeypatch):
    monkeypatch.chdir(plan_copy.parent)
    (plan_copy.parent / "null").symlink_to("/dev/null")
    for out in ("/dev/null", "null"):
        code, _, err = run(capsys, "compile", "in.yaml", "-o", out)
        assert code == 1 and "is not a regular file" in err
    assert os.path.islink("null") and not os.path.isfile("/dev/null")


def test_output_to_a_new_or_regular_file_still_writes_atomically(capsys, plan_copy, monkeypatch):
    monkeypatch.chdir(plan_copy.parent)
    assert run(capsys, "compile", "in.yaml", "-o", "t.json")[0] == 0
    assert run(capsys, "compile", "in.yaml", "-o", "t.json")[0] == 0  # a regular file: replaced
    assert not [p for p in os.listdir(".") if p.endswith(".tmp")]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_trace_that_is_a_fifo_or_a_device_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    plan = str(ROOT / "plans" / "tiny-llama.yaml")
    for trace in (str(fifo), "/dev/zero"):
        t0 = time.monotonic()
        code, _, err = run(capsys, "report", plan, "--trace", trace, "-o", str(tmp_path / "r.html"))
        assert time.monotonic() - t0 < 5
        assert code == 1 and "cannot read trace" in err and "regular files" in err
    assert not (tmp_path / "r.html").exists()


def test_a_profile_that_is_a_device_is_refused_without_reading_it(capsys):
    code, out, err = run(
        capsys, "compile", str(ROOT / "plans" / "tiny-llama.yaml"), "--profile", "/dev/zero"
    )
    assert code == 1 and out == "" and "cannot read memory profile: is a character device" in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_table_that_is_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "table.json"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    code, out, err = run(capsys, "explain", str(fifo), "--tokens", "3")
    assert time.monotonic() - t0 < 5
    assert code == 2 and out == "" and "cannot read table: is a FIFO" in err
