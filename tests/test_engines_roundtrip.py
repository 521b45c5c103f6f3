"""Round trip (hypothesis): for random valid plans, ``import(export(plan))`` compiles to a
route-for-route identical table, for every engine and format that can express the plan (an
export with no lost-feature diagnostic). And the fidelity property: the exported vLLM EngineArgs,
read by vLLM's own rules (``vllm_rules``), give the table's capture sizes, mode and LoRA cases."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from graphplan.compiler import PlanError, compile_loaded, compile_plan, load_plan
from graphplan.compiler.engines import export_plan, import_plan
from graphplan.compiler.engines.vllm_rules import read_engine_args

MODES = [
    "FULL_AND_PIECEWISE",
    "FULL_DECODE_ONLY",
    "FULL_AND_PIECEWISE",
    "NONE",
    "PIECEWISE",
    "FULL",
]
SUPPORT = ["ALWAYS", "UNIFORM_BATCH", "UNIFORM_SINGLE_TOKEN_DECODE", "NEVER"]


@st.composite
def plans(draw, engine: str) -> dict:
    """Small plans (routes are compared exhaustively), weighted towards what ``engine`` can say."""
    q = draw(st.integers(1, 3))
    seqs = draw(st.integers(1, 48))
    tokens = draw(st.integers(max(seqs, q), 768))
    kind = draw(st.sampled_from(["vllm", "list", "sglang", "trtllm"]))
    sizes = (
        {"preset": "vllm", "ceiling": draw(st.integers(1, 512))}
        if kind == "vllm"
        else {"preset": kind, "max_size": draw(st.integers(0, 64))}
        if kind != "list"
        else draw(st.lists(st.integers(1, tokens + 32), min_size=1, max_size=24))
    )
    plan = {
        "version": 1,
        "name": "rt",
        "scheduler": {
            "max_num_seqs": seqs,
            "max_num_batched_tokens": tokens,
            "decode_query_len": q,
        },
        "cudagraph": {
            "mode": draw(st.sampled_from(MODES)),
            "attention_support": draw(st.sampled_from(SUPPORT)),
            "splitting_ops": draw(
                st.sampled_from([["attention"], [], ["attention", "all_reduce"]])
            ),
            "capture_sizes": sizes,
        },
    }
    if draw(st.integers(0, 2)) == 0:
        plan["lora"] = {
            "enabled": True,
            "max_loras": draw(st.integers(1, 4)),
            "specialize_count": engine == "vllm" and draw(st.booleans()),
            "separate_base": engine == "vllm" and draw(st.booleans()),
        }
    plan["parallel"] = {}
    if draw(st.integers(0, 2)) == 0:
        plan["parallel"]["data_parallel_size"] = draw(st.integers(2, 8))
    if draw(st.integers(0, 2)) == 0:
        plan["parallel"]["tensor_parallel_size"] = draw(st.sampled_from([2, 4, 8]))
    if plan["parallel"].get("data_parallel_size", 1) > 1:
        if engine == "vllm" and draw(st.booleans()):
            plan["parallel"]["ubatch"] = {
                "enabled": True,
                "plain_twins": False,
                "decode_token_threshold": draw(st.integers(2, 64)),
                "prefill_token_threshold": draw(st.integers(2, 512)),
            }
    return plan


def signature(table, plan: dict) -> list:
    """The ranks (DP, TP), every graph, and the route of every mixed and uniform-decode batch for
    every LoRA count."""
    r = table.settings
    out: list = [(r.data_parallel_size, r.tensor_parallel_size)]
    out.append(tuple((g.mode, g.key) for g in table.graphs))
    lora = plan.get("lora", {})
    for n_lora in range(lora.get("max_loras", 4) + 2 if lora.get("enabled") else 1):
        for n in range(1, table.max_tokens + 1):
            r = table.route(n, num_active_loras=n_lora)
            out.append((r.mode, r.graph_id >= 0 and r.graph, r.padded_tokens, r.padded_reqs))
        for reqs in range(1, min(table.max_num_seqs, table.max_tokens // table.q) + 1):
            r = table.route(reqs * table.q, reqs, table.q, n_lora)
            out.append((r.mode, r.graph_id >= 0 and r.graph, r.padded_tokens, r.padded_reqs))
    return out


def compiled(plan: dict):
    try:
        loaded = load_plan(plan)
        return loaded, compile_loaded(loaded)[0]
    except PlanError as e:  # rule errors a random plan may hit
        assert {d.code for d in e.diagnostics} <= {"full-attention-never", "no-sizes"}, str(e)
        assume(False)


def reimport(loaded, table, engine: str, fmt: str, tmp_path):
    out = export_plan(loaded, table.capture_sizes, engine, fmt)
    assume(not out.lost)
    sets = {"cudagraph.attention_support": loaded.spec.cudagraph.attention_support.name}
    if fmt == "args":
        words = [
            w
            for line in out.text.splitlines()
            if not line.startswith("#")
            for w in shlex.split(line)
        ]
        return import_plan(engine, args=words, sets=sets)
    path = tmp_path / f"exported.{fmt}"
    path.write_text(out.text)
    return import_plan(engine, config=str(path), sets=sets)


FORMATS = [
    ("vllm", "args"),
    ("vllm", "yaml"),
    ("vllm", "json"),
    ("sglang", "args"),
    ("sglang", "json"),
    ("trtllm", "yaml"),
    ("trtllm", "json"),
]


@pytest.mark.parametrize("engine,fmt", FORMATS)
def test_import_of_export_routes_every_batch_like_the_plan(engine, fmt, tmp_path_factory):
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(plan=plans(engine))
    def check(plan):
        loaded, table = compiled(plan)
        back = reimport(loaded, table, engine, fmt, tmp_path_factory.mktemp("rt"))
        assert signature(compile_plan(back.plan), plan) == signature(table, plan)

    check()


def _resolved(table) -> tuple:
    """What a table resolved to, as plain values."""
    r = table.settings
    return r.mode.name, tuple(r.capture_sizes), tuple(r.lora_cases)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=plans("vllm"))
def test_vllm_reads_the_exported_engine_args_as_graphplan_compiled_them(plan):
    loaded, table = compiled(plan)
    out = export_plan(loaded, table.capture_sizes, "vllm", "json")
    assume(not out.lost)
    mode, sizes, cases = _resolved(table)
    run = read_engine_args(out.config, loaded.spec.cudagraph.attention_support.name)
    if not sizes:  # nothing captured: vLLM runs eager (--enforce-eager), LoRA cases are moot
        assert (run.mode, run.sizes) == ("NONE", ())
    else:
        assert (run.mode, run.sizes, run.lora_cases) == (mode, sizes, cases)
