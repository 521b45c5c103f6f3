"""The compiler's rules (docs/semantics.md §1-§9), one test per rule, with exact expectations."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphplan.compiler import BatchError, PlanError, RuntimeMode, compile_plan
from graphplan.compiler.records import Why

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "version": 1,
    "name": "rules",
    "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "decode_query_len": 1},
    "cudagraph": {
        "mode": "FULL_AND_PIECEWISE",
        "attention_support": "ALWAYS",
        "splitting_ops": ["attention"],
        "capture_sizes": {"preset": "vllm"},
    },
}


def plan(**sections) -> dict:
    """BASE with sections merged one level deep: plan(cudagraph={"mode": "FULL"})."""
    out = copy.deepcopy(BASE)
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name] = {**out[name], **value}
        else:
            out[name] = value
    return out


def compile_(**sections):
    return compile_plan(plan(**sections))


def codes(table) -> list[str]:
    return [d["code"] for d in table.diagnostics]


def downgrades(table) -> list[str]:
    """``REQUESTED -> RESOLVED (rule N)`` of each mode downgrade, in order."""
    return [d["message"].split(":")[0] for d in table.diagnostics if d["code"] == "mode-downgrade"]


def keys(table, routine: str) -> list[tuple]:
    """(num_tokens, num_reqs, num_active_loras, num_ubatches) of one routine's graphs, sorted."""
    return sorted(
        (g.key.num_tokens, g.key.num_reqs, g.key.num_active_loras, g.key.num_ubatches)
        for g in table.graphs
        if g.routine == routine
    )


VLLM_DEFAULT_SIZES = [
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    40,
    48,
    56,
    64,
    72,
    80,
    88,
    96,
    104,
    112,
    120,
    128,
    136,
    144,
    152,
    160,
    168,
    176,
    184,
    192,
    200,
    208,
    216,
    224,
    232,
    240,
    248,
    256,
    272,
    288,
    304,
    320,
    336,
    352,
    368,
    384,
    400,
    416,
    432,
    448,
    464,
    480,
    496,
    512,
]


# -- 1-2. modes and their resolution against attention support -----------------------------------


def test_full_mixed_mode_downgrades_to_full_and_piecewise_when_attention_is_uniform_only():
    t = compile_(cudagraph={"mode": "FULL", "attention_support": "UNIFORM_BATCH"})
    assert t.settings.mode.name == "FULL_AND_PIECEWISE"
    assert t.settings.requested_mode.name == "FULL"
    assert codes(t) == ["mode-downgrade"]
    assert "FULL -> FULL_AND_PIECEWISE (rule 1)" in t.diagnostics[0]["message"]
    assert t.diagnostics[0]["path"] == "cudagraph.mode"


def test_full_mixed_mode_downgrades_to_full_decode_only_when_attention_does_not_split():
    t = compile_(
        cudagraph={
            "mode": "FULL",
            "attention_support": "UNIFORM_BATCH",
            "splitting_ops": ["all_reduce"],
        }
    )
    assert t.settings.mode.name == "FULL_DECODE_ONLY"
    assert "FULL -> FULL_DECODE_ONLY (rule 1)" in t.diagnostics[0]["message"]


def test_full_mode_with_attention_never_is_an_error():
    with pytest.raises(PlanError, match=r"error\[full-attention-never\].*NEVER"):
        compile_(cudagraph={"mode": "FULL", "attention_support": "NEVER"})


@pytest.mark.parametrize(
    "mode,splitting,resolved",
    [
        ("FULL_AND_PIECEWISE", ["attention"], "PIECEWISE"),
        ("FULL_DECODE_ONLY", ["attention"], "PIECEWISE"),
        ("FULL_DECODE_ONLY", ["all_reduce"], "NONE"),
    ],
)
def test_full_decode_with_attention_never_downgrades_by_rule_2(mode, splitting, resolved):
    t = compile_(cudagraph={"mode": mode, "attention_support": "NEVER", "splitting_ops": splitting})
    assert t.settings.mode.name == resolved
    assert downgrades(t) == [f"{mode} -> {resolved} (rule 2)"]
    assert all(g.mode is RuntimeMode.PIECEWISE for g in t.graphs)


def test_spec_decode_with_single_token_attention_downgrades_full_decode_by_rule_3():
    t = compile_(
        scheduler={"decode_query_len": 2},
        cudagraph={"attention_support": "UNIFORM_SINGLE_TOKEN_DECODE"},
    )
    assert t.settings.mode.name == "PIECEWISE"
    assert "FULL_AND_PIECEWISE -> PIECEWISE (rule 3)" in t.diagnostics[0]["message"]
    assert "decode_query_len=2" in t.diagnostics[0]["message"]


def test_single_token_attention_keeps_full_decode_when_q_is_1():
    t = compile_(cudagraph={"attention_support": "UNIFORM_SINGLE_TOKEN_DECODE"})
    assert t.settings.mode.name == "FULL_AND_PIECEWISE"
    assert codes(t) == []


def test_downgrades_chain_rule_1_then_rule_3():
    t = compile_(
        scheduler={"decode_query_len": 2},
        cudagraph={"mode": "FULL", "attention_support": "UNIFORM_SINGLE_TOKEN_DECODE"},
    )
    assert t.settings.mode.name == "PIECEWISE"
    assert downgrades(t) == [
        "FULL -> FULL_AND_PIECEWISE (rule 1)",
        "FULL_AND_PIECEWISE -> PIECEWISE (rule 3)",
    ]


def test_no_splitting_ops_turns_piecewise_into_none_by_rule_0():
    t = compile_(cudagraph={"mode": "PIECEWISE", "splitting_ops": []})
    assert t.settings.mode.name == "NONE"
    assert t.graphs == ()
    assert list(t.settings.capture_sizes) == []
    assert "PIECEWISE -> NONE (rule 0)" in t.diagnostics[0]["message"]


def test_no_splitting_ops_turns_full_and_piecewise_into_full_then_rule_1_lowers_it():
    t = compile_(cudagraph={"splitting_ops": []})
    assert t.settings.mode.name == "FULL"
    t = compile_(cudagraph={"splitting_ops": [], "attention_support": "UNIFORM_BATCH"})
    assert t.settings.mode.name == "FULL_DECODE_ONLY"
    assert downgrades(t) == [
        "FULL_AND_PIECEWISE -> FULL (rule 0)",
        "FULL -> FULL_DECODE_ONLY (rule 1)",
    ]


@pytest.mark.parametrize(
    "mode,decode,mixed,separate",
    [
        ("NONE", "NONE", "NONE", False),
        ("PIECEWISE", "PIECEWISE", "PIECEWISE", False),
        ("FULL", "FULL", "FULL", False),
        ("FULL_DECODE_ONLY", "FULL", "NONE", True),
        ("FULL_AND_PIECEWISE", "FULL", "PIECEWISE", True),
    ],
)
def test_each_mode_names_its_decode_and_mixed_routines(mode, decode, mixed, separate):
    t = compile_(cudagraph={"mode": mode})
    assert (
        t.settings.decode_mode.name,
        t.settings.mixed_mode.name,
        t.settings.separate_routines,
    ) == (decode, mixed, separate)
    assert downgrades(t) == []


# -- 3. capture sizes ----------------------------------------------------------------------------


def test_vllm_preset_default_llama_gives_51_sizes():
    t = compile_plan(ROOT / "plans" / "llama3-8b-h100.yaml")
    assert list(t.settings.capture_sizes) == VLLM_DEFAULT_SIZES
    assert len(VLLM_DEFAULT_SIZES) == 51


def test_vllm_preset_caps_at_twice_max_num_seqs_and_adds_max_num_seqs():
    assert list(compile_(scheduler={"max_num_seqs": 16}).settings.capture_sizes) == [
        1,
        2,
        4,
        8,
        16,
        24,
        32,
    ]
    assert list(compile_(scheduler={"max_num_seqs": 20}).settings.capture_sizes) == [
        1,
        2,
        4,
        8,
        16,
        20,
        24,
        32,
        40,
    ]


def test_vllm_preset_caps_at_max_num_batched_tokens_and_adds_it():
    t = compile_(scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 20})
    assert list(t.settings.capture_sizes) == [1, 2, 4, 8, 16, 20]


def test_vllm_preset_ceiling_1024_extends_the_16_step_grid():
    t = compile_(
        scheduler={"max_num_seqs": 512},
        cudagraph={"capture_sizes": {"preset": "vllm", "ceiling": 1024}},
    )
    assert list(t.settings.capture_sizes) == VLLM_DEFAULT_SIZES + list(range(528, 1025, 16))


def test_vllm_preset_with_spec_decode_adds_request_multiples_of_q():
    # top = min(2 * q * seqs, 512) = 32; grid [1 2 4 8 16 24 32] + n*q for n in [1 2 4 8] -> 1 rounds to 2
    t = compile_(
        scheduler={"max_num_seqs": 8, "decode_query_len": 2},
        cudagraph={"attention_support": "UNIFORM_BATCH"},
    )
    assert list(t.settings.capture_sizes) == [2, 4, 8, 16, 24, 32]
    assert codes(t) == ["size-rounded"]
    # without FULL decode nothing is rounded, and n*q adds 2 (already present) and no new size
    t = compile_(
        scheduler={"max_num_seqs": 8, "decode_query_len": 2}, cudagraph={"mode": "PIECEWISE"}
    )
    assert list(t.settings.capture_sizes) == [1, 2, 4, 8, 16, 24, 32]


def test_vllm_preset_with_q3_adds_every_request_count_times_q():
    t = compile_(
        scheduler={"max_num_seqs": 8, "decode_query_len": 3}, cudagraph={"mode": "PIECEWISE"}
    )
    # grid up to 48 plus 3, 6, 12, 24 (n in 1 2 4 8)
    assert list(t.settings.capture_sizes) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48]


def test_spec_decode_rounding_of_the_vllm_preset_keeps_sizes_up_to_the_computed_max():
    # max = min(2 * q * seqs, 512) = 6; generated 1 2 3 4 round to 3 3 3 6: 6 is kept (vLLM
    # replays a 6-token batch), though the largest generated size is 4
    t = compile_(
        scheduler={"max_num_seqs": 1, "decode_query_len": 3},
        cudagraph={"mode": "FULL_AND_PIECEWISE", "attention_support": "UNIFORM_BATCH"},
    )
    assert list(t.settings.capture_sizes) == [3, 6]
    assert t.route(6, 1, 6).mode is RuntimeMode.PIECEWISE  # a 6-token batch replays, as in vLLM


def test_spec_decode_rounds_sizes_up_to_multiples_of_q():
    t = compile_(
        scheduler={"decode_query_len": 3},
        cudagraph={
            "attention_support": "UNIFORM_BATCH",
            "capture_sizes": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        },
    )
    assert list(t.settings.capture_sizes) == [3, 6, 9]
    moved = [d for d in t.diagnostics if d["code"] == "size-rounded"]
    assert [d["path"] for d in moved] == [
        f"cudagraph.capture_sizes[{i}]" for i in (0, 1, 3, 4, 6, 7)
    ]
    assert "size 1 moved to 3" in moved[0]["message"]
    dropped = [d for d in t.diagnostics if d["code"] == "size-dropped"]
    assert [d["path"] for d in dropped] == ["cudagraph.capture_sizes[9]"]
    assert "size 10 rounds up to 12" in dropped[0]["message"]


def test_spec_decode_rounding_of_a_preset_is_one_diagnostic_per_code():
    t = compile_plan(ROOT / "plans" / "sweep.yaml.j2", {"max_num_seqs": 128, "spec_tokens": 2})
    assert codes(t) == ["size-rounded", "size-dropped"]
    assert t.diagnostics[0]["message"].startswith("preset vllm: 35 sizes moved to multiples of")
    assert all(s % 3 == 0 for s in t.settings.capture_sizes)


def test_spec_decode_with_no_surviving_size_falls_back_to_q():
    t = compile_(
        scheduler={"decode_query_len": 4},
        cudagraph={"attention_support": "UNIFORM_BATCH", "capture_sizes": [5]},
    )
    assert list(t.settings.capture_sizes) == [4]


def test_spec_decode_with_every_size_below_q_is_an_error():
    with pytest.raises(PlanError, match=r"error\[no-sizes\].*decode_query_len=4"):
        compile_(
            scheduler={"decode_query_len": 4},
            cudagraph={"attention_support": "UNIFORM_BATCH", "capture_sizes": [2]},
        )


def test_sizes_above_max_num_batched_tokens_are_dropped_with_a_diagnostic_each():
    t = compile_(
        scheduler={"max_num_seqs": 128, "max_num_batched_tokens": 256},
        cudagraph={"capture_sizes": [300, 1, 8, 257]},
    )
    assert list(t.settings.capture_sizes) == [1, 8]
    dropped = [d for d in t.diagnostics if d["code"] == "size-dropped"]
    assert [d["path"] for d in dropped] == [
        "cudagraph.capture_sizes[0]",
        "cudagraph.capture_sizes[3]",
    ]


def test_explicit_lists_are_deduplicated_and_sorted():
    t = compile_(cudagraph={"capture_sizes": [8, 4, 8, 1]})
    assert list(t.settings.capture_sizes) == [1, 4, 8]
    assert codes(t) == ["size-duplicate"]
    assert t.diagnostics[0]["path"] == "cudagraph.capture_sizes[2]"


def test_ranges_and_include_combine():
    t = compile_(
        cudagraph={
            "capture_sizes": {
                "ranges": [{"from": 8, "to": 20, "step": 8}, {"from": 32, "to": 64, "step": 16}],
                "include": [1, 2, 4],
            }
        }
    )
    assert list(t.settings.capture_sizes) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_a_range_that_runs_backwards_is_an_error():
    with pytest.raises(PlanError, match=r"error\[bad-range\]: cudagraph.capture_sizes.ranges\[0\]"):
        compile_(cudagraph={"capture_sizes": {"ranges": [{"from": 64, "to": 8, "step": 8}]}})


def test_ranges_generating_more_than_4096_sizes_are_an_error():
    with pytest.raises(PlanError, match=r"error\[too-many-sizes\]"):
        compile_(cudagraph={"capture_sizes": {"ranges": [{"from": 1, "to": 5000, "step": 1}]}})


def test_sglang_preset_matches_its_batch_size_list():
    t = compile_plan(ROOT / "plans" / "piecewise-only.yaml")  # max_num_seqs 160
    assert list(t.settings.capture_sizes) == [1, 2, 4, 8, 12] + list(range(16, 161, 8))


def test_sglang_preset_with_max_size_continues_in_16_then_32_steps():
    t = compile_(
        scheduler={"max_num_seqs": 1024},
        cudagraph={"capture_sizes": {"preset": "sglang", "max_size": 600}},
    )
    assert list(t.settings.capture_sizes) == (
        [1, 2, 4, 8, 12]
        + list(range(16, 257, 8))
        + list(range(272, 512, 16))
        + [512, 544, 576, 600]
    )


def test_sglang_preset_with_spec_decode_uses_its_dense_list_times_q():
    t = compile_(
        scheduler={"max_num_seqs": 64, "decode_query_len": 2},
        cudagraph={"attention_support": "UNIFORM_BATCH", "capture_sizes": {"preset": "sglang"}},
    )
    requests = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
    assert list(t.settings.capture_sizes) == [2 * b for b in requests]
    assert codes(t) == []


def test_trtllm_preset_default_is_1_to_32_then_64_and_128():
    t = compile_(cudagraph={"capture_sizes": {"preset": "trtllm"}})
    assert list(t.settings.capture_sizes) == list(range(1, 33)) + [64, 128]


def test_trtllm_preset_adds_powers_of_two_below_max_and_max():
    t = compile_(
        scheduler={"max_num_seqs": 1024},
        cudagraph={"capture_sizes": {"preset": "trtllm", "max_size": 1000}},
    )
    assert list(t.settings.capture_sizes) == list(range(1, 33)) + [64, 128, 256, 512, 1000]


def test_trtllm_preset_is_cut_at_max_num_batched_tokens_as_its_engine_cuts_it():
    # TensorRT-LLM's _filter_cuda_graph_batch_sizes: unpadded, 65..100 run eager; padded, to 100
    sched = {"max_num_seqs": 100, "max_num_batched_tokens": 100}
    t = compile_(scheduler=sched, cudagraph={"capture_sizes": {"preset": "trtllm"}})
    assert list(t.settings.capture_sizes) == list(range(1, 33)) + [64]
    padded = {"preset": "trtllm", "enable_padding": True}
    t = compile_(scheduler=sched, cudagraph={"capture_sizes": padded})
    assert list(t.settings.capture_sizes) == [1, 2, 4] + list(range(8, 97, 8)) + [100]


def test_trtllm_padded_preset_steps_by_64_after_128():
    t = compile_plan(ROOT / "plans" / "large-65k-lora8-dp8.yaml")
    assert list(t.settings.capture_sizes) == [1, 2, 4] + list(range(8, 129, 8)) + list(
        range(192, 1025, 64)
    )


def test_trtllm_preset_with_spec_decode_multiplies_requests_by_q():
    t = compile_(
        scheduler={"max_num_seqs": 64, "decode_query_len": 2},
        cudagraph={"attention_support": "UNIFORM_BATCH", "capture_sizes": {"preset": "trtllm"}},
    )
    assert list(t.settings.capture_sizes) == [2 * b for b in list(range(1, 33)) + [64]]


def test_mode_none_captures_nothing():
    t = compile_plan(ROOT / "plans" / "eager.yaml")
    assert (t.graphs, t.settings.capture_sizes, codes(t)) == ((), (), [])


# -- 4. keys ---------------------------------------------------------------------------------------


def test_decode_keys_cover_q_to_q_times_max_num_seqs_with_requests_size_over_q():
    t = compile_(
        scheduler={"max_num_seqs": 8, "decode_query_len": 2},
        cudagraph={"attention_support": "UNIFORM_BATCH", "capture_sizes": [2, 4, 8, 16, 24, 32]},
    )
    assert keys(t, "full_decode") == [(2, 1, 0, 1), (4, 2, 0, 1), (8, 4, 0, 1), (16, 8, 0, 1)]
    assert all(g.key.uniform for g in t.graphs if g.routine == "full_decode")
    assert keys(t, "piecewise") == [(s, None, 0, 1) for s in (2, 4, 8, 16, 24, 32)]
    assert not any(g.key.uniform for g in t.graphs if g.routine == "piecewise")


def test_full_mode_keys_every_size_with_requests_capped_at_max_num_seqs():
    t = compile_(
        scheduler={"max_num_seqs": 8}, cudagraph={"mode": "FULL", "capture_sizes": [1, 4, 8, 16]}
    )
    assert keys(t, "full_mixed") == [(1, 1, 0, 1), (4, 4, 0, 1), (8, 8, 0, 1), (16, 8, 0, 1)]
    assert keys(t, "full_decode") == [] and keys(t, "piecewise") == []


def test_full_decode_only_warns_about_sizes_no_routine_uses():
    t = compile_(
        scheduler={"max_num_seqs": 4},
        cudagraph={"mode": "FULL_DECODE_ONLY", "capture_sizes": [1, 2, 4, 8, 16]},
    )
    assert keys(t, "full_decode") == [(1, 1, 0, 1), (2, 2, 0, 1), (4, 4, 0, 1)]
    assert codes(t) == ["size-unused"]
    assert "2 size(s) above q*max_num_seqs=4" in t.diagnostics[0]["message"]


def test_capture_order_is_piecewise_then_full_largest_tokens_and_loras_first():
    t = compile_(
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64},
        cudagraph={"capture_sizes": [1, 2, 4]},
        lora={"enabled": True, "max_loras": 1},
    )
    order = [(g.mode.name, g.key.num_tokens, g.key.num_active_loras) for g in t.graphs]
    assert order == [("PIECEWISE", s, n) for s in (4, 2, 1) for n in (2, 1, 0)] + [
        ("FULL", s, n) for s in (4, 2, 1) for n in (2, 1, 0)
    ]
    assert [g.id for g in t.graphs] == list(range(18))


def test_capture_order_puts_ubatched_before_plain_twin_of_the_same_size():
    t = compile_(
        scheduler={"max_num_seqs": 64},
        cudagraph={"capture_sizes": [16, 32]},
        parallel={
            "data_parallel_size": 2,
            "ubatch": {"enabled": True, "decode_token_threshold": 16},
        },
    )
    full = [(g.key.num_tokens, g.key.num_ubatches) for g in t.graphs if g.mode is RuntimeMode.FULL]
    assert full == [(32, 2), (32, 1), (16, 2), (16, 1)]


def test_route_matrices_point_at_graphs_of_their_routine_case_and_size():
    t = compile_plan(ROOT / "plans" / "llama3-8b-lora8.yaml")
    sizes, cases = t.settings.capture_sizes, t.settings.lora_cases
    for routine, matrix in t.routes.items():
        for c, row in enumerate(matrix.tolist()):
            for i, gid in enumerate(row):
                if gid >= 0:
                    g = t.graphs[gid]
                    assert (g.routine, g.key.num_active_loras, g.key.num_tokens) == (
                        routine,
                        cases[c],
                        sizes[i],
                    )
    assert sum(int((m >= 0).sum()) for m in t.routes.values()) == len(t.graphs)


# -- 5. LoRA ---------------------------------------------------------------------------------------


def test_lora_cases_for_max_loras_8_are_0_1_2_4_8_9():
    t = compile_plan(ROOT / "plans" / "llama3-8b-lora8.yaml")
    assert list(t.settings.lora_cases) == [0, 1, 2, 4, 8, 9]
    assert [t.lora_case(n) for n in range(10)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, 9]
    per_case = len(t.graphs) // 6
    assert len(t.graphs) == 6 * per_case == 6 * (35 + 19)  # 35 piecewise + 19 decode sizes


@pytest.mark.parametrize(
    "max_loras,cases",
    [(1, [0, 1, 2]), (3, [0, 1, 2, 4]), (4, [0, 1, 2, 4, 5]), (7, [0, 1, 2, 4, 8])],
)
def test_lora_cases_are_zero_powers_of_two_and_max_loras_plus_one(max_loras, cases):
    t = compile_(lora={"enabled": True, "max_loras": max_loras})
    assert list(t.settings.lora_cases) == cases


def test_lora_without_separate_base_runs_base_batches_on_the_smallest_lora_graph():
    t = compile_(lora={"enabled": True, "max_loras": 8, "separate_base": False})
    assert list(t.settings.lora_cases) == [1, 2, 4, 8, 9]
    assert t.lora_case(0) == 1
    assert all(g.key.has_lora for g in t.graphs)
    assert t.graphs[t.route(8, 8, 1, 0).graph_id].key.num_active_loras == 1


def test_lora_without_count_specialization_has_one_lora_case():
    t = compile_(lora={"enabled": True, "max_loras": 8, "specialize_count": False})
    assert list(t.settings.lora_cases) == [0, 9]
    assert [t.lora_case(n) for n in range(10)] == [0] + [9] * 9
    t = compile_(
        lora={"enabled": True, "max_loras": 8, "specialize_count": False, "separate_base": False}
    )
    assert list(t.settings.lora_cases) == [9]


def test_active_adapter_count_rounds_up_to_the_next_captured_case():
    t = compile_plan(ROOT / "plans" / "llama3-8b-lora8.yaml")
    for loras, case in [(0, 0), (3, 4), (5, 8), (9, 9)]:
        g = t.route(8, 8, 1, loras).graph
        assert (g.num_active_loras, g.has_lora) == (case, case > 0)


def test_lora_off_has_one_case_and_rejects_active_adapters():
    t = compile_()
    assert t.settings.lora_cases == (0,) and t.settings.lora_case_of_count == (0,)
    with pytest.raises(BatchError, match=r"num_active_loras=1 is outside 0..0"):
        t.route(8, 8, 1, 1)


# -- 7. micro-batching: ubatched keys, plain twins ------------------------------------------------

UB = {"data_parallel_size": 2, "ubatch": {"enabled": True, "decode_token_threshold": 8}}
UB_SIZES = {"capture_sizes": [1, 2, 4, 8, 16, 32]}


def test_ubatched_decode_keys_start_at_the_decode_threshold_and_keep_plain_twins():
    t = compile_(scheduler={"max_num_seqs": 32}, cudagraph=UB_SIZES, parallel=UB)
    assert keys(t, "full_decode_ubatched") == [(8, 8, 0, 2), (16, 16, 0, 2), (32, 32, 0, 2)]
    assert keys(t, "full_decode") == [(s, s, 0, 1) for s in (1, 2, 4, 8, 16, 32)]
    plain, ub = t.route(16, 16, 1), t.route(16, 16, 1, ubatched=True)
    assert (plain.mode, plain.why, plain.wants_ubatch, plain.graph.num_ubatches) == (
        RuntimeMode.FULL,
        Why.FULL_DECODE,
        True,
        1,
    )
    assert (ub.mode, ub.why, ub.graph.num_ubatches, ub.padded_tokens, ub.padded_reqs) == (
        RuntimeMode.FULL,
        Why.FULL_UBATCHED,
        2,
        16,
        16,
    )


def test_without_plain_twins_an_aborted_ubatch_falls_back_to_piecewise_or_eager():
    ub = {**UB, "ubatch": {**UB["ubatch"], "plain_twins": False}}
    t = compile_(scheduler={"max_num_seqs": 32}, cudagraph=UB_SIZES, parallel=ub)
    assert keys(t, "full_decode") == [(1, 1, 0, 1), (2, 2, 0, 1), (4, 4, 0, 1)]
    r = t.route(16, 16, 1)
    assert (r.mode, r.why) == (RuntimeMode.PIECEWISE, Why.PIECEWISE)
    t = compile_(
        scheduler={"max_num_seqs": 32},
        cudagraph={**UB_SIZES, "mode": "FULL_DECODE_ONLY"},
        parallel=ub,
    )
    r = t.route(16, 16, 1)
    assert (r.mode, r.why, r.graph_id) == (RuntimeMode.NONE, Why.NO_TWIN, -1)
    assert any("plain_twins is false" in s for s in r.reasons)
    assert t.route(16, 16, 1, ubatched=True).why == Why.FULL_UBATCHED


def test_ubatched_routes_exist_only_for_uniform_decode():
    t = compile_(scheduler={"max_num_seqs": 32}, cudagraph=UB_SIZES, parallel=UB)
    r = t.route(16, 4, 13, ubatched=True)
    assert (r.mode, r.why, r.padded_tokens) == (RuntimeMode.NONE, Why.UBATCH_MIXED, 16)


def test_uniform_batch_below_the_ubatch_threshold_has_no_ubatched_graph_and_says_so():
    t = compile_(scheduler={"max_num_seqs": 32}, cudagraph=UB_SIZES, parallel=UB)
    r = t.route(4, 4, 1, ubatched=True)  # a decode size, but below decode_token_threshold=8
    assert (r.mode, r.why) == (RuntimeMode.NONE, Why.NO_UBATCH_GRAPH)
    assert any("no ubatched graph at this size" in s for s in r.reasons)
    assert t.route(4, 4, 1, allow="PIECEWISE", ubatched=True).why == Why.NO_UBATCH_GRAPH
    assert t.route(16, 4, 13, allow="PIECEWISE", ubatched=True).why == Why.UBATCH_MIXED


def test_explain_shows_the_dp_agreed_padding():
    t = compile_(scheduler={"max_num_seqs": 32}, cudagraph=UB_SIZES, parallel=UB)
    r = t.route(3, 3, 1, allow="FULL", pad_to=9)
    assert r.padded_tokens == 16
    assert "DP: the ranks agreed on 9 tokens, so this rank pads 3 -> 9" in r.reasons
    assert "pad: 9 -> 16 tokens (smallest capture size >= 9)" in r.reasons


def test_wants_ubatch_compares_unpadded_tokens_with_the_routine_threshold():
    t = compile_(
        scheduler={"max_num_seqs": 32},
        cudagraph=UB_SIZES,
        parallel={**UB, "ubatch": {**UB["ubatch"], "prefill_token_threshold": 20}},
    )
    assert [t.route(n, n, 1).wants_ubatch for n in (7, 8, 9)] == [False, True, True]
    assert [t.route(n, 1, n).wants_ubatch for n in (19, 20)] == [False, True]
    assert compile_().route(500, 1, 500).wants_ubatch is False


def test_full_mode_has_ubatched_decode_graphs_beside_its_mixed_graphs():
    t = compile_(
        scheduler={"max_num_seqs": 32}, cudagraph={**UB_SIZES, "mode": "FULL"}, parallel=UB
    )
    assert keys(t, "full_decode_ubatched") == [(8, 8, 0, 2), (16, 16, 0, 2), (32, 32, 0, 2)]
    assert len(keys(t, "full_mixed")) == 6 and keys(t, "full_decode") == []


def test_ubatch_without_full_decode_graphs_is_a_diagnostic():
    t = compile_(cudagraph={"mode": "PIECEWISE"}, parallel=UB)
    assert codes(t) == ["ubatch-no-graphs"]
    assert keys(t, "full_decode_ubatched") == []


# -- strict ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sections,code",
    [
        ({"cudagraph": {"mode": "FULL", "attention_support": "UNIFORM_BATCH"}}, "mode-downgrade"),
        ({"cudagraph": {"splitting_ops": []}}, "mode-downgrade"),
        (
            {
                "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 100},
                "cudagraph": {"capture_sizes": [8, 200]},
            },
            "size-dropped",
        ),
        (
            {
                "scheduler": {"decode_query_len": 2},
                "cudagraph": {"attention_support": "UNIFORM_BATCH", "capture_sizes": [3, 8]},
            },
            "size-rounded",
        ),
        (
            {
                "scheduler": {"decode_query_len": 2},
                "cudagraph": {"attention_support": "UNIFORM_BATCH", "capture_sizes": [2, 7]},
            },
            "size-dropped",
        ),
    ],
)
def test_strict_turns_each_downgrade_dropped_or_moved_size_into_an_error(sections, code):
    warn = compile_plan(plan(**sections))
    assert code in codes(warn)
    strict = plan(**sections)
    strict["cudagraph"] = {**strict["cudagraph"], "strict": True}
    with pytest.raises(PlanError, match=rf"error\[{code}\].*or set strict: false") as e:
        compile_plan(strict)
    assert all(d.severity == "error" for d in e.value.diagnostics)


def test_strict_plan_without_downgrades_compiles():
    t = compile_plan(ROOT / "plans" / "llama3-8b-eagle3.yaml")
    assert t.plan["cudagraph"]["strict"] is True
    assert list(t.settings.capture_sizes) == [3, 6, 12] + list(range(24, 385, 24))
    assert codes(t) == []


# -- rules that span fields ------------------------------------------------------------------------


def test_ubatch_without_data_parallelism_is_an_error():
    with pytest.raises(
        PlanError,
        match=r"error\[ubatch-needs-dp\]: parallel.ubatch.enabled: .*"
        r"set parallel.data_parallel_size >= 2",
    ):
        compile_(parallel={"ubatch": {"enabled": True}})


@pytest.mark.parametrize("field", ["decode_token_threshold", "prefill_token_threshold"])
def test_ubatch_thresholds_below_num_ubatches_are_errors(field):
    with pytest.raises(
        PlanError,
        match=rf"error\[ubatch-threshold\]: parallel.ubatch.{field}: "
        r"2 is below num_ubatches=3.*at least 3",
    ):
        compile_(
            parallel={
                "data_parallel_size": 2,
                "ubatch": {"enabled": True, "num_ubatches": 3, field: 2},
            }
        )


def test_ubatch_thresholds_equal_to_num_ubatches_are_allowed():
    t = compile_(
        parallel={
            "data_parallel_size": 2,
            "ubatch": {"enabled": True, "decode_token_threshold": 2, "prefill_token_threshold": 2},
        }
    )
    assert t.settings.ubatch.decode_token_threshold == 2


def test_disabled_ubatch_is_not_checked():
    t = compile_(parallel={"ubatch": {"enabled": False, "decode_token_threshold": 1}})
    assert codes(t) == []


def test_max_num_batched_tokens_below_max_num_seqs_is_an_error():
    with pytest.raises(
        PlanError,
        match=r"error\[tokens-below-seqs\]: scheduler.max_num_batched_"
        r"tokens: 100 is below max_num_seqs=256",
    ):
        compile_(scheduler={"max_num_batched_tokens": 100})


def test_decode_query_len_above_max_num_batched_tokens_is_an_error():
    with pytest.raises(
        PlanError,
        match=r"error\[query-len-above-tokens\]: scheduler.decode_query_"
        r"len: 4 exceeds max_num_batched_tokens=2",
    ):
        compile_(scheduler={"max_num_seqs": 1, "max_num_batched_tokens": 2, "decode_query_len": 4})


def test_a_decode_step_larger_than_the_token_budget_is_a_warning():
    t = compile_(
        scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 300, "decode_query_len": 2},
        cudagraph={"attention_support": "UNIFORM_BATCH"},
    )
    assert codes(t)[0] == "decode-capped"
    assert "at most 150 requests decode together" in t.diagnostics[0]["message"]


def test_every_cross_field_error_is_reported_at_once_with_its_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(
        "version: 1\nname: bad\nscheduler:\n  max_num_seqs: 300\n"
        "  max_num_batched_tokens: 200\nparallel:\n  ubatch:\n    enabled: true\n"
        "    decode_token_threshold: 1\n"
    )
    with pytest.raises(PlanError, match=r"error\[tokens-below-seqs\]: .*200 is below") as e:
        compile_plan(p)
    found = [(d.code, d.line, d.col) for d in e.value.diagnostics]
    assert found == [
        ("tokens-below-seqs", 5, 27),
        ("ubatch-needs-dp", 8, 14),
        ("ubatch-threshold", 9, 29),
    ]
    assert str(e.value).splitlines()[0].startswith(f"{p}:5:27: error[tokens-below-seqs]:")


# -- 4. dispatch -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h100():
    return compile_plan(ROOT / "plans" / "llama3-8b-h100.yaml")


def test_uniform_decode_pads_to_a_full_decode_graph(h100):
    r = h100.route(9, 9, 1)
    assert (r.mode, r.padded_tokens, r.padded_reqs, r.why) == (
        RuntimeMode.FULL,
        16,
        16,
        Why.FULL_DECODE,
    )
    assert r.graph == h100.graphs[r.graph_id].key and r.graph.uniform


def test_uniform_needs_both_request_count_and_query_length(h100):
    for args in [(9,), (9, 9), (9, 9, None)]:
        r = h100.route(*args)
        assert (r.mode, r.padded_tokens, r.why) == (RuntimeMode.PIECEWISE, 16, Why.PIECEWISE)
    assert h100.route(9, 3, 3).mode is RuntimeMode.PIECEWISE  # q = 1: 3 tokens per request is mixed


def test_mixed_batches_pad_tokens_but_keep_their_request_count(h100):
    r = h100.route(300, 7, 200)
    assert (r.mode, r.padded_tokens, r.padded_reqs, r.graph.num_reqs) == (
        RuntimeMode.PIECEWISE,
        304,
        7,
        None,
    )


def test_uniform_batches_padding_past_q_times_max_num_seqs_use_the_mixed_routine():
    t = compile_(scheduler={"max_num_seqs": 10}, cudagraph={"capture_sizes": [4, 16]})
    assert keys(t, "full_decode") == [(4, 4, 0, 1)]
    r = t.route(9, 9, 1)
    assert (r.mode, r.padded_tokens, r.padded_reqs, r.why) == (
        RuntimeMode.PIECEWISE,
        16,
        9,
        Why.PIECEWISE,
    )
    assert any("decode graphs cover q..q*max_num_seqs = 1..10" in s for s in r.reasons)


def test_batches_above_the_largest_size_run_eager_unpadded(h100):
    r = h100.route(513, 10, 500)
    assert (r.mode, r.graph_id, r.graph, r.padded_tokens, r.padded_reqs, r.why) == (
        RuntimeMode.NONE,
        -1,
        None,
        513,
        10,
        Why.TOO_BIG,
    )
    assert "exceed the largest capture size 512" in r.reasons[-1]


def test_full_mode_routes_uniform_batches_to_the_mixed_graph():
    t = compile_(
        scheduler={"max_num_seqs": 8}, cudagraph={"mode": "FULL", "capture_sizes": [1, 4, 16]}
    )
    r = t.route(3, 3, 1)
    assert (r.mode, r.padded_tokens, r.padded_reqs, r.why) == (
        RuntimeMode.FULL,
        4,
        4,
        Why.FULL_MIXED,
    )
    r = t.route(10, 2, 9)
    assert (r.mode, r.padded_tokens, r.padded_reqs) == (RuntimeMode.FULL, 16, 8)


def test_full_decode_only_runs_mixed_batches_eager():
    t = compile_(cudagraph={"mode": "FULL_DECODE_ONLY"})
    r = t.route(24, 2, 20)
    assert (r.mode, r.why, r.padded_tokens) == (RuntimeMode.NONE, Why.MIXED_NONE, 24)
    assert t.route(24, 24, 1).mode is RuntimeMode.FULL


def test_eager_plan_routes_everything_eager_with_a_reason():
    t = compile_plan(ROOT / "plans" / "eager.yaml")
    for n in (1, 512, 8192):
        r = t.route(n)
        assert (r.mode, r.why, r.padded_tokens) == (RuntimeMode.NONE, Why.NO_GRAPHS, n)
        assert "captures no graphs" in r.reasons[-1]


def test_spec_decode_uniform_routes_pad_to_multiples_of_q():
    t = compile_plan(ROOT / "plans" / "llama3-8b-eagle3.yaml")
    r = t.route(9, 3, 3)
    assert (r.mode, r.padded_tokens, r.padded_reqs) == (RuntimeMode.FULL, 12, 4)
    r = t.route(27, 9, 3)
    assert (r.mode, r.padded_tokens, r.padded_reqs) == (RuntimeMode.FULL, 48, 16)


def test_reasons_start_with_the_batch_and_end_with_the_decision(h100):
    reasons = h100.route(9, 9, 1).reasons
    assert (
        reasons[0] == "batch: 9 tokens, 9 requests, max_query_len 1 -> uniform decode "
        "(every request has q=1 tokens)"
    )
    assert reasons[1] == "pad: 9 -> 16 tokens (smallest capture size >= 9)"
    assert reasons[2].startswith(f"FULL decode graph #{h100.route(9, 9, 1).graph_id}")


# -- DP re-dispatch: allow=, pad_to=, ubatched= -----------------------------------------------------


@pytest.mark.parametrize("allow", [RuntimeMode.PIECEWISE, "PIECEWISE", 1])
def test_redispatch_restricted_to_piecewise_skips_full_graphs(h100, allow):
    r = h100.route(9, 9, 1, allow=allow)
    assert (r.mode, r.padded_tokens, r.padded_reqs, r.why) == (
        RuntimeMode.PIECEWISE,
        16,
        9,
        Why.PIECEWISE,
    )


@pytest.mark.parametrize("allow", [RuntimeMode.FULL, "FULL", 2])
def test_redispatch_restricted_to_full_runs_mixed_batches_eager(h100, allow):
    assert h100.route(9, 9, 1, allow=allow).mode is RuntimeMode.FULL
    r = h100.route(9, 2, 8, allow=allow)
    assert (r.mode, r.why, r.padded_tokens) == (RuntimeMode.NONE, Why.NOT_ALLOWED, 9)


def test_redispatch_restricted_to_none_is_eager(h100):
    r = h100.route(9, 9, 1, allow=RuntimeMode.NONE)
    assert (r.mode, r.graph_id, r.padded_tokens, r.why) == (
        RuntimeMode.NONE,
        -1,
        9,
        Why.NOT_ALLOWED,
    )


def test_redispatch_pads_to_the_agreed_token_count(h100):
    r = h100.route(5, 5, 1, allow="FULL", pad_to=20)
    assert (r.mode, r.padded_tokens, r.padded_reqs) == (RuntimeMode.FULL, 24, 24)
    r = h100.route(5, 5, 1, allow="NONE", pad_to=20)
    assert (r.mode, r.padded_tokens, r.padded_reqs) == (RuntimeMode.NONE, 20, 5)
    r = h100.route(5, 5, 1, pad_to=600)
    assert (r.mode, r.padded_tokens, r.why) == (RuntimeMode.NONE, 600, Why.TOO_BIG)


def test_redispatch_ubatched_finds_the_ubatched_graph_at_the_agreed_size():
    t = compile_plan(ROOT / "plans" / "deepseek-v3-dp8-dbo.yaml")
    r = t.route(40, 20, 2, allow="FULL", pad_to=60, ubatched=True)
    assert (r.mode, r.padded_tokens, r.padded_reqs, r.why, r.graph.num_ubatches) == (
        RuntimeMode.FULL,
        64,
        32,
        Why.FULL_UBATCHED,
        2,
    )
    r = t.route(40, 20, 2, allow="PIECEWISE", pad_to=60, ubatched=True)
    assert (r.mode, r.why) == (RuntimeMode.NONE, Why.NOT_ALLOWED)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"pad_to": 4}, r"pad_to=4 must be in num_tokens=5\.\.8192"),
        ({"pad_to": 8193}, r"pad_to=8193 must be in"),
        ({"allow": "FULL_DECODE"}, r"allow='FULL_DECODE' is not a runtime mode"),
        ({"allow": 7}, r"allow=7 is not a runtime mode"),
        ({"allow": [2]}, r"allow=\[2\] is not a runtime mode"),
    ],
)
def test_redispatch_arguments_outside_the_plan_are_batch_errors(h100, kwargs, match):
    with pytest.raises(BatchError, match=match):
        h100.route(5, 5, 1, **kwargs)


@pytest.mark.parametrize(
    "args,match",
    [
        ((0,), r"num_tokens=0 is outside 1\.\.8192"),
        ((-3,), r"num_tokens=-3 is outside"),
        ((8193,), r"num_tokens=8193 is outside 1\.\.8192 \(scheduler.max_num_batched_tokens\)"),
        ((8, 0), r"num_reqs=0 must be in 1\.\.min\(num_tokens=8, scheduler.max_num_seqs=256\)"),
        ((8, 9), r"num_reqs=9 must be in"),
        ((1000, 257), r"num_reqs=257 must be in"),
        ((8, 2, 0), r"max_query_len=0 is impossible for 8 tokens in 2 requests"),
        ((8, 2, 3), r"max_query_len=3 is impossible"),  # 2 requests of <= 3 tokens hold 6 < 8
        ((8, 2, 8), r"max_query_len=8 is impossible"),  # the other request needs >= 1 token
        ((8, None, 9), r"max_query_len=9 is impossible for 8 tokens"),
        ((8, 8, 1, -1), r"num_active_loras=-1 is outside 0\.\.0"),
    ],
)
def test_impossible_batches_are_batch_errors(h100, args, match):
    with pytest.raises(BatchError, match=match):
        h100.route(*args)


def test_batch_error_is_a_value_error_with_exit_code_1(h100):
    with pytest.raises(ValueError, match=r"num_tokens=0 is outside 1\.\."):
        h100.route(0)
    assert BatchError.exit_code == 1 and PlanError.exit_code == 2


def test_explain_hints_name_a_change_that_would_give_the_batch_a_graph():
    """A mixed batch in FULL_DECODE_ONLY runs eager at any size: raising the ceiling would not
    help, so the hint names the mode change instead; a uniform batch above the largest size is
    told to add sizes."""
    t = compile_plan(
        {
            "version": 1,
            "name": "fdo",
            "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
            "cudagraph": {"mode": "FULL_DECODE_ONLY", "attention_support": "UNIFORM_BATCH"},
        }
    )
    for n, r, q in ((600, 3, 300), (300, 3, 200)):
        last = t.route(n, r, q).reasons[-1]
        assert "ceiling" not in last and "FULL_AND_PIECEWISE" in last, last
    small = compile_plan(
        {
            "version": 1,
            "name": "s",
            "cudagraph": {
                "mode": "FULL",
                "attention_support": "ALWAYS",
                "capture_sizes": [1, 2, 4],
            },
        }
    )
    assert "add sizes up to 8" in small.route(8, 8, 1).reasons[-1]


# -- tensor parallelism: world = DP x TP --------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(1, 1024), tp=st.integers(1, 64))
def test_a_plan_compiles_exactly_when_dp_times_tp_is_at_most_1024_ranks(dp, tp):
    p = plan(
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 16},
        cudagraph={"capture_sizes": [1, 2, 4]},
        parallel={"data_parallel_size": dp, "tensor_parallel_size": tp},
    )
    if dp * tp <= 1024:
        s = compile_plan(p).settings
        assert (s.data_parallel_size, s.tensor_parallel_size) == (dp, tp)
    else:
        with pytest.raises(PlanError, match=rf"world-too-large.*{dp} x .*{tp} = {dp * tp} ranks"):
            compile_plan(p)


def test_tensor_parallelism_changes_no_graph_and_no_route():
    one = compile_(parallel={"tensor_parallel_size": 1})
    four = compile_(parallel={"tensor_parallel_size": 4})
    assert one.graphs == four.graphs and one.fingerprint != four.fingerprint

    def routes(t):
        return [
            (r.mode, r.graph_id, r.padded_tokens, r.padded_reqs)
            for r in map(t.route, range(1, 600, 7))
        ]

    assert routes(one) == routes(four)
