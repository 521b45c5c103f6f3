"""Speaking the engines' languages: vLLM's own rules with exact expectations, exports pinned to
each target version's spelling, real-world inputs quoted from public issues (each cited in its
fixture under tests/data/engines/), and bad input -> a located error, exit code 2, nothing written.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from graphplan.compiler import PlanError, compile_loaded, compile_plan, load_plan
from graphplan.compiler.cli import main
from graphplan.compiler.engines import export_plan, import_plan
from graphplan.compiler.engines import vllm_rules as R
from graphplan.compiler.engines.pyrepr import Call, parse_value

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "engines"
GRID_TO_512 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def exported(plan, engine, fmt=None, version=None):
    loaded = load_plan(ROOT / "plans" / plan if isinstance(plan, str) else plan)
    table, _ = compile_loaded(loaded)
    return export_plan(loaded, table.capture_sizes, engine, fmt, version)


def imported(engine, **source):
    out = import_plan(engine, **source)
    return out, compile_plan(out.plan)


def settings_of(table) -> tuple:
    """What a table resolved to, as plain values (mode name, lists)."""
    r = table.settings
    return (
        r.mode.name,
        list(r.capture_sizes),
        list(r.lora_cases),
        r.max_num_seqs,
        r.max_num_batched_tokens,
        r.decode_query_len,
        r.data_parallel_size,
    )


# -- vLLM's rules (vllm/config/vllm.py _set_cudagraph_sizes, compilation.py) ---------------------


def test_vllm_default_list_for_256_seqs_is_1_2_4_then_steps_of_8_then_16_up_to_512():
    assert R.default_sizes(R.default_max_size(256, 8192, 1)) == GRID_TO_512


def test_vllm_default_max_is_twice_q_times_max_num_seqs_capped_at_512():
    # https://github.com/vllm-project/vllm/issues/32324: 3 speculative tokens, 40 seqs -> 320
    assert R.default_max_size(40, 8192, 4) == 320
    assert R.default_max_size(1024, 8192, 1) == 512


def test_vllm_default_max_is_capped_at_max_num_batched_tokens():
    assert R.default_max_size(256, 100, 1) == 100
    assert R.default_sizes(100) == [1, 2, 4] + list(range(8, 97, 8))


def test_vllm_default_list_for_8_seqs_stops_at_16():
    assert R.default_sizes(R.default_max_size(8, 8192, 1)) == [1, 2, 4, 8, 16]


def test_vllm_drops_explicit_sizes_above_max_num_batched_tokens_and_dedups():
    assert R.explicit_sizes([8192, 1, 9000, 8, 8, 4096], 8192) == [1, 8, 4096, 8192]


def test_vllm_spec_decode_rounds_up_to_multiples_of_q_leaving_holes():
    # 5 speculative tokens: 24 -> 24 and 32 -> 36, so a 30-token decode step pads to 36
    rounded = R.spec_rounded(R.default_sizes(512), 6)
    assert rounded[:10] == [6, 12, 18, 24, 36, 42, 48, 60, 66, 72]
    assert 30 not in rounded and 54 not in rounded and rounded[-1] == 498  # 512 -> 516 is dropped


def test_vllm_spec_decode_rounding_falls_back_to_q_or_refuses():
    assert R.spec_rounded([1, 2, 4], 3) == [3]
    with pytest.raises(R.VllmRuleError, match="no cudagraph size is a multiple of 3"):
        R.spec_rounded([1, 2], 3)


def test_vllm_mode_downgrades_follow_attention_support_and_splitting_ops():
    assert R.resolve_mode("FULL", None, "UNIFORM_BATCH", 1) == "FULL_AND_PIECEWISE"
    assert R.resolve_mode("FULL", [], "UNIFORM_BATCH", 1) == "FULL_DECODE_ONLY"
    assert R.resolve_mode("PIECEWISE", [], "ALWAYS", 1) == "NONE"
    assert R.resolve_mode("FULL_AND_PIECEWISE", [], "ALWAYS", 1) == "FULL"
    assert R.resolve_mode("FULL_DECODE_ONLY", None, "UNIFORM_SINGLE_TOKEN_DECODE", 2) == "PIECEWISE"
    assert R.resolve_mode("FULL_AND_PIECEWISE", None, "NEVER", 1) == "PIECEWISE"


def test_vllm_lora_cases_by_specialization():
    assert R.lora_cases(False, 4, True, True) == [0]
    assert R.lora_cases(True, 4, True, False) == [0, 5]
    assert R.lora_cases(True, 4, False, False) == [5]
    assert R.lora_cases(True, 4, False, True) == [5]  # active-count graphs need the base split
    assert R.lora_cases(True, 4, True, True) == [0, 1, 2, 4, 5]


def test_vllm_refuses_a_max_capture_size_that_is_not_the_largest_explicit_size():
    with pytest.raises(R.VllmRuleError, match="max_cudagraph_capture_size=64"):
        R.read_engine_args(
            {
                "max_num_seqs": 8,
                "max_num_batched_tokens": 256,
                "compilation_config": {
                    "cudagraph_capture_sizes": [1, 8, 32],
                    "max_cudagraph_capture_size": 64,
                },
            },
            "ALWAYS",
        )


# -- export: what each version is told ---------------------------------------------------------


def test_vllm_export_gives_the_compiled_sizes_and_resolved_mode_explicitly():
    out = exported("llama3-8b-h100.yaml", "vllm", "json")
    assert out.config == {
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "compilation_config": {
            "cudagraph_mode": "FULL_AND_PIECEWISE",
            "cudagraph_capture_sizes": GRID_TO_512,
            "max_cudagraph_capture_size": 512,
        },
    }
    assert R.read_engine_args(out.config, "ALWAYS") == R.VllmRun(
        "FULL_AND_PIECEWISE", tuple(GRID_TO_512), (0,)
    )


def test_vllm_args_are_one_shell_quoted_flag_per_line():
    lines = exported("llama3-8b-eagle3.yaml", "vllm", "args").text.splitlines()
    flags = [ln.split()[0] for ln in lines if not ln.startswith("#")]
    assert flags == [
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--speculative-config",
        "--compilation-config",
    ]
    assert shlex.split(lines[4]) == ["--speculative-config", '{"num_speculative_tokens": 2}']


def test_vllm_export_of_an_eager_plan_is_enforce_eager():
    assert exported("eager.yaml", "vllm", "json").config["enforce_eager"] is True


def test_vllm_0_15_spells_per_count_lora_graphs_and_0_11_reports_them_lost():
    old = exported("llama3-8b-lora8.yaml", "vllm", "json", "0.11")
    new = exported("llama3-8b-lora8.yaml", "vllm", "json", "0.15")
    assert [d.path for d in old.lost] == ["lora.specialize_count"]
    assert new.lost == () and new.config["specialize_active_lora"] is True
    assert "specialize_active_lora" not in old.config


def test_vllm_dbo_export_reports_plain_twins_lost_one_diagnostic_each():
    out = exported("deepseek-v3-dp8-dbo.yaml", "vllm", "json")
    assert [d.path for d in out.lost] == ["parallel.ubatch.plain_twins"]
    assert out.config["enable_dbo"] is True and out.config["data_parallel_size"] == 8


def test_a_strict_plan_makes_each_lost_feature_an_error():
    plan = load_plan(ROOT / "plans" / "llama3-8b-lora8.yaml").plan
    plan["cudagraph"]["strict"] = True
    with pytest.raises(PlanError, match=r"error\[engine-lost-feature\]: lora.specialize_count"):
        exported(plan, "vllm")


def test_sglang_export_splits_decode_batch_sizes_from_piecewise_tokens():
    cfg = exported("llama3-8b-eagle3.yaml", "sglang", "json").config
    sizes = compile_plan(ROOT / "plans" / "llama3-8b-eagle3.yaml").capture_sizes
    assert cfg["speculative_num_draft_tokens"] == 3
    assert [b * 3 for b in cfg["cuda_graph_bs"]] == [s for s in sizes if s <= 3 * 128]
    assert cfg["piecewise_cuda_graph_tokens"] == list(sizes)
    assert cfg["enable_piecewise_cuda_graph"] is True


def test_sglang_args_spell_list_flags_with_space_separated_values():
    text = exported("tiny-llama.yaml", "sglang", "args").text
    assert "--cuda-graph-bs 1 2 4 8" in text and "--enable-piecewise-cuda-graph\n" in text


def test_trtllm_yaml_has_cuda_graph_config_with_padding_and_piecewise_prefill_options():
    out = exported("llama3-8b-h100.yaml", "trtllm", "yaml")
    import yaml

    cfg = yaml.safe_load(out.text)
    assert cfg["cuda_graph_config"] == {
        "batch_sizes": GRID_TO_512[:35],
        "max_batch_size": 256,
        "enable_padding": True,
    }
    assert cfg["torch_compile_config"] == {
        "enable_piecewise_cuda_graph": True,
        "capture_num_tokens": GRID_TO_512,
    }


def test_piecewise_decode_is_a_lost_feature_for_sglang_and_trtllm():
    for engine in ("sglang", "trtllm"):
        out = exported("piecewise-only.yaml", engine)
        assert [d.path for d in out.lost] == ["cudagraph.mode"], engine


# -- import: real-world inputs quoted from public issues (URLs in each fixture) -----------------


def test_vllm_engine_config_line_with_enum_reprs_from_issue_29955():
    out, t = imported("vllm", log=str(DATA / "vllm-29955-engine-config.log"))
    assert settings_of(t)[:3] == ("FULL_AND_PIECEWISE", GRID_TO_512, [0])
    assert out.plan["cudagraph"]["splitting_ops"] == ["attention"]
    assert "compilation_config.cudagraph_mode" in out.text


def test_vllm_json_compilation_config_of_an_older_vllm_from_nemo_rl_615():
    out, t = imported("vllm", log=str(DATA / "vllm-nemo-rl-615-engine-config.log"))
    assert settings_of(t)[:2] == ("PIECEWISE", [1, 2, 4] + list(range(8, 513, 8)))
    assert out.plan["cudagraph"]["splitting_ops"] == ["attention"]  # vllm.unified_attention


def test_vllm_non_default_args_line_with_object_reprs_from_issue_41622():
    out, t = imported("vllm", log=str(DATA / "vllm-41622-non-default-args.log"))
    assert settings_of(t)[0] == "NONE" and t.graphs == ()
    assert out.plan["lora"]["enabled"] is True and out.plan["lora"]["max_loras"] == 1
    assert "# assumed: vLLM's default max_loras" in out.text


def test_vllm_serve_command_from_issue_15802():
    _, t = imported("vllm", args=(DATA / "vllm-15802.args").read_text())
    assert settings_of(t)[:4] == ("FULL_AND_PIECEWISE", [1, 2, 4, 8, 16], [0], 8)


def test_vllm_serve_command_with_per_count_lora_from_pr_36370_needs_0_15():
    text = (DATA / "vllm-36370.args").read_text()
    out, t = imported("vllm", args=text, version="0.15")
    assert settings_of(t)[:4] == ("FULL_AND_PIECEWISE", [1, 2], [0, 1, 2, 4, 8, 9], 1)
    with pytest.raises(PlanError, match=r"error\[flag-not-in-version\].*--specialize-active-lora"):
        import_plan("vllm", args=text, version="0.11")


def test_vllm_config_yaml_with_the_0_11_cuda_graph_sizes_key_from_inferencex_117():
    _, t = imported("vllm", config=str(DATA / "vllm-inferencex-117.yaml"))
    assert settings_of(t)[1] == R.default_sizes(2048)


def test_sglang_command_with_cuda_graph_max_bs_from_issue_33483():
    out, t = imported("sglang", args=(DATA / "sglang-33483.sh").read_text())
    assert settings_of(t)[:2] == ("FULL_DECODE_ONLY", [1, 2, 4, 8, 12, 16, 24, 32])
    assert out.plan["cudagraph"]["capture_sizes"] == {"preset": "sglang", "max_size": 32}


def test_sglang_command_with_env_vars_dp_and_graphs_off_from_pr_19216():
    _, t = imported("sglang", args=(DATA / "sglang-19216.sh").read_text())
    assert settings_of(t) == ("NONE", [], [0], 128, 65536, 1, 8)


def test_sglang_command_with_python_u_and_dp_attention_from_pr_6092():
    _, t = imported("sglang", args=(DATA / "sglang-6092.sh").read_text())
    assert settings_of(t)[4:] == (32768, 1, 16)


def test_trtllm_padded_config_from_pr_6640_follows_the_newest_release_unless_one_is_named():
    path = str(DATA / "trtllm-6640-llama4-hybrid.yml")  # max_batch_size 1024, enable_padding
    grid = [1, 2, 4] + list(range(8, 129, 8))
    _, newest = imported("trtllm", config=path)
    _, old = imported("trtllm", config=path, version="1.0")
    assert settings_of(newest)[:2] == ("FULL_DECODE_ONLY", grid + list(range(192, 1025, 64)))
    assert len(settings_of(newest)[1]) == 33
    assert settings_of(old)[1] == grid + [256, 512, 1024]


def test_trtllm_explicit_batch_sizes_from_pr_13745():
    _, t = imported("trtllm", config=str(DATA / "trtllm-13745-gemma4-moe.yaml"))
    assert settings_of(t)[1] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_trtllm_null_cuda_graph_config_from_pr_6880_is_eager():
    _, t = imported("trtllm", config=str(DATA / "trtllm-6880-gemma3.yaml"))
    assert settings_of(t)[0] == "NONE"


def test_trtllm_serve_config_from_pr_7492_caps_graphs_at_max_batch_size():
    _, t = imported("trtllm", config=str(DATA / "trtllm-7492-qwen3.yml"))
    assert settings_of(t)[:5] == ("FULL_DECODE_ONLY", [1], [0], 1, 4223)


def test_every_imported_value_carries_a_comment_and_set_fills_what_is_missing():
    out = import_plan(
        "sglang",
        args=["--cuda-graph-max-bs", "64"],
        sets={"scheduler.max_num_seqs": 64, "name": "mine"},
    )
    body = [ln for ln in out.text.splitlines() if ln and not ln.startswith("#")]
    values = [ln for ln in body if not ln.rstrip().endswith(":")]
    assert all("  # " in ln for ln in values)
    assert "max_num_seqs: 64" in out.text and "# --set scheduler.max_num_seqs" in out.text
    assert out.plan["name"] == "mine"


# -- the log reader never evaluates --------------------------------------------------------------


def test_log_values_are_read_never_evaluated():
    value, end = parse_value("__import__('os').system('echo no')")
    assert value == Call("__import__", ("os",), {}) and end == len("__import__('os')")
    with pytest.raises(PlanError, match=r"malformed-log-line\]: non-default args: unexpected"):
        import_plan("vllm", log=_tmp_log("non-default args: {'a': 1} + 2"))


def _tmp_log(text: str) -> str:
    import tempfile

    f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    f.write(text + "\n")
    f.close()
    return f.name


# -- bad input: located error, exit 2, nothing written -------------------------------------------

BAD = [
    (
        ["import", "--engine", "vllm", "--", "--max-num-seqz", "8"],
        r"<args>:1:1: error\[unknown-flag\]: argument 1 \(--max-num-seqz\).*"
        r"did you mean '--max-num-seqs'",
    ),
    (
        ["import", "--engine", "vllm", "--log", str(DATA / "vllm-29955-truncated.log")],
        r"vllm-29955-truncated.log:3:\d+: error\[malformed-log-line\]: compilation_config: expected",
    ),
    (
        ["import", "--engine", "vllm", "--", "--max-num-seqs", "0"],
        r"<args>:1:1: error\[out-of-range\]: argument 1 \(--max-num-seqs\): 0 is out of range",
    ),
    (
        ["import", "--engine", "sglang", "--", "--cuda-graph-bs", "1", "x"],
        r"error\[bad-value\]: argument 1 \(--cuda-graph-bs\): 'x' is not an integer",
    ),
    (
        [
            "import",
            "--engine",
            "vllm",
            "--engine-version",
            "0.11",
            "--",
            "--specialize-active-lora",
        ],
        r"error\[flag-not-in-version\]: .*vLLM 0.11 has no --specialize-active-lora",
    ),
    (
        ["import", "--engine", "trtllm", "--config", str(DATA / "trtllm-5795-old-padding.yaml")],
        r"trtllm-5795-old-padding.yaml:3:3: error\[flag-not-in-version\]: .*renamed enable_padding",
    ),
    (
        ["import", "--engine", "sglang", "--engine-version", "0.4", "--", "--dp-size", "2"],
        r"error\[unknown-engine-version\]: SGLang version '0.4'",
    ),
    (
        [
            "export",
            str(ROOT / "plans" / "llama3-8b-h100.yaml"),
            "--engine",
            "sglang",
            "--format",
            "yaml",
        ],
        r"error\[unknown-format\]: SGLang export has no format 'yaml'",
    ),
]


@pytest.mark.parametrize(
    "argv,message", BAD, ids=[" ".join(a[:3]) + f" #{i}" for i, (a, _) in enumerate(BAD)]
)
def test_bad_input_is_a_located_error_with_exit_2_and_writes_nothing(
    argv, message, tmp_path, capsys
):
    out = tmp_path / "out.yaml"
    assert main(argv[:1] + ["-o", str(out)] + argv[1:]) == 2
    assert out.exists() is False
    import re

    assert re.search(message, capsys.readouterr().err), message


def test_a_strict_export_with_lost_features_exits_2_and_writes_nothing(tmp_path, capsys):
    plan = tmp_path / "strict.yaml"
    plan.write_text(
        (ROOT / "plans" / "piecewise-only.yaml")
        .read_text()
        .replace("strict: false", "strict: true")
    )
    if "strict: true" not in plan.read_text():
        plan.write_text(plan.read_text().replace("cudagraph:", "cudagraph:\n  strict: true", 1))
    out = tmp_path / "out.args"
    assert main(["export", str(plan), "--engine", "trtllm", "-o", str(out)]) == 2
    assert not out.exists()
    assert "error[engine-lost-feature]: cudagraph.mode" in capsys.readouterr().err


# -- the CLI end to end --------------------------------------------------------------------------


def test_cli_export_then_import_gives_a_plan_that_compiles_to_the_same_routes(tmp_path, capsys):
    cfg = tmp_path / "vllm.yaml"
    assert (
        main(
            [
                "export",
                str(ROOT / "plans" / "llama3-8b-eagle3.yaml"),
                "--engine",
                "vllm",
                "--format",
                "yaml",
                "-o",
                str(cfg),
            ]
        )
        == 0
    )
    plan = tmp_path / "plan.yaml"
    assert (
        main(
            [
                "import",
                "--engine",
                "vllm",
                "--config",
                str(cfg),
                "--set",
                "cudagraph.attention_support=UNIFORM_BATCH",
                "-o",
                str(plan),
            ]
        )
        == 0
    )
    assert (
        compile_plan(plan).capture_sizes
        == compile_plan(ROOT / "plans" / "llama3-8b-eagle3.yaml").capture_sizes
    )


def test_cli_import_takes_engine_flags_after_a_double_dash(capsys):
    assert (
        main(
            [
                "import",
                "--engine",
                "sglang",
                "--",
                "python",
                "-m",
                "sglang.launch_server",
                "--max-running-requests",
                "48",
                "--cuda-graph-max-bs",
                "48",
            ]
        )
        == 0
    )
    assert "max_num_seqs: 48" in capsys.readouterr().out


def test_cli_engines_compares_the_plans_padding_under_each_default_list(capsys):
    assert main(["engines", str(ROOT / "plans" / "llama3-8b-h100.yaml"), "--format", "json"]) == 0
    rows = {r["list"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == [
        "plan",
        "vllm 0.11 default",
        "sglang preset",
        "trtllm preset",
        "trtllm preset, padded",
    ]
    assert rows["plan"]["sizes"] == GRID_TO_512 == rows["vllm 0.11 default"]["sizes"]
    assert rows["trtllm preset"]["decode"]["worst_pad"] == 63  # 65..127 pad to 128


def test_the_engines_package_ships_in_the_wheel():
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    assert "graphplan.compiler.engines" in packages


def test_cli_engines_with_a_trace_prices_each_list(capsys):
    assert (
        main(
            [
                "engines",
                str(ROOT / "plans" / "llama3-8b-h100.yaml"),
                "--trace",
                str(ROOT / "bench" / "traces" / "chat.jsonl"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "trace padded" in text and "trtllm preset, padded" in text


# -- tensor parallelism: each engine's spelling, both ways, with DP x TP -------------------------


def _tp_plan(dp: int, tp: int) -> dict:
    plan = load_plan(ROOT / "plans" / "tiny-llama.yaml").plan
    plan["parallel"] = {"data_parallel_size": dp, "tensor_parallel_size": tp}
    return plan


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "-tp", "--tensor_parallel_size"])
def test_vllm_tensor_parallel_flag_spellings_import_as_the_tp_size(flag):
    out, t = imported("vllm", args=f"vllm serve m {flag} 4 -dp 2")
    assert (t.settings.data_parallel_size, t.settings.tensor_parallel_size) == (2, 4)
    line = next(x for x in out.text.splitlines() if "tensor_parallel_size" in x)
    assert line.split() == ["tensor_parallel_size:", "4", "#", flag, "4"]


def test_vllm_non_default_args_line_of_issue_41622_carries_tp_8():
    out, t = imported("vllm", log=str(DATA / "vllm-41622-non-default-args.log"))
    assert t.settings.tensor_parallel_size == 8 and t.settings.data_parallel_size == 1
    assert "tensor_parallel_size" not in " ".join(d.message for d in out.diagnostics)


def test_vllm_engine_config_line_tp_1_imports_as_1():
    _, t = imported("vllm", log=str(DATA / "vllm-rank-llm-426-engine-config.log"))
    assert t.settings.tensor_parallel_size == 1


@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2), (2, 1)])
def test_vllm_and_sglang_export_dp_and_tp_as_their_own_keys(dp, tp):
    vllm = exported(_tp_plan(dp, tp), "vllm", "json")
    sglang = exported(_tp_plan(dp, tp), "sglang", "json")
    assert vllm.config.get("tensor_parallel_size", 1) == tp
    assert vllm.config.get("data_parallel_size", 1) == dp
    assert sglang.config.get("tp_size", 1) == tp and sglang.config.get("dp_size", 1) == dp
    assert vllm.lost == () and sglang.lost == ()


@pytest.mark.parametrize("flag", ["--tp-size", "--tp", "--tensor-parallel-size"])
def test_sglang_tp_flags_without_dp_attention_are_the_tp_size(flag):
    _, t = imported("sglang", args=f"python -m sglang.launch_server {flag} 4 --dp-size 2")
    assert (t.settings.data_parallel_size, t.settings.tensor_parallel_size) == (2, 4)


def test_sglang_dp_attention_splits_tp_size_into_dp_ranks_of_tp_over_dp_gpus():
    out, t = imported(
        "sglang",
        args="python -m sglang.launch_server --tp 8 --dp-size 2 --enable-dp-attention",
    )
    assert (t.settings.data_parallel_size, t.settings.tensor_parallel_size) == (2, 4)
    assert any("MLP runs over all 8 GPUs" in d.message for d in out.diagnostics)
    _, t = imported("sglang", args=(DATA / "sglang-19216.sh").read_text())  # tp 8 = dp 8
    assert (t.settings.data_parallel_size, t.settings.tensor_parallel_size) == (8, 1)
    with pytest.raises(PlanError, match=r"tp_size=6 is not a multiple of dp_size=4"):
        import_plan("sglang", args="x --tp 6 --dp-size 4 --enable-dp-attention")


def test_trtllm_tp_size_flag_and_tensor_parallel_size_key_are_the_tp_size(tmp_path):
    _, t = imported("trtllm", args="trtllm-serve m --tp_size 4 --max_batch_size 8")
    assert t.settings.tensor_parallel_size == 4
    cfg = tmp_path / "tp.yaml"
    cfg.write_text("tensor_parallel_size: 2\nmax_batch_size: 8\n")
    _, t = imported("trtllm", config=str(cfg))
    assert (t.settings.data_parallel_size, t.settings.tensor_parallel_size) == (1, 2)
    cfg.write_text("tensor_parallel_size: 4\nenable_attention_dp: true\nmax_batch_size: 8\n")
    _, t = imported("trtllm", config=str(cfg))
    assert (t.settings.data_parallel_size, t.settings.tensor_parallel_size) == (4, 1)


def test_trtllm_export_of_tp_is_tensor_parallel_size_and_dp_x_tp_is_lost():
    tp = exported(_tp_plan(1, 4), "trtllm", "json")
    assert tp.config["tensor_parallel_size"] == 4 and "enable_attention_dp" not in tp.config
    assert tp.lost == ()
    assert "--tp_size 4" in exported(_tp_plan(1, 4), "trtllm", "args").text
    both = exported(_tp_plan(2, 2), "trtllm", "json")
    assert [d.path for d in both.lost] == ["parallel.tensor_parallel_size"]
    assert both.config["tensor_parallel_size"] == 4 and both.config["enable_attention_dp"]
