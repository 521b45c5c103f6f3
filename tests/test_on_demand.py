"""Capture on demand (cudagraph.on_demand) on the CPU stand-in: the start set, first use eager
then replay, one capture per step, failures that stay eager, metrics, the plan option, healthz."""

import pytest
import torch
from test_runtime import CFG, decode_batch, plan, runner_for

from graphplan.compiler import compile_plan
from graphplan.models.tiny_llama import TinyLlama
from graphplan.runtime import render_prometheus
from graphplan.runtime.on_demand import start_graph_ids


def od_plan(mode="FULL_AND_PIECEWISE", start=(), **kw):
    p = plan(mode, **kw)
    p["cudagraph"]["on_demand"] = {"enabled": True, "start_sizes": list(start)}
    return p


def sizes_of(runner, ids):
    return sorted(
        (runner.table.graphs[g].mode.name, runner.table.graphs[g].key.num_tokens) for g in ids
    )


def check_step(model, runner, ref, n):
    batch = decode_batch(model, n, seed=n)
    out = runner.step(batch, num_reqs=n, max_query_len=1)
    torch.testing.assert_close(
        out, ref(**{k: v.clone() for k, v in batch.items()}), rtol=1e-5, atol=1e-5
    )


def test_the_plan_option_resolves_start_sizes_to_capture_sizes_with_the_largest():
    t = compile_plan(od_plan(start=[3, 2, 40]))  # 3 pads to 4; 40 is above the largest (16)
    assert t.settings.on_demand and t.settings.start_sizes == (2, 4, 16)
    assert any(d["code"] == "start-size-dropped" for d in t.diagnostics)
    off = compile_plan(plan("FULL_AND_PIECEWISE"))
    assert not off.settings.on_demand and off.settings.start_sizes == ()


def test_on_demand_leaves_routes_and_graphs_unchanged_and_the_table_round_trips():
    on, off = compile_plan(od_plan(start=[2])), compile_plan(plan("FULL_AND_PIECEWISE"))
    assert on.graphs == off.graphs
    assert all((on.routes[r] == off.routes[r]).all() for r in on.routes)
    import json

    from graphplan.compiler.table import DispatchTable

    assert DispatchTable.from_json(json.loads(on.dumps())).settings == on.settings


def test_only_the_start_set_is_captured_at_start_largest_of_each_routine_first():
    _, runner = runner_for(od_plan(start=[2]))
    summary = runner.capture()
    ids = runner.captured_graph_ids()
    assert sizes_of(runner, ids) == [("FULL", 2), ("FULL", 8), ("PIECEWISE", 2), ("PIECEWISE", 16)]
    assert summary["graphs"] == 4 and set(ids) == start_graph_ids(runner.table)
    assert summary["per_graph"][0][1] == 16  # the largest graph was captured first
    od = runner.stats()["on_demand"]
    assert od["captured_at_start"] == 4 and od["not_captured"] == 5 and od["pending"] == 0


def test_an_uncaptured_size_runs_eager_once_then_replays_and_outputs_equal_eager():
    model, runner = runner_for(od_plan("FULL"))
    runner.capture()
    ref = TinyLlama(CFG, seed=0)
    check_step(model, runner, ref, 3)  # pads to 4: not captured yet
    assert runner.stats()["eager_steps"] == {"not_captured_yet": 1}
    assert runner.stats()["on_demand"]["pending"] == 1
    check_step(model, runner, ref, 3)  # captured before this step, then replayed
    s = runner.stats()
    assert s["eager_steps"] == {"not_captured_yet": 1} and s["replays"] == 1
    assert s["on_demand"]["captured_on_demand"] == 1 and s["on_demand"]["pending"] == 0
    assert s["graphs"][0]["num_tokens"] == 4


def test_at_most_one_graph_is_captured_per_step_and_outputs_equal_eager_throughout():
    model, runner = runner_for(od_plan("FULL"))
    runner.capture()
    ref = TinyLlama(CFG, seed=0)
    before = len(runner.captured_graph_ids())
    for n in (1, 2, 3, 5, 1, 2, 3, 5, 7, 1):  # four uncaptured sizes first seen back to back
        check_step(model, runner, ref, n)
        now = len(runner.captured_graph_ids())
        assert now - before <= 1
        before = now
    s = runner.stats()
    assert s["eager_steps"] == {"not_captured_yet": 4}  # sizes 1, 2, 4 and 8 once each
    assert s["on_demand"]["captured_on_demand"] == 4 and s["on_demand"]["not_captured"] == 0


class FailsAt:
    """The tiny Llama, failing on a batch of ``tokens`` rows (where a graph of that size would be
    captured) once ``armed``."""

    def __init__(self, model, tokens):
        self.model, self.tokens, self.armed = model, tokens, False

    def __call__(self, **kw):
        if self.armed and kw["input_ids"].shape[0] == self.tokens:
            raise RuntimeError("operation not permitted when stream is capturing")
        return self.model(**kw)


def test_a_failed_on_demand_capture_leaves_that_graph_eager_for_good_and_the_rest_serving(caplog):
    tiny = TinyLlama(CFG, seed=0)
    wrapped = FailsAt(tiny, 4)
    from graphplan.models.tiny_llama import static_inputs
    from graphplan.runtime import GraphRunner

    runner = GraphRunner(
        wrapped, compile_plan(od_plan("FULL", start=[8])), static_inputs(tiny), progress=False
    )
    runner.capture()
    wrapped.armed = True
    ref = TinyLlama(CFG, seed=0)
    check_step(tiny, runner, ref, 3)  # eager on 3 rows; the 4-token graph is queued
    with caplog.at_level("WARNING", logger="graphplan.runtime"):
        check_step(tiny, runner, ref, 8)  # the capture fails before this step; 8 replays
    assert "runs eager from now on" in caplog.text
    check_step(tiny, runner, ref, 3)
    s = runner.stats()
    assert s["eager_steps"] == {"not_captured_yet": 1, "capture_failed": 1}
    assert s["replays"] == 1 and list(s["on_demand"]["eager_forever"].values()) == [
        "RuntimeError: operation not permitted when stream is capturing"
    ]
    assert "graphplan_graphs_eager_forever 1" in render_prometheus(s)


def test_metrics_count_graphs_captured_at_start_on_demand_and_waiting():
    model, runner = runner_for(od_plan("FULL"))
    runner.capture()
    check_step(model, runner, TinyLlama(CFG, seed=0), 1)
    text = render_prometheus(runner.stats())
    assert 'graphplan_graphs_captured{when="start"} 1' in text
    assert 'graphplan_graphs_captured{when="on_demand"} 0' in text
    assert "graphplan_graphs_pending 1" in text
    assert 'graphplan_eager_steps_total{reason="not_captured_yet"} 1' in text


def test_the_runner_argument_overrides_the_table_setting():
    _, runner = runner_for(od_plan("FULL"), on_demand=False)
    assert runner.capture()["graphs"] == 5 and "on_demand" not in runner.stats()
    _, runner = runner_for(plan("FULL"), on_demand=True)
    assert runner.capture()["graphs"] == 1


@pytest.mark.parametrize("by", ["plan", "flag"])
def test_the_server_is_ready_after_the_start_set_and_captures_on_first_use(tmp_path, by):
    from test_server import SPEC, plan_text, request

    from graphplan.server import Server

    p = tmp_path / "plan.yaml"
    text = plan_text()
    if by == "plan":
        text = text.replace(
            "capture_sizes: [1, 2, 4, 8]", "capture_sizes: [1, 2, 4, 8], on_demand: {enabled: true}"
        )
    p.write_text(text)
    s = Server(p, spec=SPEC, progress=False, on_demand=True if by == "flag" else None).start()
    try:
        assert s.wait_ready(30)
        status, body = request(s, "GET", "/healthz")
        assert status == 200
        assert s.engine.runner.stats()["on_demand"]["captured_at_start"] == 2  # 8: FULL, PIECEWISE
        status, body = request(s, "POST", "/generate", {"prompt": [1, 2], "max_tokens": 3})
        assert status == 200 and len(body["tokens"]) == 3
        od = s.engine.runner.stats()["on_demand"]
        assert od["captured_on_demand"] >= 1
    finally:
        s.stop()


def test_plan_optimize_start_graphs_writes_the_k_most_used_sizes_and_the_largest(tmp_path, capsys):
    import json
    from pathlib import Path

    from graphplan.compiler.cli import main
    from graphplan.compiler.tools.optimize import rank_start_sizes
    from graphplan.compiler.tools.trace import aggregate, load_trace, padding

    root = Path(__file__).resolve().parents[1]
    plan_path, trace = (
        root / "plans" / "llama3-8b-h100.yaml",
        root / "bench" / "traces" / "chat.jsonl",
    )
    out = tmp_path / "tuned.yaml"
    assert (
        main(
            [
                "optimize",
                str(plan_path),
                "--trace",
                str(trace),
                "--start-graphs",
                "3",
                "-o",
                str(out),
                "--format",
                "json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    t = compile_plan(out)
    assert t.settings.on_demand and list(t.settings.start_sizes) == report["start_sizes"]
    assert t.capture_sizes[-1] in t.settings.start_sizes and len(t.settings.start_sizes) <= 4
    used = padding(t, aggregate(load_trace(trace), t.q)).by_size
    top3 = sorted(used, key=lambda s: (-used[s][0], -s))[:3]
    assert set(top3) <= set(t.settings.start_sizes)
    assert rank_start_sizes(padding(t, aggregate(load_trace(trace), t.q)), t.capture_sizes, 0) == (
        t.capture_sizes[-1],
    )
