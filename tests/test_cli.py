"""The ``plan`` CLI: commands in text and JSON, exit codes 0/2/1, errors without tracebacks, no
partial output files, every shipped plan compiles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from graphplan.compiler import DispatchTable, compile_plan
from graphplan.compiler.cli import main

ROOT = Path(__file__).resolve().parents[1]
PLANS = sorted(p for p in (ROOT / "plans").iterdir() if p.is_file())
H100 = str(ROOT / "plans" / "llama3-8b-h100.yaml")
LORA = str(ROOT / "plans" / "llama3-8b-lora8.yaml")
SWEEP = str(ROOT / "plans" / "sweep.yaml.j2")
# what each template needs (read from plans/sweep.yaml.j2's header)
TEMPLATE_SETS = {"sweep.yaml.j2": ["--set", "max_num_seqs=128", "--set", "spec_tokens=2"]}


def plan_cmd(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphplan.compiler.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture
def bad_plan(tmp_path) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text("version: 1\nname: bad\ncudagraph:\n  mode: FULL_DECODE\n")
    return p


@pytest.fixture(scope="module")
def h100_table(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tables") / "h100.json"
    compile_plan(H100).save(path)
    return path


# -- as a program ---------------------------------------------------------------------------------


def test_compile_as_a_subprocess_writes_the_table(tmp_path):
    out = tmp_path / "table.json"
    p = plan_cmd("compile", H100, "-o", str(out))
    assert (p.returncode, p.stderr) == (0, "")
    assert out.read_bytes() == compile_plan(H100).dumps()
    assert p.stdout.splitlines()[0].startswith("plan llama3-8b-h100  fingerprint sha256:")
    assert f"wrote {out} (" in p.stdout


def test_an_invalid_plan_as_a_subprocess_exits_2_with_a_located_error(bad_plan, tmp_path):
    out = tmp_path / "table.json"
    p = plan_cmd("compile", str(bad_plan), "-o", str(out))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith(f"{bad_plan}:4:9: error[bad-value]: cudagraph.mode: ")
    assert "(did you mean 'FULL_DECODE_ONLY'?)" in p.stderr
    assert "Traceback" not in p.stderr and not out.exists()


def test_a_corrupted_table_as_a_subprocess_exits_2(h100_table, tmp_path):
    broken = tmp_path / "t.json"
    broken.write_bytes(h100_table.read_bytes().replace(b'"num_tokens":512', b'"num_tokens":511', 1))
    p = plan_cmd("explain", str(broken), "--tokens", "8")
    assert p.returncode == 2 and "corrupted table: checksum mismatch" in p.stderr
    assert "Traceback" not in p.stderr


def test_bad_arguments_as_a_subprocess_exit_1_with_usage():
    p = plan_cmd("compil", H100)
    assert p.returncode == 1 and "(did you mean 'compile'?)" in p.stderr
    assert "usage: plan" in p.stderr and "Traceback" not in p.stderr


def test_help_exits_0():
    p = plan_cmd("--help")
    assert p.returncode == 0 and "compile" in p.stdout


def test_an_unwritable_output_as_a_subprocess_exits_1(tmp_path):
    p = plan_cmd("compile", H100, "-o", str(tmp_path / "no" / "such" / "dir" / "t.json"))
    assert p.returncode == 1 and "cannot write here" in p.stderr and "Traceback" not in p.stderr


# -- validate -------------------------------------------------------------------------------------


def test_validate_prints_ok_with_counts(capsys):
    code, out, err = run(capsys, "validate", H100)
    assert (code, out, err) == (0, f"{H100}: ok (86 graphs, 0 warning(s))\n", "")


def test_validate_prints_warnings_to_stderr_with_their_location(capsys):
    path = str(ROOT / "plans" / "deepseek-v3-dp8-dbo.yaml")
    code, out, err = run(capsys, "validate", path)
    assert code == 0 and out == f"{path}: ok (95 graphs, 1 warning(s))\n"
    assert err == (
        f"{path}:11:18: warning[size-rounded]: cudagraph.capture_sizes: size 1 moved "
        "to 2, a multiple of decode_query_len=2 (use multiples of 2)\n"
    )


def test_validate_json(capsys):
    code, out, _ = run(capsys, "validate", H100, "--format", "json")
    assert code == 0
    assert json.loads(out) == {
        "ok": True,
        "fingerprint": compile_plan(H100).fingerprint,
        "diagnostics": [],
    }


def test_validate_an_invalid_plan_exits_2(capsys, bad_plan):
    code, out, err = run(capsys, "validate", str(bad_plan))
    assert (code, out) == (2, "") and "error[bad-value]" in err


# -- compile --------------------------------------------------------------------------------------


def test_compile_text_shows_graphs_and_padding_per_routine(capsys):
    code, out, err = run(capsys, "compile", H100)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[1] == (
        "mode FULL_AND_PIECEWISE; attention ALWAYS; q=1; max_num_seqs=256; "
        "max_num_batched_tokens=8192"
    )
    assert lines[2] == "capture sizes (51): 1 2 4 8-256/8 272-512/16"
    assert lines[3] == "graphs: 86 (35 FULL, 51 PIECEWISE)"
    assert [line.split()[:2] for line in lines[6:9]] == [
        ["decode", "FULL"],
        ["mixed", "PIECEWISE"],
        ["eager", "NONE"],
    ]
    assert lines[6].endswith("7 @ 9") and lines[7].endswith("15 @ 257")
    assert "513..8192 tokens" in lines[8]
    assert lines[-1] == "(no table written; add -o table.json)"


def test_compile_json_is_stable_for_scripts(capsys, tmp_path):
    out_path = tmp_path / "t.json"
    code, out, _ = run(capsys, "compile", H100, "--format", "json", "-o", str(out_path))
    data = json.loads(out)
    assert code == 0 and out == json.dumps(data, sort_keys=True) + "\n"
    assert (data["name"], data["mode"], data["num_graphs"], data["output"]) == (
        "llama3-8b-h100",
        "FULL_AND_PIECEWISE",
        86,
        str(out_path),
    )
    assert data["capture_sizes"] == list(compile_plan(H100).settings.capture_sizes)
    assert [
        (c["routine"], c["mode"], c["worst_padding"], c["worst_at"]) for c in data["coverage"]
    ] == [("decode", "FULL", 7, 9), ("mixed", "PIECEWISE", 15, 257)]
    _, again, _ = run(capsys, "compile", H100, "--format", "json", "-o", str(out_path))
    assert again == out


def test_compile_writes_the_same_bytes_as_the_api(capsys, tmp_path):
    out_path = tmp_path / "t.json"
    assert run(capsys, "compile", H100, "-o", str(out_path))[0] == 0
    assert out_path.read_bytes() == compile_plan(H100).dumps()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_an_invalid_plan_leaves_no_output_and_an_existing_table_untouched(
    capsys, tmp_path, bad_plan
):
    out_path = tmp_path / "t.json"
    code, out, err = run(capsys, "compile", str(bad_plan), "-o", str(out_path))
    assert (code, out) == (2, "") and not out_path.exists()
    out_path.write_bytes(b"previous table")
    assert run(capsys, "compile", str(bad_plan), "-o", str(out_path))[0] == 2
    assert out_path.read_bytes() == b"previous table"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "t.json"]


@pytest.mark.parametrize("where", ["missing-dir", "a-directory"])
def test_an_unwritable_output_exits_1_and_writes_nothing(capsys, tmp_path, where):
    target = tmp_path / "missing" / "t.json" if where == "missing-dir" else tmp_path
    code, out, err = run(capsys, "compile", H100, "-o", str(target))
    assert code == 1 and out == ""
    assert ("cannot write here" if where == "missing-dir" else "is a directory") in err
    assert list(tmp_path.iterdir()) == []


def test_set_overrides_a_plain_plan(capsys):
    code, out, _ = run(
        capsys, "compile", H100, "--set", "scheduler.max_num_seqs=16", "--format", "json"
    )
    assert code == 0 and json.loads(out)["capture_sizes"] == [1, 2, 4, 8, 16, 24, 32]


def test_set_renders_a_template(capsys):
    code, out, _ = run(
        capsys, "compile", SWEEP, *TEMPLATE_SETS["sweep.yaml.j2"], "--format", "json"
    )
    assert code == 0 and json.loads(out)["name"] == "sweep-seqs128-spec2"


def test_a_template_without_its_variables_exits_2(capsys):
    code, out, err = run(capsys, "compile", SWEEP)
    assert (code, out) == (2, "")
    assert err.startswith(
        f"{SWEEP}:5:1: error[template-undefined]: template variable "
        "'max_num_seqs' is undefined (pass it with --set max_num_seqs=VALUE)"
    )


@pytest.mark.parametrize("pair", ["novalue", "=3"])
def test_a_malformed_set_exits_1(capsys, pair):
    code, out, err = run(capsys, "compile", H100, "--set", pair)
    assert (code, out) == (1, "") and "expected KEY=VALUE" in err


# -- explain --------------------------------------------------------------------------------------


def test_explain_text_gives_the_route_and_the_numbered_reasons(capsys):
    code, out, _ = run(capsys, "explain", H100, "--tokens", "9", "--reqs", "9", "--query-len", "1")
    gid = compile_plan(H100).route(9, 9, 1).graph_id
    assert code == 0
    assert out.splitlines() == [
        f"FULL (graph #{gid}), padded to 16 tokens, 16 requests",
        "  1. batch: 9 tokens, 9 requests, max_query_len 1 -> uniform decode (every request has "
        "q=1 tokens)",
        "  2. pad: 9 -> 16 tokens (smallest capture size >= 9)",
        f"  3. FULL decode graph #{gid}: key (16 tokens, 16 requests, uniform)",
    ]


def test_explain_json_is_the_route(capsys):
    code, out, _ = run(
        capsys,
        "explain",
        LORA,
        "--tokens",
        "300",
        "--reqs",
        "3",
        "--query-len",
        "200",
        "--loras",
        "3",
        "--format",
        "json",
    )
    data = json.loads(out)
    assert code == 0 and out == json.dumps(data, sort_keys=True) + "\n"
    assert (data["mode"], data["graph_id"], data["padded_tokens"], data["padded_reqs"]) == (
        "NONE",
        -1,
        300,
        3,
    )
    assert data["graph"] is None and data["wants_ubatch"] is False
    assert data["reasons"][1] == "LoRA: 3 active adapter(s) -> captured case num_active_loras=4"
    assert "exceed the largest capture size 256" in data["reasons"][-1]


def test_explain_of_a_tp_plan_says_every_tp_rank_replays_the_route(capsys):
    sets = ["--set", "parallel.tensor_parallel_size=4", "--set", "parallel.data_parallel_size=2"]
    code, out, _ = run(
        capsys, "explain", H100, "--tokens", "9", "--reqs", "9", "--query-len", "1", *sets
    )
    assert code == 0 and out.splitlines()[-1] == (
        "  every one of the 4 TP ranks (of DP 2 x TP 4) replays this same route on its shard of "
        "the model, the all-reduces inside the graph"
    )
    code, out, _ = run(capsys, "explain", H100, "--tokens", "9", "--format", "json", *sets)
    assert json.loads(out)["parallel"] == {"data_parallel_size": 2, "tensor_parallel_size": 4}
    code, out, _ = run(capsys, "explain", H100, "--tokens", "9", "--reqs", "9", "--query-len", "1")
    assert "TP ranks" not in out


def test_explain_a_table_matches_explain_its_plan(capsys, h100_table):
    args = ["--tokens", "300", "--reqs", "4", "--query-len", "150"]
    from_plan = run(capsys, "explain", H100, *args)
    from_table = run(capsys, "explain", str(h100_table), *args)
    assert from_plan == from_table and from_plan[0] == 0
    assert from_plan[1].startswith("PIECEWISE (graph #")


@pytest.mark.parametrize(
    "args,match",
    [
        (["--tokens", "0"], "num_tokens=0 is outside 1..8192"),
        (["--tokens", "8", "--reqs", "9"], "num_reqs=9 must be in"),
        (["--tokens", "8", "--loras", "1"], "num_active_loras=1 is outside 0..0"),
    ],
)
def test_explain_an_impossible_batch_exits_1(capsys, args, match):
    code, out, err = run(capsys, "explain", H100, *args)
    assert (code, out) == (1, "") and match in err


def test_explain_a_bad_table_exits_2(capsys, tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text('{"format": "graphplan.table", "format_version": 99}')
    code, out, err = run(capsys, "explain", str(bad), "--tokens", "8")
    assert (code, out) == (2, "")
    assert err == (
        f"{bad}: table format version 99, this graphplan reads version 2: recompile "
        "the plan with this graphplan's `plan compile PLAN -o table.json`\n"
    )


# -- diff -----------------------------------------------------------------------------------------


def test_diff_of_two_real_plans_shows_graphs_routes_and_padding(capsys):
    code, out, _ = run(capsys, "diff", H100, LORA)
    lines = out.splitlines()
    assert code == 0
    assert lines[:3] == [f"--- {H100}", f"+++ {LORA}", "graphs: +270 -32"]
    assert "  + FULL 1 tok, 1 req, uniform, lora 9" in lines
    assert "  - FULL 256 tok, 256 req, uniform" in lines
    assert "  - PIECEWISE 512 tok" in lines
    assert "routes changed: 3 range(s)" in lines
    assert "  decode tokens 129..256       FULL 136 -> out of range" in lines
    assert "  mixed  tokens 257..512       PIECEWISE 272 -> NONE" in lines
    assert lines[-2:] == ["  decode FULL            7 -> 7", "  mixed  PIECEWISE      15 -> 7"]


def test_diff_json_lists_everything(capsys):
    code, out, _ = run(capsys, "diff", H100, LORA, "--format", "json")
    d = json.loads(out)
    assert code == 0 and d["same"] is False
    assert (len(d["added"]), len(d["removed"])) == (270, 32)
    assert d["route_changes"] == [
        {
            "kind": "decode",
            "first": 129,
            "last": 256,
            "before": "FULL 136",
            "after": "out of range",
        },
        {"kind": "mixed", "first": 257, "last": 512, "before": "PIECEWISE 272", "after": "NONE"},
        {"kind": "mixed", "first": 4097, "last": 8192, "before": "NONE", "after": "out of range"},
    ]
    assert d["worst_padding"] == [
        {"routine": "decode", "mode": "FULL", "before": 7, "after": 7},
        {"routine": "mixed", "mode": "PIECEWISE", "before": 15, "after": 7},
    ]


def test_diff_of_a_plan_and_its_table_is_empty(capsys, h100_table):
    code, out, _ = run(capsys, "diff", H100, str(h100_table))
    assert (code, out) == (0, f"{H100} and {h100_table} compile to the same table\n")


def test_diff_shows_a_mode_downgrade_as_route_changes(capsys, tmp_path):
    weaker = tmp_path / "weaker.yaml"
    weaker.write_text(
        (ROOT / "plans" / "llama3-8b-h100.yaml")
        .read_text()
        .replace("mode: FULL_AND_PIECEWISE", "mode: PIECEWISE")
    )
    code, out, _ = run(capsys, "diff", H100, str(weaker), "--format", "json")
    d = json.loads(out)
    assert (len(d["added"]), len(d["removed"])) == (0, 35)
    assert d["route_changes"] == [
        {"kind": "decode", "first": 1, "last": 256, "before": "FULL 1", "after": "PIECEWISE 1"}
    ]


def test_diff_with_an_invalid_side_exits_2(capsys, bad_plan):
    code, out, err = run(capsys, "diff", H100, str(bad_plan))
    assert (code, out) == (2, "") and "error[bad-value]" in err


# -- arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,match",
    [
        ([], "the following arguments are required: COMMAND"),
        (["nonsense"], "invalid choice: 'nonsense'"),
        (["compile"], "the following arguments are required: plan"),
        (["explain", H100], "the following arguments are required: --tokens"),
        (["explain", H100, "--tokens", "many"], "argument --tokens: invalid int value: 'many'"),
        (["compile", H100, "--format", "yaml"], "argument --format: invalid choice: 'yaml'"),
        (["validate", H100, "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_exit_1_with_usage_and_no_output(capsys, args, match):
    code, out, err = run(capsys, *args)
    assert (code, out) == (1, "")
    assert match in err and "usage: plan" in err


def test_missing_and_directory_inputs_exit_2_as_invalid_plans(capsys, tmp_path):
    code, _, err = run(capsys, "validate", str(tmp_path / "nope.yaml"))
    assert code == 2 and "error[not-found]" in err
    code, _, err = run(capsys, "validate", str(tmp_path))
    assert code == 2 and "error[not-a-file]" in err


# -- every shipped plan -----------------------------------------------------------------------------


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_every_shipped_plan_compiles_and_its_table_loads(capsys, tmp_path, plan):
    out = tmp_path / "table.json"
    code, stdout, err = run(
        capsys, "compile", str(plan), "-o", str(out), *TEMPLATE_SETS.get(plan.name, [])
    )
    assert code == 0, err
    assert "error" not in err
    table = DispatchTable.load(out)
    assert table.plan["name"] in stdout.splitlines()[0]
    assert run(capsys, "validate", str(out))[0] == 0


# -- what a new user hit (issue 17) ------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    from graphplan.compiler import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"plan (graphplan) {__version__}\n"


def test_every_explain_flag_has_help_text():
    from graphplan.compiler.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices["explain"]
    undocumented = [a.option_strings or a.dest for a in sub._actions if not a.help]
    assert undocumented == []


@pytest.mark.parametrize(
    "sizes,text",
    [
        ([3, 6, 9, 12, 18, 24, 33, 42], "3-12/3 18 24 33 42"),  # a 3-member run stays spelled out
        (list(range(67, 85)), "67-84"),  # consecutive: no /1
        ([1, 2, 4] + list(range(8, 257, 8)), "1 2 4 8-256/8"),
        ([5, 1, 3], "1 3 5"),
        ([], "(none)"),
    ],
)
def test_size_lists_compress_only_runs_of_four_or_more(sizes, text):
    from graphplan.compiler.tools.summary import compact_sizes

    assert compact_sizes(sizes) == text


def test_explain_says_1_token_not_1_tokens(capsys):
    code, out, _ = run(capsys, "explain", H100, "--tokens", "1", "--reqs", "1", "--query-len", "1")
    assert code == 0 and out.splitlines()[0].endswith("padded to 1 token, 1 request")


def test_diff_gives_each_side_its_own_overrides(capsys):
    code, out, _ = run(
        capsys, "diff", H100, H100, "--set-b", "cudagraph.mode=PIECEWISE", "--format", "json"
    )
    d = json.loads(out)
    assert code == 0 and (len(d["added"]), len(d["removed"])) == (0, 35)
    # --set applies to both sides: the same override on both is no difference
    code, out, _ = run(capsys, "diff", H100, H100, "--set", "cudagraph.mode=PIECEWISE")
    assert "compile to the same table" in out
    code, out, _ = run(
        capsys,
        "diff",
        H100,
        H100,
        "--set",
        "cudagraph.mode=PIECEWISE",
        "--set-a",
        "cudagraph.mode=FULL_AND_PIECEWISE",
        "--format",
        "json",
    )
    assert len(json.loads(out)["added"]) == 0 and len(json.loads(out)["removed"]) == 35


def test_diff_lists_graphs_in_numeric_order(capsys):
    code, out, _ = run(capsys, "diff", H100, LORA, "--format", "json")
    added = [g for g in json.loads(out)["added"] if g.startswith("FULL") and g.endswith("lora 9")]
    tokens = [int(g.split()[1]) for g in added]
    assert tokens[:6] == [1, 2, 4, 8, 16, 24] and tokens == sorted(tokens)


@pytest.mark.parametrize(
    "args,exit_code,kind",
    [
        (["compile", "nope.yaml"], 2, "PlanError"),
        (["compile"], 1, "UsageError"),
        (["explain", H100, "--tokens", "100000"], 1, "BatchError"),
    ],
)
def test_format_json_prints_a_json_error_object_on_stdout(capsys, args, exit_code, kind):
    code, out, err = run(capsys, *args, "--format", "json")
    assert code == exit_code and err  # the message still goes to stderr
    e = json.loads(out)
    assert e["ok"] is False and (e["error"]["kind"], e["error"]["exit_code"]) == (kind, exit_code)
    assert e["error"]["message"] in err
    if kind == "PlanError":
        assert e["error"]["diagnostics"][0]["code"] == "not-found"


def test_the_readme_documents_every_cli_option_and_names_every_shipped_plan():
    from graphplan.compiler.cli.main import build_parser

    readme = (ROOT / "README.md").read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    missing = [
        f"{name} {o}"
        for name, sp in sub.choices.items()
        for a in sp._actions
        for o in a.option_strings
        if o.startswith("--") and o not in ("--help", "--output") and o not in readme
    ]
    assert missing == [] and "plan --version" in readme
    # the plan the README's own commands run is in its list of shipped plans
    assert "`plans/tiny-llama.yaml`, the plan the examples" in " ".join(readme.split())
