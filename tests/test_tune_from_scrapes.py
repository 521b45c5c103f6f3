"""Issue 35: the tuning loop on the path users take. A pasted engine config (an explicit list) is
tuned like a preset, keeping only the sizes the user pins; the engines of one deployment add up to
one workload; a plan sets the workload's limits; graphplan's own scrape is fine enough to tune from.

Fixtures (tests/data/metrics/README.md): ``vllm-chat-dp2.prom`` is a chat-like vLLM V1 scrape of
two data-parallel engines of one model; ``vllm-two-models.prom`` holds two models' series;
``sglang-dp2-tp2.prom`` two DP ranks of two TP ranks each.
"""

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from graphplan.compiler import compile_plan
from graphplan.compiler.cli import main
from graphplan.compiler.errors import GraphplanError
from graphplan.compiler.tools import prom_text
from graphplan.compiler.tools.metrics import Options, workload_from_scrapes
from graphplan.compiler.tools.optimize import OptimizeError, optimize
from graphplan.compiler.tools.trace import Trace, aggregate, load_trace, padding

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "metrics"
CHAT = DATA / "vllm-chat-dp2.prom"
M = "meta-llama/Llama-3.1-8B-Instruct"
VLLM_LIST = [1, 2, 4, 8, *range(16, 513, 16)]  # vLLM's default style: ..., 256, 272, ..., 512


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def work_of(*paths, **kw):
    return workload_from_scrapes([prom_text.read(str(p)) for p in paths], Options(**kw))


def imported_vllm(tmp_path, capsys, seqs=256) -> Path:
    plan = tmp_path / "vllm.yaml"
    cc = {"cudagraph_capture_sizes": VLLM_LIST, "cudagraph_mode": "FULL_AND_PIECEWISE"}
    code, _, err = cli(
        capsys,
        "import",
        "--engine",
        "vllm",
        "-o",
        plan,
        "--",
        "--max-num-seqs",
        seqs,
        "--compilation-config",
        json.dumps(cc),
    )
    assert code == 0, err
    return plan


# -- 1. optimize what the user pasted --------------------------------------------------------------
def test_import_workload_optimize_export_cuts_a_vllm_lists_padding_by_more_than_half(
    tmp_path, capsys
):
    plan, work, tuned = imported_vllm(tmp_path, capsys), tmp_path / "w.jsonl", tmp_path / "t.yaml"
    code, out, _ = cli(capsys, "workload", "--from-metrics", CHAT, "--plan", plan, "-o", work)
    assert code == 0 and "2 series added up" in out
    code, out, _ = cli(capsys, "optimize", plan, "--trace", work, "-o", tuned, "--format", "json")
    res = json.loads(out)
    assert code == 0 and res["before"]["sizes"] == VLLM_LIST
    assert res["after"]["graphs"] == res["before"]["graphs"] == 56  # the same graph count
    assert round(res["reduction_pct"], 1) == 63.6  # 4.762 -> 1.733 padded tokens per step
    assert res["kept"] == [] and res["notes"][0].startswith(
        "the plan lists its capture sizes explicitly (as an imported engine config does): they "
        "are tuned like a preset's"
    )
    code, flags, err = cli(capsys, "export", tuned)
    cc = json.loads(flags.split("--compilation-config ")[-1].strip().strip("'"))
    assert code == 0 and cc["cudagraph_capture_sizes"] == res["after"]["sizes"]
    assert "(-63.6 % padded tokens)" in err
    code, text, _ = cli(capsys, "optimize", plan, "--trace", work)
    assert "sizes before: 1 2 4 8 16-512/16\n" in text and "padded tokens: -63.6 %" in text
    assert "kept: no size is pinned: every size was chosen for the trace" in text


def test_only_pinned_sizes_of_an_explicit_list_are_kept_and_the_output_says_why(tmp_path, capsys):
    plan, work = imported_vllm(tmp_path, capsys), tmp_path / "w.jsonl"
    assert cli(capsys, "workload", "--from-metrics", CHAT, "--plan", plan, "-o", work)[0] == 0
    data = yaml.safe_load(plan.read_text())
    data["cudagraph"]["pinned_sizes"] = [48, 256]
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(yaml.safe_dump(data))
    tuned = tmp_path / "t.yaml"
    code, out, _ = cli(
        capsys, "optimize", pinned, "--trace", work, "--pin", 100, "-o", tuned, "--format", "json"
    )
    res = json.loads(out)
    assert code == 0 and {48, 100, 256} <= set(res["after"]["sizes"])
    assert res["kept"] == [
        {"size": 48, "why": "cudagraph.pinned_sizes"},
        {"size": 100, "why": "--pin"},
        {"size": 256, "why": "cudagraph.pinned_sizes"},
    ]
    assert yaml.safe_load(tuned.read_text())["cudagraph"]["pinned_sizes"] == [48, 256]
    assert "#   kept: 48 256 (cudagraph.pinned_sizes)" in tuned.read_text()
    text = cli(capsys, "optimize", pinned, "--trace", work, "--pin", 100)[1]
    assert "kept: 48 256 (cudagraph.pinned_sizes)\nkept: 100 (--pin)\n" in text


def test_a_pinned_size_off_the_list_is_a_warning_and_optimize_adds_it():
    plan = yaml.safe_load((ROOT / "plans" / "hf-mixed.yaml").read_text())
    plan["cudagraph"]["pinned_sizes"] = [3, 8]
    table = compile_plan(plan)
    (d,) = [d for d in table.diagnostics if d["code"] == "pinned-size-not-captured"]
    assert d["message"] == (
        "1 pinned size(s) are not capture sizes of this plan: [3]; plan optimize adds them to "
        "the list it writes"
    )
    work = aggregate(
        Trace(
            source="t",
            num_tokens=np.array([5, 40]),
            num_reqs=np.array([5, 40]),
            max_query_len=np.array([1, 1]),
            line=np.array([1, 2]),
        ),
        table.q,
    )
    res = optimize(table, work, len(table.graphs), pins={3: "cudagraph.pinned_sizes"})
    assert 3 in res.sizes and res.kept[0] == (3, "cudagraph.pinned_sizes")
    with pytest.raises(OptimizeError, match=r"^cudagraph.pinned_sizes: 4096: this plan's"):
        optimize(table, work, 99, pins={4096: "cudagraph.pinned_sizes"})


# -- 2. metrics of any deployment -----------------------------------------------------------------
def test_dp_engines_of_one_model_add_up_by_default_and_two_models_are_refused_by_name():
    w = work_of(CHAT)
    assert w.steps == 99540 and w.header["merged"] == 2
    assert w.header["series"] == [
        {"engine": "0", "model_name": M},
        {"engine": "1", "model_name": M},
    ]
    with pytest.raises(GraphplanError) as e:
        work_of(DATA / "vllm-two-models.prom")
    assert str(e.value) == (
        f"{DATA / 'vllm-two-models.prom'}: vllm:iteration_tokens_total series of 2 models: "
        f"'Qwen/Qwen2.5-7B-Instruct', '{M}'; a workload is one model's: keep one with "
        "--label model_name=NAME (or add them up with --merge)"
    )
    one = work_of(DATA / "vllm-two-models.prom", labels=(("model_name", M),))
    assert one.steps == 4978 and one.header["series"] == [{"engine": "0", "model_name": M}]
    assert work_of(DATA / "vllm-two-models.prom", merge=True).steps == 4978 + 4976


def test_sglang_dp_ranks_are_pooled_and_tp_ranks_read_once():
    w = work_of(DATA / "sglang-dp2-tp2.prom")
    assert w.rows == ((12, 12, 1, 1), (17, 17, 1, 1))
    assert w.header["merged"] == 2 and [s["tp_rank"] for s in w.header["series"]] == ["0", "0"]
    assert w.notes[0].startswith(
        "2 sglang:num_running_reqs series left out as replicas of another (tp_rank, pp_rank, "
        "moe_ep_rank differ only: the ranks of one engine report the same batches): sglang:"
        'num_running_reqs{dp_rank="0",'
    )
    assert "they differ in dp_rank" in w.notes[1]


def test_a_plan_given_to_workload_sets_its_seats_and_tokens(tmp_path, capsys):
    plan, work = imported_vllm(tmp_path, capsys, seqs=128), tmp_path / "w.jsonl"
    assert cli(capsys, "workload", "--from-metrics", CHAT, "-o", work)[0] == 0
    code, _, err = cli(capsys, "optimize", plan, "--trace", work)
    assert code == 1 and "exceeds scheduler.max_num_seqs=128 of plan vllm-import" in err
    assert "plan workload --from-metrics ... --plan PLAN (or --max-num-seqs 128 --max-tokens" in err
    code, out, _ = cli(capsys, "workload", "--from-metrics", CHAT, "--plan", plan, "-o", work)
    assert code == 0 and "note: from plan " in out and "max_num_seqs=128" in out
    assert f"next: plan optimize {plan} --trace" in out
    trace = load_trace(str(work))
    assert trace.header["max_num_seqs"] == 128 and trace.header["max_tokens"] == 8192
    assert trace.header["plan"] == str(plan) and int(trace.num_reqs.max()) == 128
    assert cli(capsys, "optimize", plan, "--trace", work)[0] == 0
    code, out, _ = cli(
        capsys, "workload", "--from-metrics", CHAT, "--plan", plan, "--max-num-seqs", 64
    )
    assert "max_num_batched_tokens=8192 (given flags win: max-num-seqs)" in out


def test_errors_name_the_scrape_they_are_about(tmp_path, capsys):
    gp = DATA / "graphplan.prom"
    with pytest.raises(GraphplanError) as e:
        work_of(CHAT, gp)
    assert str(e.value) == (
        f"{CHAT} holds vllm series; {gp} holds graphplan series: the scrapes of one workload "
        "come from one engine (give them separately)"
    )
    with pytest.raises(GraphplanError, match=f"^{gp}: no vllm series"):
        work_of(CHAT, gp, engine="vllm")
    both = tmp_path / "proxy.prom"
    both.write_text(CHAT.read_text() + gp.read_text())
    with pytest.raises(GraphplanError, match=f"^{both}: series of vllm and graphplan in this one"):
        work_of(both)


# -- graphplan's own server --------------------------------------------------------------------
def test_tuning_from_graphplans_own_scrape_removes_real_padding(tmp_path, capsys):
    from prometheus_client import CollectorRegistry, generate_latest

    from graphplan.server.core.iteration_metrics import IterationHistograms

    path = ROOT / "plans" / "hf-mixed.yaml"
    table = compile_plan(yaml.safe_load(path.read_text()))
    hist = IterationHistograms(table, table.max_num_seqs)
    rng, steps = random.Random(0), []
    for _ in range(3000):  # chat-like: decode batches of a few dozen, some prefill chunks
        reqs = max(1, min(64, int(rng.lognormvariate(2.8, 0.6))))
        if rng.random() < 0.2:
            chunk = int(rng.lognormvariate(5.0, 0.8)) + 1
            steps.append((reqs - 1 + chunk, reqs, chunk))
        else:
            steps.append((reqs, reqs, 1))
    for n, r, m in steps:
        hist.observe(SimpleNamespace(num_tokens=n, num_reqs=r, max_query_len=m), 1)
    registry = CollectorRegistry()
    registry.register(hist)
    scrape, work, tuned = tmp_path / "s.prom", tmp_path / "w.jsonl", tmp_path / "t.yaml"
    scrape.write_bytes(generate_latest(registry))
    assert cli(capsys, "workload", "--from-metrics", scrape, "--plan", path, "-o", work)[0] == 0
    code, out, _ = cli(capsys, "optimize", path, "--trace", work, "-o", tuned, "--format", "json")
    res = json.loads(out)
    assert code == 0 and res["after"]["graphs"] <= res["before"]["graphs"]
    assert res["reduction_pct"] > 40
    real = [(n, r, m) for n, r, m in steps if n <= table.max_tokens]
    exact = aggregate(
        Trace(
            source="real",
            num_tokens=np.array([s[0] for s in real]),
            num_reqs=np.array([s[1] for s in real]),
            max_query_len=np.array([s[2] for s in real]),
            line=np.arange(1, len(real) + 1),
        ),
        table.q,
    )
    before, after = (
        padding(table, exact),
        padding(compile_plan(yaml.safe_load(tuned.read_text())), exact),
    )
    assert after.padded_tokens < 0.6 * before.padded_tokens  # on the real steps, not the buckets
