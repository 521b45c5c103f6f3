"""TensorRT-LLM's default CUDA-graph batch sizes, release by release, with exact lists.

``CudaGraphConfig._generate_cuda_graph_batch_sizes`` (tensorrt_llm/llmapi/llm_args.py) changed
twice: powers of two below ``2**floor(log2 max)`` in 1.0.0, below ``2**ceil(log2 max)`` from
1.1.0rc0, and steps of 64 after 128 for padded lists from 1.3.0rc13 (PR #12895); the model
engine's ``_filter_cuda_graph_batch_sizes`` then cuts at the executor's largest all-decode batch
(docs/engines.md gives the commit each rule was read at)."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphplan.compiler import PlanError, compile_plan
from graphplan.compiler.cli import main
from graphplan.compiler.engines import import_plan
from graphplan.compiler.engines.trtllm_versions import check_version, rule_note, size_rule
from graphplan.compiler.sizes import trtllm_filtered, trtllm_generated

DATA = Path(__file__).resolve().parent / "data" / "engines"
PADDED = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128]
PLAIN = list(range(1, 32)) + [32, 64, 128]
SMALL = {  # the same under every rule: nothing is added below 256
    (1, True): [1],
    (1, False): [1],
    (7, True): [1, 2, 4, 7],
    (7, False): [1, 2, 3, 4, 5, 6, 7],
    (8, True): [1, 2, 4, 8],
    (8, False): [1, 2, 3, 4, 5, 6, 7, 8],
    (100, True): [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 100],
    (100, False): list(range(1, 32)) + [32, 64, 100],
    (128, True): PADDED,
    (128, False): PLAIN,
    (129, True): PADDED + [129],
    (129, False): PLAIN + [129],
}
FLOOR = {  # 1.0.0: 2**i for i in range(8, floor(log2(max)))
    256: [256],
    300: [300],
    1000: [256, 1000],
    1024: [256, 512, 1024],
    2048: [256, 512, 1024, 2048],
}
CEIL = {  # 1.1.0rc0 .. 1.3.0rc11: range(8, ceil(log2(max)))
    256: [256],
    300: [256, 300],
    1000: [256, 512, 1000],
    1024: [256, 512, 1024],
    2048: [256, 512, 1024, 2048],
}
STEP64 = {  # 1.3.0rc13 and main, padded: +64 while <= max
    256: [192, 256],
    300: [192, 256, 300],
    1000: [192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1000],
    1024: [192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1024],
    2048: [192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1024]
    + [1088, 1152, 1216, 1280, 1344, 1408, 1472, 1536, 1600, 1664, 1728, 1792, 1856, 1920]
    + [1984, 2048],
}


@pytest.mark.parametrize("rule", ["pow2-floor", "pow2-ceil", "step64"])
@pytest.mark.parametrize("case", sorted(SMALL))
def test_every_rule_gives_the_same_list_up_to_a_max_of_129(rule, case):
    max_bs, padding = case
    assert trtllm_generated(max_bs, padding, rule) == SMALL[case]


@pytest.mark.parametrize("max_bs", sorted(FLOOR))
@pytest.mark.parametrize("padding", [True, False])
def test_1_0_adds_powers_of_two_below_two_to_the_floor_of_log2_max(max_bs, padding):
    base = PADDED if padding else PLAIN
    assert trtllm_generated(max_bs, padding, "pow2-floor") == base + FLOOR[max_bs]


@pytest.mark.parametrize("max_bs", sorted(CEIL))
@pytest.mark.parametrize("padding", [True, False])
def test_1_1_to_1_3rc11_add_powers_of_two_below_two_to_the_ceiling_of_log2_max(max_bs, padding):
    base = PADDED if padding else PLAIN
    assert trtllm_generated(max_bs, padding, "pow2-ceil") == base + CEIL[max_bs]


@pytest.mark.parametrize("max_bs", sorted(STEP64))
def test_1_3rc13_and_main_step_the_padded_list_by_64_after_128(max_bs):
    assert trtllm_generated(max_bs, True, "step64") == PADDED + STEP64[max_bs]


@pytest.mark.parametrize("max_bs", sorted(CEIL))
def test_1_3rc13_and_main_keep_the_ceiling_powers_of_two_without_padding(max_bs):
    assert trtllm_generated(max_bs, False, "step64") == PLAIN + CEIL[max_bs]


def test_the_issue_case_is_33_sizes_now_and_22_before():
    assert len(trtllm_generated(1024, True, "step64")) == 33
    assert len(trtllm_generated(1024, True, "pow2-floor")) == 22


def test_the_model_engine_cuts_at_the_largest_all_decode_batch_and_pads_to_it():
    sizes = trtllm_generated(1024, True)
    assert trtllm_filtered(sizes, 300, 8192, 1, True) == PADDED + [192, 256, 300]
    assert trtllm_filtered(PLAIN + CEIL[1024], 300, 8192, 1, False) == PLAIN + [256]
    assert trtllm_filtered(sizes, 2048, 512, 4, True) == PADDED  # cap 128 is already there
    assert trtllm_filtered(sizes, 100, 8192, 1, True) == PADDED[:-4] + [100]
    assert trtllm_filtered([1, 64, 512], 300, 8192, 1, True) == [1, 64, 300]
    assert trtllm_filtered([1, 64, 512], 300, 8192, 1, False) == [1, 64]
    assert trtllm_filtered(sizes, 4, 2, 3, True) == []  # not one request fits the token budget


@pytest.mark.parametrize(
    "version,rule",
    [
        ("1.0", "pow2-floor"),
        ("1.0.0rc4", "pow2-floor"),
        ("1.0.1", "pow2-floor"),
        ("v1.1.0rc0", "pow2-ceil"),
        ("1.1", "pow2-ceil"),
        ("1.2.0", "pow2-ceil"),
        ("1.3.0rc11", "pow2-ceil"),
        ("1.3.0rc12", "pow2-ceil"),
        ("1.3.0rc13", "step64"),
        ("1.3", "step64"),
        ("1.4.0rc1", "step64"),
        ("main", "step64"),
    ],
)
def test_a_named_release_picks_the_rule_it_shipped(version, rule):
    assert size_rule(check_version(version)) == rule


def test_the_default_release_is_main_and_unverified_ones_say_so():
    assert check_version(None) == "main"
    assert rule_note("1.3.0rc12") and rule_note("2.0") and not rule_note("1.2.0")


@pytest.mark.parametrize("version", ["0.21", "0.20.0", "1", "latest", "1.0.0-rc1", ""])
def test_a_release_before_1_0_or_not_a_release_is_refused(version):
    with pytest.raises(PlanError, match=r"error\[unknown-engine-version\]"):
        check_version(version or " ")


def _imported_sizes(text: str, tmp_path, **kw) -> list[int]:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return list(compile_plan(import_plan("trtllm", config=str(path), **kw).plan).capture_sizes)


def test_import_caps_the_generated_list_at_the_executor_max_batch_size(tmp_path):
    text = "max_batch_size: 300\ncuda_graph_config: {max_batch_size: 1024, enable_padding: %s}\n"
    assert _imported_sizes(text % "true", tmp_path) == PADDED + [192, 256, 300]
    assert _imported_sizes(text % "false", tmp_path) == PLAIN + [256]
    old = _imported_sizes(text % "true", tmp_path, version="1.0")
    assert old == PADDED + [256, 300]  # generated for 1024, cut at 300, padded to 300


def test_import_counts_q_tokens_per_request(tmp_path):
    text = (
        "max_batch_size: 256\nmax_num_tokens: 512\nspeculative_config: {max_draft_len: 3}\n"
        "cuda_graph_config: {max_batch_size: 1024, enable_padding: true}\n"
    )
    assert _imported_sizes(text, tmp_path) == [4 * b for b in PADDED]


def test_the_trtllm_preset_is_the_newest_list_after_the_engines_filter():
    plan = {
        "version": 1,
        "name": "p",
        "scheduler": {"max_num_seqs": 300, "max_num_batched_tokens": 8192},
        "cudagraph": {"capture_sizes": {"preset": "trtllm", "max_size": 1024}},
    }
    assert list(compile_plan(plan).capture_sizes) == PLAIN + [256]
    plan["cudagraph"]["capture_sizes"]["enable_padding"] = True
    assert list(compile_plan(plan).capture_sizes) == PADDED + [192, 256, 300]


def test_cli_import_names_the_release_and_refuses_an_unknown_one(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    config = str(DATA / "trtllm-6640-llama4-hybrid.yml")
    args = ["import", "--engine", "trtllm", "--config", config, "-o", str(out)]
    assert main(args + ["--engine-version", "1.2.0"]) == 0
    assert "1.2.0 default list for max_batch_size 1024, padded" in out.read_text()
    out.unlink()
    assert main(args + ["--engine-version", "0.19"]) == 2
    assert "TensorRT-LLM version '0.19' is not one graphplan reads" in capsys.readouterr().err
    assert not out.exists()
