"""Engine inputs as users paste them: every real option of the release is read (graph-relevant
ones mapped, the others listed as ignored, values consumed by their arity), prefixes resolve as
argparse resolves them, and only what the engine refuses is refused; vLLM start-up logs in every
format since 0.8 (unquoted values, object and enum reprs, headless excerpts) import, and hostile
log lines end in a located error, never a traceback. Fixtures cite their source (tests/data/engines).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphplan.compiler import PlanError, compile_plan
from graphplan.compiler.cli import main
from graphplan.compiler.engines import import_plan, sglang, vllm
from graphplan.compiler.engines.cli_options import labels, load, resolve

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "engines"
GRID_TO_512 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def notes_of(out) -> list[str]:
    """The notes, less the release import assumed (tests of their own below)."""
    return [d.message for d in out.diagnostics if d.code != "engine-version"]


def version_note(out) -> str:
    """The note saying which release import assumed (one, first)."""
    (note,) = [d.message for d in out.diagnostics if d.code == "engine-version"]
    assert out.diagnostics[0].message == note
    return note


def table_of(out):
    return compile_plan(out.plan).settings


# -- every real option is read -------------------------------------------------------------------


def test_sglang_real_flags_that_do_not_shape_graphs_are_read_and_listed_as_ignored():
    out = import_plan(
        "sglang",
        args="python -m sglang.launch_server --model-path m --num-continuous-decode-steps 4 "
        "--enable-deterministic-inference --cuda-graph-max-bs 32 --max-running-requests 32",
    )
    assert notes_of(out) == [
        "3 SGLang 0.5.9 flag(s) that do not shape CUDA graphs, ignored: --model-path, "
        "--num-continuous-decode-steps, --enable-deterministic-inference"
    ]
    assert out.plan["cudagraph"]["capture_sizes"] == {"preset": "sglang", "max_size": 32}


def test_vllm_real_flags_that_do_not_shape_graphs_are_read_and_listed_as_ignored():
    out = import_plan(
        "vllm",
        args="vllm serve m --enable-log-requests --async-scheduling --no-enable-prefix-caching "
        "-tp 2 --kv-cache-metrics --enable-flashinfer-autotune --max-num-seqs 8",
        version="0.15",
    )
    assert notes_of(out) == [
        "5 vLLM 0.16.0 flag(s) that do not shape CUDA graphs, ignored: --enable-log-requests, "
        "--async-scheduling, --no-enable-prefix-caching, --kv-cache-metrics, "
        "--enable-flashinfer-autotune"
    ]
    assert out.plan["parallel"]["tensor_parallel_size"] == 2  # -tp shapes the ranks
    assert table_of(out).max_num_seqs == 8


def test_values_are_consumed_by_each_options_arity():
    # '+' takes every value up to the next option, '?' and '*' may take none, a switch none
    out = import_plan(
        "vllm",
        args=["--served-model-name", "a", "b", "--hf-token", "--max-num-seqs", "8", "--seed", "-1"],
    )
    assert table_of(out).max_num_seqs == 8
    out = import_plan("sglang", args=["--lora-paths", "--cuda-graph-bs", "1", "2", "4"])
    assert list(table_of(out).capture_sizes) == [1, 2, 4]
    with pytest.raises(PlanError, match=r"error\[stray-value\]: argument 2 \(model\)"):
        import_plan("vllm", args=["--trust-remote-code", "model"])
    with pytest.raises(PlanError, match=r"error\[missing-value\]: .*expected one argument"):
        import_plan("vllm", args=["--port", "--max-num-seqs", "8"])


def test_a_config_file_named_on_a_command_line_is_pointed_at_not_read():
    out = import_plan("vllm", args=["--config", "c.yaml", "--max-num-seqs", "8", "--", "x"])
    assert notes_of(out) == [
        "argument 1 (--config): the file is not read here",
        "argument 5 (--): the words after '--' are not options; not read",
    ]


def test_a_switch_given_a_value_is_read_with_a_note_that_the_release_takes_none():
    out = import_plan("vllm", args=["--enforce-eager=False", "--max-num-seqs", "8"], version="0.11")
    assert table_of(out).mode.name == "FULL_AND_PIECEWISE"
    assert "vLLM 0.11.2 reads --enforce-eager as a switch without a value" in notes_of(out)[0]


# -- abbreviations, ambiguity and unknown options, as argparse reads them ------------------------


def test_a_unique_prefix_resolves_to_its_option():
    out = import_plan("sglang", args=["--mem-frac", "0.8", "--cuda-graph-max", "16"])
    assert out.plan["cudagraph"]["capture_sizes"] == {"preset": "sglang", "max_size": 16}
    assert "--mem-frac (read as --mem-fraction-static)" in notes_of(out)[0]
    assert "--cuda-graph-max 16 (read as --cuda-graph-max-bs)" in out.text
    out = import_plan("vllm", args=["--max_num_s", "16", "--gpu-mem", "0.9"])
    assert table_of(out).max_num_seqs == 16
    assert "--gpu-mem (read as --gpu-memory-utilization)" in notes_of(out)[0]


@pytest.mark.parametrize(
    "engine,word,candidates",
    [
        ("sglang", "--cuda-graph", "--cuda-graph-bs, --cuda-graph-max-bs"),
        (
            "vllm",
            "--max-num",
            "--max-num-batched-tokens, --max-num-partial-prefills, --max-num-seqs",
        ),
    ],
)
def test_an_ambiguous_prefix_is_refused_with_its_candidates(engine, word, candidates):
    with pytest.raises(PlanError) as e:
        import_plan(engine, args=[word, "8"])
    assert (
        f"error[ambiguous-flag]: argument 1 ({word}): ambiguous option: {word} could match "
        f"{candidates}"
    ) in str(e.value)


@pytest.mark.parametrize(
    "engine,word,suggestion",
    [
        ("sglang", "--cuda-graph-max-bz", "--cuda-graph-max-bs"),
        ("vllm", "--max-num-seqz", "--max-num-seqs"),
    ],
)
def test_an_unknown_option_is_refused_with_a_spelling_suggestion(engine, word, suggestion):
    with pytest.raises(PlanError, match=rf"error\[unknown-flag\].*did you mean '{suggestion}'"):
        import_plan(engine, args=[word, "8"])
    out = import_plan(engine, args=[word, "8"], allow_unknown=True)
    assert notes_of(out)[0].endswith("option ignored")


def test_an_option_of_another_release_names_the_release_that_has_it():
    with pytest.raises(PlanError, match=r"vLLM 0.11.2 has no --optimization-level \(vLLM 0.16.0"):
        import_plan("vllm", args=["--optimization-level", "3"], version="0.11")
    with pytest.raises(PlanError, match=r"vLLM 0.16.0 has no --cuda-graph-sizes \(vLLM 0.11.2"):
        import_plan("vllm", args=["--cuda-graph-sizes", "64"], version="0.15")
    with pytest.raises(PlanError, match=r"vLLM 0.16.0 has no --language-model-only \(vLLM 0.23"):
        import_plan("vllm", args=["--language-model-only"], version="0.15")
    out = import_plan("vllm", args=["--language-model-only"], version="0.23")
    assert notes_of(out) == [
        "1 vLLM 0.23.0 flag(s) that do not shape CUDA graphs, ignored: --language-model-only"
    ]


def test_vllm_0_23_default_list_adds_the_token_cap_and_interactivity_sizes():
    args = ["--max-num-seqs", "64", "--max-num-batched-tokens", "100"]
    old = table_of(import_plan("vllm", args=args, version="0.15"))
    new = table_of(import_plan("vllm", args=args, version="0.23"))
    assert list(old.capture_sizes) == [1, 2, 4] + list(range(8, 97, 8))
    assert list(new.capture_sizes) == [1, 2, 4] + list(range(8, 97, 8)) + [100]
    fine = ["--performance-mode", "interactivity", "--max-num-seqs", "64"]
    sizes = list(table_of(import_plan("vllm", args=fine, version="0.23")).capture_sizes)
    assert sizes == list(range(1, 33)) + list(range(40, 129, 8))
    wide = table_of(import_plan("vllm", args=["--performance-mode", "throughput"], version="0.23"))
    assert (wide.max_num_seqs, wide.max_num_batched_tokens) == (512, 16384)


def test_vllm_O_means_the_compilation_mode_in_0_11_and_the_optimization_level_later():
    assert table_of(import_plan("vllm", args=["-O0"])).mode.name == "NONE"
    assert table_of(import_plan("vllm", args=["-O3"])).mode.name == "FULL_AND_PIECEWISE"
    assert table_of(import_plan("vllm", args=["-O", "1"], version="0.15")).mode.name == "PIECEWISE"
    dotted = ["-cc.cudagraph_mode", "FULL_DECODE_ONLY", "-cc.max_cudagraph_capture_size=16"]
    out = import_plan("vllm", args=dotted, version="0.15")
    assert (table_of(out).mode.name, list(table_of(out).capture_sizes)) == (
        "FULL_DECODE_ONLY",
        [1, 2, 4, 8, 16],
    )


def test_vllm_serve_command_with_a_numeric_cudagraph_mode_from_pr_20059():
    text = (DATA / "vllm-20059.args").read_text()
    with pytest.raises(PlanError, match=r"--max_seq_len_to_capture\): not a vLLM 0.11.2 option"):
        import_plan("vllm", args=text)
    with pytest.raises(PlanError, match=r"cudagraph_mode '1' is not a vLLM CUDAGraphMode"):
        import_plan("vllm", args=text, allow_unknown=True)  # vLLM refused it too (the thread)


def test_every_graph_flag_of_an_adapter_is_an_option_of_one_of_its_releases():
    for mod in (vllm, sglang):
        known = set().union(*(load(mod.ENGINE, v).arity for v in labels(mod.ENGINE)))
        assert set(mod.FLAGS) <= known, set(mod.FLAGS) - known
        assert labels(mod.ENGINE) == sorted(mod.VERSIONS)


def _argparse_reading(options, word):
    """What Python's own argparse makes of ``word`` given the same option strings."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for i, opt in enumerate(options.arity):
        parser.add_argument(opt, dest=f"d{i}", action="store_true")
    try:
        found = parser._parse_optional(word)
    except (argparse.ArgumentError, SystemExit):
        return "ambiguous"
    found = found[0] if isinstance(found, list) else found
    return found[1] if found and found[0] is not None else None


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_prefix_resolution_agrees_with_argparse(data):
    releases = [(e, v) for e in ("vllm", "sglang") for v in labels(e)]
    options = load(*data.draw(st.sampled_from(releases)))
    opt = data.draw(st.sampled_from(sorted(options.arity)))
    word = opt[: data.draw(st.integers(2, len(opt)))]
    got = resolve(word, options)
    expected = _argparse_reading(options, word)
    assert (got.option if got.option or not got.candidates else "ambiguous") == expected


# -- vLLM start-up logs --------------------------------------------------------------------------


def test_engine_config_line_with_unquoted_values_from_issue_22265():
    out = import_plan("vllm", log=str(DATA / "vllm-22265-engine-config.log"))
    assert (table_of(out).mode.name, list(table_of(out).capture_sizes)) == (
        "FULL_AND_PIECEWISE",
        GRID_TO_512,
    )
    assert (
        "27 field(s) that do not shape CUDA graphs, ignored: model, tokenizer," in notes_of(out)[0]
    )
    assert out.plan["cudagraph"]["splitting_ops"] == ["attention"]  # vllm.mamba_mixer2 is one


def test_engine_config_line_with_enforce_eager_from_trl_3310():
    out = import_plan("vllm", log=str(DATA / "vllm-trl-3310-engine-config.log"))
    assert table_of(out).mode.name == "NONE" and "engine config enforce_eager" in out.text
    assert version_note(out) == (
        "no --engine-version: the log is from vLLM 0.8, read as vLLM 0.11; pass --engine-version "
        "to choose"
    )


def test_engine_config_line_of_vllm_0_19_without_a_compilation_config_from_rank_llm_426():
    out = import_plan("vllm", log=str(DATA / "vllm-rank-llm-426-engine-config.log"))
    assert table_of(out).mode.name == "FULL_AND_PIECEWISE" and table_of(out).data_parallel_size == 1
    assert "engine config: 24 field(s) that do not shape CUDA graphs" in notes_of(out)[0]
    assert version_note(out).startswith(
        "no --engine-version: the log is from vLLM 0.19, read as vLLM 0.15;"
    )
    old = import_plan("vllm", log=str(DATA / "vllm-rank-llm-426-engine-config.log"), version="0.11")
    assert notes_of(old)[1] == "the log is from vLLM 0.19; read with the rules of 0.11"


def test_an_excerpt_without_the_lines_beginning_is_read_from_its_first_setting_spark_267():
    out = import_plan("vllm", log=str(DATA / "vllm-spark-267-engine-config.log"))
    assert notes_of(out)[0].endswith("the line's beginning is missing; read from seed=")
    assert "vllm::deepseek_v4_attention" in out.plan["cudagraph"]["splitting_ops"]


def test_non_default_args_of_vllm_0_12_from_gpustack_4154():
    out = import_plan("vllm", log=str(DATA / "vllm-gpustack-4154-non-default-args.log"))
    assert notes_of(out) == [
        f"{DATA / 'vllm-gpustack-4154-non-default-args.log'}:5: non-default args: 6 field(s) that "
        "do not shape CUDA graphs, ignored: model_tag, host, port, model, max_model_len, "
        "served_model_name"
    ]


def test_unquoted_paths_names_and_object_reprs_are_values_never_errors(tmp_path):
    log = tmp_path / "v.log"
    log.write_text(
        "INFO [core.py:93] Initializing a V1 LLM engine (v0.11.0) with config: model=/path/to/dir,"
        " served_model_name=org/model, tokenizer_mode=auto, dtype=torch.bfloat16, x=<class 'a.B'>,"
        " y=<function f at 0x7f>, speculative_config=SpeculativeConfig(method='eagle', model=None,"
        " num_spec_tokens=3), compilation_config=CompilationConfig(cudagraph_mode="
        "CUDAGraphMode.PIECEWISE, cudagraph_capture_sizes=[4, 8])\n"
    )
    out = import_plan("vllm", log=str(log))
    assert (table_of(out).mode.name, table_of(out).decode_query_len) == ("PIECEWISE", 4)
    assert list(table_of(out).capture_sizes) == [4, 8]


@pytest.mark.parametrize(
    "line,message",
    [
        ("with config: compilation_config=" + "{'a': " * 100, "nested more than 64 levels"),
        ("non-default args: " + "[" * 5000, "nested more than 64 levels"),
        ("with config: compilation_config={'a': '" + "x" * (2 << 20) + "'}", "too long"),
        ("with config: compilation_config={'cudagraph_mode': <CUDAGraphMode.FULL", "not closed"),
    ],
    ids=["deep-engine-config", "deep-non-default", "huge-line", "cut-enum"],
)
def test_hostile_log_lines_are_located_errors_with_exit_2(tmp_path, capsys, line, message):
    log = tmp_path / "bad.log"
    log.write_text(line + "\n")
    assert main(["import", "--engine", "vllm", "--log", str(log)]) == 2
    err = capsys.readouterr().err
    assert "bad.log:1:" in err and "error[malformed-log-line]" in err and message in err
    assert "Traceback" not in err


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="{}[]()<>'\",:=. aZ_09/-", max_size=200))
def test_any_engine_config_text_imports_or_is_a_plan_error(tmp_path_factory, body):
    log = tmp_path_factory.mktemp("log") / "x.log"
    log.write_text("with config: " + body + "\n")
    try:
        import_plan("vllm", log=str(log))
    except PlanError:
        pass


# -- the release import assumes without --engine-version ---------------------------------------


def test_without_a_version_flags_are_read_as_the_newest_release_that_has_them_all():
    out = import_plan("vllm", args=["--max-num-seqs", "128", "--attention-backend", "FLASH_ATTN"])
    assert out.version == "0.23" and version_note(out) == (
        "no --engine-version: read as vLLM 0.23, the newest release graphplan knows (0.23, 0.15, "
        "0.11); pass --engine-version to choose"
    )
    assert "(vLLM 0.23) from flags" in out.text
    old = import_plan("vllm", args=["--max-num-seqs", "128", "--cuda-graph-sizes", "64"])
    assert old.version == "0.11" and version_note(old) == (
        "no --engine-version: read as vLLM 0.11, the newest of 0.23, 0.15, 0.11 with every option "
        "given (0.15 lacks one); pass --engine-version to choose"
    )
    assert import_plan("sglang", args=["--cuda-graph-max-bs", "16"]).diagnostics[0].message == (
        "no --engine-version: read as SGLang 0.5 (the release graphplan knows)"
    )
    given = import_plan("vllm", args=["--max-num-seqs", "128"], version="0.15")
    assert given.version == "0.15" and all(d.code != "engine-version" for d in given.diagnostics)


def test_flags_no_release_has_together_are_refused_as_the_default_release_reads_them():
    with pytest.raises(PlanError, match=r"vLLM 0.11.2 has no --language-model-only \(vLLM 0.23"):
        import_plan("vllm", args=["--cuda-graph-sizes", "64", "--language-model-only"])
    with pytest.raises(PlanError, match=r"not a vLLM 0.11.2 option"):
        import_plan("vllm", args=["--max-num-seqz", "8"])
