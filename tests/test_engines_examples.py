"""Every shipped example, both ways, for every engine and format (docs/engines.md).

- plan -> engine -> plan: each plan in ``plans/`` exported and imported back keeps every
  graph-relevant field exactly, except the fields an export diagnostic names as lost.
- engine -> plan -> engine: each engine input in ``tests/data/engines/`` imported, exported and
  imported again gives the same plan facts, and the second export is the first, byte for byte.

Graph-relevant: the scheduler limits and q, the resolved mode, capture sizes and splitting ops, the
LoRA fields and cases, DP size, micro-batching, and the graphs themselves. Not carried (engines read
them elsewhere; docs/engines.md): ``attention_support`` (the attention backend), ``strict``, the
plan's name; and with no graphs at all (mode NONE) the unused sizes and splitting ops.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from graphplan.compiler import compile_loaded, load_plan
from graphplan.compiler.engines import export_plan, import_plan

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "engines"
FORMATS = {"vllm": ("args", "yaml", "json"), "sglang": ("args", "json"), "trtllm": ("yaml", "json")}
PLANS = sorted(p.name for p in (ROOT / "plans").iterdir() if p.suffix in (".yaml", ".j2"))
TEMPLATE_SETS = {"sweep.yaml.j2": {"max_num_seqs": 128, "spec_tokens": 2}}
# engine inputs that are refused on purpose (a located error each: tests/test_engines.py, and
# tests/test_engines_inputs.py for 20059, whose flag and numeric cudagraph_mode no supported vLLM
# release takes)
REFUSED = {"trtllm-5795-old-padding.yaml", "vllm-29955-truncated.log", "vllm-20059.args"}
INPUTS = sorted(p.name for p in DATA.iterdir() if p.name not in REFUSED)
VERSION = {"vllm-36370.args": "0.15"}  # per-count LoRA graphs need vLLM 0.15
# a lost feature (its diagnostic's path) exempts the facts it changes
EXEMPT = {
    "cudagraph": {"mode", "capture_sizes", "splitting_ops", "graphs"},
    "lora": {"lora", "lora_cases", "graphs"},
    "parallel": {"ubatch", "graphs"},
}


def facts(loaded) -> dict:
    """The graph-relevant facts of a loaded plan, compiled."""
    table, _ = compile_loaded(loaded)
    spec, r = loaded.spec, table.settings
    s, lora, par = spec.scheduler, spec.lora, spec.parallel
    graphs = r.mode.name != "NONE"
    return {
        "scheduler": (s.max_num_seqs, s.max_num_batched_tokens, s.decode_query_len),
        "mode": r.mode.name,
        "capture_sizes": tuple(r.capture_sizes) if graphs else (),
        "splitting_ops": tuple(r.splitting_ops) if "PIECEWISE" in r.mode.name else (),
        "lora": (lora.enabled, lora.max_loras, lora.specialize_count, lora.separate_base)
        if lora.enabled
        else (False,),
        "lora_cases": tuple(r.lora_cases),
        "data_parallel_size": par.data_parallel_size,
        "ubatch": (
            par.ubatch.num_ubatches,
            par.ubatch.decode_token_threshold,
            par.ubatch.prefill_token_threshold,
            par.ubatch.plain_twins,
        )
        if par.ubatch.enabled
        else (False,),
        "graphs": tuple((g.mode.name, g.key) for g in table.graphs),
    }


def reimport(text: str, engine: str, fmt: str, version, tmp_path, sets=None):
    if fmt == "args":
        words = [w for ln in text.splitlines() if not ln.startswith("#") for w in shlex.split(ln)]
        return import_plan(engine, args=words, version=version, sets=sets)
    path = tmp_path / f"exported.{fmt}"
    path.write_text(text)
    return import_plan(engine, config=str(path), version=version, sets=sets)


def exported(loaded, engine: str, fmt: str, version=None):
    table, _ = compile_loaded(loaded)
    return export_plan(loaded, table.capture_sizes, engine, fmt, version)


@pytest.mark.parametrize(
    "engine,version", [("vllm", "0.11"), ("vllm", "0.15"), ("sglang", None), ("trtllm", None)]
)
@pytest.mark.parametrize("name", PLANS)
def test_every_plan_exported_and_imported_back_keeps_its_graph_facts(
    name, engine, version, tmp_path
):
    loaded = load_plan(ROOT / "plans" / name, TEMPLATE_SETS.get(name))
    loaded = load_plan({**loaded.plan, "cudagraph": {**loaded.plan["cudagraph"], "strict": False}})
    want = facts(loaded)
    support = {"cudagraph.attention_support": loaded.spec.cudagraph.attention_support.name}
    for fmt in FORMATS[engine]:
        out = exported(loaded, engine, fmt, version)
        back = reimport(out.text, engine, fmt, version, tmp_path, support)
        got = facts(load_plan(back.plan))
        exempt = {f for d in out.lost for f in EXEMPT[d.path.split(".")[0]]}
        differ = {k for k in want if want[k] != got[k]} - exempt
        assert not differ, (fmt, {k: (want[k], got[k]) for k in differ}, out.lost)


@pytest.mark.parametrize("name", INPUTS)
def test_every_engine_input_imported_exported_and_imported_again_is_a_fixed_point(name, tmp_path):
    engine = name.split("-")[0]
    version = VERSION.get(name)
    path = DATA / name
    source = (
        {"args": path.read_text()}
        if path.suffix in (".args", ".sh")
        else {"log": str(path)}
        if path.suffix == ".log"
        else {"config": str(path)}
    )
    first = load_plan(import_plan(engine, version=version, **source).plan)
    for fmt in FORMATS[engine]:
        out = exported(first, engine, fmt, version)
        assert not out.lost, (fmt, out.lost)  # an imported plan is one the engine can say
        second = load_plan(reimport(out.text, engine, fmt, version, tmp_path).plan)
        assert facts(second) == facts(first), fmt
        assert exported(second, engine, fmt, version).text == out.text, fmt


def test_an_eager_vllm_plan_with_lora_keeps_cudagraph_specialize_lora(tmp_path):
    args = ["--enforce-eager", "--enable-lora", "--max-loras", "4"]
    args += ["--compilation-config", '{"cudagraph_specialize_lora": false}']
    first = load_plan(import_plan("vllm", args=args).plan)
    assert first.spec.lora.separate_base is False
    for fmt in FORMATS["vllm"]:
        out = exported(first, "vllm", fmt)
        assert out.config["compilation_config"] == {"cudagraph_specialize_lora": False}
        back = reimport(out.text, "vllm", fmt, None, tmp_path)
        assert back.plan["lora"]["separate_base"] is False, fmt
