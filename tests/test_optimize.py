"""plan optimize: the exact DP (against brute force), the rules it keeps, traces, the CLI."""

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphplan.compiler import DispatchTable, RuntimeMode, compile_plan
from graphplan.compiler.cli import main
from graphplan.compiler.load import load_plan
from graphplan.compiler.resolve import resolve
from graphplan.compiler.spec import CaptureSizesSpec
from graphplan.compiler.tools.memory import FORMAT, MIB, estimate, save_profile
from graphplan.compiler.tools.optimize import OptimizeError, optimize
from graphplan.compiler.tools.size_dp import solve
from graphplan.compiler.tools.trace import (
    Trace,
    TraceError,
    aggregate,
    check_trace,
    load_trace,
    step_route,
)

ROOT = Path(__file__).resolve().parents[1]
PLANS, TRACES = ROOT / "plans", ROOT / "bench" / "traces"
H100 = PLANS / "llama3-8b-h100.yaml"


# -- the DP core against brute force ------------------------------------------------------------
@st.composite
def dp_problems(draw):
    d = draw(st.integers(1, 8))
    sizes = sorted(draw(st.sets(st.integers(1, 40), min_size=d, max_size=d)))
    steps = draw(st.lists(st.integers(1, sizes[-1]), max_size=25))
    weight = draw(st.lists(st.integers(1, 3), min_size=d, max_size=d))
    pins = draw(st.sets(st.integers(1, d - 1), max_size=3)) if d > 1 else set()
    return sizes, steps, weight, pins, draw(st.integers(1, 14))


@settings(max_examples=300, deadline=None)
@given(dp_problems())
def test_dp_optimum_equals_brute_force_over_every_subset(problem):
    sizes, steps, weight, pins, budget = problem
    c = np.array([0] + sizes)
    at = np.searchsorted(c, steps)
    W = np.cumsum(np.bincount(at, minlength=len(c)))
    S = np.cumsum(np.bincount(at, weights=steps, minlength=len(c))).astype(np.int64)
    lo = [0] + [max([p for p in pins if p < j], default=0) for j in range(1, len(c))]
    best = None
    for r in range(len(sizes)):
        for sub in itertools.combinations(range(1, len(sizes)), r):
            chosen = sorted(set(sub) | {len(sizes)})
            units = sum(weight[j - 1] for j in chosen)
            if not pins <= set(chosen) or units > budget:
                continue
            picked = c[chosen]
            cost = sum(int(picked[np.searchsorted(picked, n)] - n) for n in steps)
            best = min(best or (cost, units), (cost, units))
    for dense in (False, True):
        got = solve(sizes, weight, lo, W, S, budget, dense=dense)
        assert (got[:2] if got else None) == best
        if got:
            assert pins <= set(got[2]) and got[2][-1] == len(sizes)


# -- the whole optimizer against brute force over every legal size set -------------------------
def small_plan(**kw):
    base = {
        "version": 1,
        "name": "small",
        "scheduler": {"max_num_seqs": 6, "max_num_batched_tokens": 12, "decode_query_len": 1},
        "cudagraph": {
            "mode": "FULL_AND_PIECEWISE",
            "attention_support": "ALWAYS",
            "capture_sizes": [1, 2, 4, 8, 12],
        },
    }
    for key, value in kw.items():
        section, _, field = key.partition("__")
        base.setdefault(section, {})[field] = value
    return base


DBO = {
    "enabled": True,
    "decode_token_threshold": 6,
    "prefill_token_threshold": 8,
    "plain_twins": False,
}
CONFIGS = {
    "full-and-piecewise": small_plan(),
    "piecewise": small_plan(cudagraph__mode="PIECEWISE", cudagraph__attention_support="NEVER"),
    "full": small_plan(cudagraph__mode="FULL"),
    "full-decode-only-q2": small_plan(
        scheduler__decode_query_len=2,
        scheduler__max_num_seqs=4,
        scheduler__max_num_batched_tokens=20,
        cudagraph__mode="FULL_DECODE_ONLY",
        cudagraph__attention_support="UNIFORM_BATCH",
        cudagraph__splitting_ops=[],
        cudagraph__capture_sizes=[2, 4, 8, 20],
    ),
    "dbo-no-twins-q2": small_plan(
        scheduler__decode_query_len=2,
        scheduler__max_num_batched_tokens=20,
        cudagraph__attention_support="UNIFORM_BATCH",
        cudagraph__capture_sizes=[2, 4, 8, 12, 20],
        parallel__data_parallel_size=2,
        parallel__ubatch=DBO,
    ),
    "decode-only-dbo": small_plan(
        cudagraph__mode="FULL_DECODE_ONLY",
        cudagraph__splitting_ops=[],
        parallel__data_parallel_size=2,
        parallel__ubatch={**DBO, "decode_token_threshold": 4},
    ),
    "lora": small_plan(lora__enabled=True, lora__max_loras=2),
}


def table_with(loaded, sizes):
    cg = replace(
        loaded.spec.cudagraph,
        strict=False,
        capture_sizes=CaptureSizesSpec(kind="list", sizes=tuple(sizes)),
    )
    return DispatchTable(**resolve(replace(loaded.spec, cudagraph=cg), loaded.plan)[0])


def brute_force(plan, steps, max_graphs, pins, top):
    """min (padded tokens, graphs) over every set of legal sizes <= top holding top and the pins,
    where each step at or below top must get the strongest mode any legal size >= it gives."""
    loaded = load_plan(plan)
    ref = table_with(loaded, [top])
    q = ref.q
    step = q if ref.settings.decode_mode.name == "FULL" and q > 1 else 1
    legal = list(range(step, top + 1, step))
    every = table_with(loaded, legal)
    kept = [s for s in steps if s[0] <= top]
    need = [
        max(int(step_route(every, n, r, m, pad_to=s).mode) for s in legal if s >= n)
        for n, r, m in kept
    ]
    free = [s for s in legal if s != top and s not in pins]
    best = None
    for mask in range(1 << len(free)):
        sizes = sorted({top, *pins, *(s for i, s in enumerate(free) if mask >> i & 1)})
        t = table_with(loaded, sizes)
        if len(t.graphs) > max_graphs:
            continue
        cost = 0
        for (n, r, m), want in zip(kept, need):
            route = step_route(t, n, r, m)
            if int(route.mode) < want:
                break
            cost += route.padded_tokens - n if route.mode != "NONE" else 0
        else:
            best = min(best or (cost, len(t.graphs)), (cost, len(t.graphs)))
    return best


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(CONFIGS)))
    plan = CONFIGS[name]
    table = compile_plan(plan)
    q, seqs, limit = table.q, table.max_num_seqs, table.max_tokens
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            r = draw(st.integers(1, min(seqs, limit // q)))
            steps.append((q * r, r, q))
        else:
            n = draw(st.integers(1, limit))
            r = draw(st.integers(1, min(n, seqs)))
            steps.append((n, r, draw(st.integers(-(-n // r), n - r + 1))))
    step = q if table.settings.decode_mode.name == "FULL" and q > 1 else 1
    top = draw(st.sampled_from([s for s in range(step, limit + 1, step) if s // step <= 10]))
    pins = draw(st.sets(st.sampled_from(range(step, top + 1, step)), max_size=2))
    cases_ = len(table.settings.lora_cases)  # every size costs graphs per LoRA case
    budget = draw(st.integers(1, 10)) * cases_ + draw(st.integers(0, cases_ - 1))
    return name, plan, table, steps, top, sorted(pins), budget


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_optimizer_equals_brute_force_over_every_legal_size_set(case):
    name, plan, table, steps, top, pins, max_graphs = case
    n, r, m = (np.array(x, dtype=np.int64) for x in zip(*steps))
    work = aggregate(
        Trace(source="t", num_tokens=n, num_reqs=r, max_query_len=m, line=np.arange(1, len(n) + 1)),
        table.q,
    )
    if table.settings.mixed_mode.name == "NONE":  # the optimizer stops at q * max_num_seqs
        top = min(top, table.q * table.max_num_seqs)
        pins = [p for p in pins if p <= top]
    expected = brute_force(plan, steps, max_graphs, pins, top)
    try:
        res = optimize(table, work, max_graphs, pins=pins, max_size=top)
    except OptimizeError:
        assert expected is None, name
        return
    assert (res.padded_tokens, res.graphs) == expected, name
    assert res.after.padded_tokens == res.padded_tokens
    assert set(pins) <= set(res.sizes) and res.sizes[-1] == top


# -- rules the result keeps ---------------------------------------------------------------------
def work_of(table, path):
    trace = load_trace(path)
    check_trace(trace, table)
    return aggregate(trace, table.q)


def test_same_graph_count_as_vllm_cuts_chat_padding_and_keeps_coverage():
    table = compile_plan(H100)
    res = optimize(table, work_of(table, TRACES / "chat.jsonl"), len(table.graphs))
    assert res.graphs <= len(table.graphs) and res.sizes[-1] == table.capture_sizes[-1]
    assert res.after.padded_tokens <= 0.7 * res.before.padded_tokens
    assert res.after.eager_steps == res.before.eager_steps
    assert (
        res.after.routines["decode"]["graphed_steps"]
        == res.before.routines["decode"]["graphed_steps"]
    )
    assert all(g.key.num_tokens in res.sizes for g in res.table.graphs)


def test_decode_steps_that_had_full_graphs_keep_full_graphs():
    table = compile_plan(H100)  # sizes <= 256 cost 2 graphs (FULL decode + PIECEWISE), above 1
    n = np.array([250, 250, 10, 300])
    trace = Trace(
        source="t",
        num_tokens=n,
        num_reqs=np.array([250, 250, 1, 2]),
        max_query_len=np.array([1, 1, 10, 299]),
        line=np.arange(1, 5),
    )
    work = aggregate(trace, 1)
    # 5 graphs: the decode steps need a FULL size in 250..256; 300 then pads to 512 (212 tokens)
    # rather than 10 padding to 250 (240 tokens); 257 (1 graph) would push decode to PIECEWISE
    res = optimize(table, work, 5)
    assert (res.sizes, res.padded_tokens, res.graphs) == ((10, 250, 512), 212, 5)
    assert res.table.route(250, 250, 1).mode is RuntimeMode.FULL
    assert optimize(table, work, 6).sizes == (10, 250, 300, 512)
    assert optimize(table, work, 4).sizes == (250, 300, 512)


def test_sizes_of_an_explicit_list_and_pins_are_kept(tmp_path):
    plan = small_plan(
        scheduler__max_num_seqs=64,
        scheduler__max_num_batched_tokens=512,
        cudagraph__capture_sizes=[3, 100, 512],
    )
    table = compile_plan(plan)
    trace = Trace(
        source="t",
        num_tokens=np.arange(1, 300),
        num_reqs=np.ones(299, dtype=np.int64),
        max_query_len=np.arange(1, 300),
        line=np.arange(1, 300),
    )
    res = optimize(table, aggregate(trace, 1), 12, pins=[3, 100, 512, 7])
    assert {3, 7, 100, 512} <= set(res.sizes) and res.graphs <= 12


def test_memory_budget_is_respected_and_lowers_the_graph_count():
    table = compile_plan(H100)
    work = work_of(table, TRACES / "chat.jsonl")
    prof = {
        "format": FORMAT,
        "version": 1,
        "model_fingerprint": "m",
        "device": "d",
        "per_graph_bytes": 2 * MIB,
        "per_token_bytes": 64 * 1024,
        "samples": [],
    }
    res = optimize(table, work, 86, memory_budget=100 * MIB, profile=prof)
    assert estimate(res.table, prof)["total_bytes"] <= 100 * MIB
    assert res.budget_graphs == (100 * MIB - 512 * 64 * 1024) // (2 * MIB) == 34
    assert res.graphs <= 34
    with pytest.raises(OptimizeError, match="activations of a 512-token graph alone"):
        optimize(table, work, 86, memory_budget=10 * MIB, profile=prof)


def test_a_graph_budget_below_the_minimum_is_an_error_naming_the_minimum():
    table = compile_plan(H100)
    with pytest.raises(OptimizeError, match="allows 2 graphs.*need at least 3 "):
        optimize(table, work_of(table, TRACES / "chat.jsonl"), 2)  # 512 alone: decode not FULL


def test_speculative_decoding_sizes_are_multiples_of_q_and_the_strict_plan_compiles(tmp_path):
    table = compile_plan(PLANS / "llama3-8b-eagle3.yaml")
    rng = np.random.default_rng(0)
    r = rng.integers(1, 129, 500)
    mixed = rng.integers(1, 2000, 100)
    n = np.concatenate((3 * r, mixed))
    reqs = np.concatenate((r, np.ones(100, dtype=np.int64)))
    trace = Trace(
        source="t",
        num_tokens=n,
        num_reqs=reqs,
        max_query_len=np.concatenate((np.full(500, 3), mixed)),
        line=np.arange(1, 601),
    )
    res = optimize(table, aggregate(trace, 3), len(table.graphs))
    assert all(s % 3 == 0 for s in res.sizes)
    assert res.after.padded_tokens < res.before.padded_tokens
    with pytest.raises(OptimizeError, match="multiples of decode_query_len=3"):
        optimize(table, aggregate(trace, 3), len(table.graphs), pins=[4])


def test_a_plan_without_graphs_has_nothing_to_optimize():
    table = compile_plan(PLANS / "eager.yaml")
    trace = Trace(
        source="t",
        num_tokens=np.array([4]),
        num_reqs=np.array([4]),
        max_query_len=np.array([1]),
        line=np.array([1]),
    )
    with pytest.raises(OptimizeError, match="mode NONE"):
        optimize(table, aggregate(trace, 1), 10)


# -- traces --------------------------------------------------------------------------------------
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(1, 10**6), st.integers(1, 999), st.integers(1, 999)),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from([(", ", ": "), (",", ":")]),
    st.booleans(),
    st.integers(0, 3),
)
def test_fast_and_json_parsing_read_the_same_steps_and_lines(tmp_path, rows, seps, trailing, blank):
    lines = [
        json.dumps(dict(zip(("num_tokens", "num_reqs", "max_query_len"), row)), separators=seps)
        for row in rows
    ]
    if blank:
        lines.insert(min(blank, len(lines)), "")
    text = "\n".join(lines) + ("\n" if trailing else "")
    fast, slow = tmp_path / "fast.jsonl", tmp_path / "slow.jsonl"
    fast.write_text(text)
    slow.write_text(text.replace('{"num_tokens"', '{ "num_tokens"'))  # not canonical: JSON path
    a, b = load_trace(fast), load_trace(slow)
    assert a.num_tokens.tolist() == b.num_tokens.tolist() == [r[0] for r in rows]
    assert a.max_query_len.tolist() == [r[2] for r in rows]
    assert a.line.tolist() == b.line.tolist() == [i + 1 for i, t in enumerate(lines) if t]


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"num_tokens": 5, "num_reqs": 1}', "missing 'max_query_len'"),
        (
            '{"num_tokens": 5.0, "num_reqs": 1, "max_query_len": 5}',
            "num_tokens: expected an integer",
        ),
        ('{"num_tokens": 5, "num_reqs": 1, "max_query_len": 5', "not JSON"),
        ("[5, 1, 5]", "expected a JSON object"),
        (
            '{"num_tokens": 9000, "num_reqs": 1, "max_query_len": 9000}',
            "exceeds scheduler.max_num_batched",
        ),
        (
            '{"num_tokens": 300, "num_reqs": 300, "max_query_len": 1}',
            "exceeds scheduler.max_num_seqs",
        ),
        (
            '{"num_tokens": 5, "num_reqs": 6, "max_query_len": 1}',
            r"num_reqs 6 must be in 1..num_tokens",
        ),
        ('{"num_tokens": 10, "num_reqs": 2, "max_query_len": 3}', "max_query_len 3 is impossible"),
        ('{"num_tokens": 0, "num_reqs": 0, "max_query_len": 0}', "num_tokens 0 must be >= 1"),
    ],
)
def test_a_bad_trace_line_is_an_error_naming_its_line(tmp_path, line, match):
    path = tmp_path / "t.jsonl"
    path.write_text('{"num_tokens": 4, "num_reqs": 4, "max_query_len": 1}\n\n' + line + "\n")
    table = compile_plan(H100)
    with pytest.raises(TraceError, match=match) as e:
        check_trace(load_trace(path), table)
    assert str(e.value).startswith(f"{path}:3: ")


def test_shipped_traces_are_small_valid_and_reproducible():
    import make_traces

    table = compile_plan(H100)
    for name in ("chat", "long_prompt"):
        path = TRACES / f"{name}.jsonl"
        assert path.stat().st_size < 2_000_000
        trace = load_trace(path)
        check_trace(trace, table)
        assert trace.steps == 20000
        again = make_traces.simulate(name, 300)
        assert (
            again.tolist()
            == np.stack([trace.num_tokens, trace.num_reqs, trace.max_query_len], 1)[:300].tolist()
        )
    chat = aggregate(load_trace(TRACES / "chat.jsonl"), 1)
    assert chat.count[chat.uniform].sum() > 0.6 * chat.steps  # decode-heavy
    long = load_trace(TRACES / "long_prompt.jsonl")
    assert (long.num_tokens >= 4096).mean() > 0.25  # many large mixed steps


# -- the CLI -------------------------------------------------------------------------------------
def test_cli_writes_a_plan_that_compiles_keeps_the_other_fields_and_reports_the_gain(
    tmp_path, capsys
):
    out = tmp_path / "tuned.yaml"
    assert (
        main(
            [
                "optimize",
                str(H100),
                "--trace",
                str(TRACES / "chat.jsonl"),
                "-o",
                str(out),
                "--format",
                "json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    text = out.read_text()
    tuned, original = yaml.safe_load(text), yaml.safe_load(H100.read_text())
    assert tuned["cudagraph"].pop("capture_sizes") == report["after"]["sizes"]
    original["cudagraph"].pop("capture_sizes")
    assert tuned == original
    assert compile_plan(out).capture_sizes == tuple(report["after"]["sizes"])
    before, after = report["before"], report["after"]
    assert after["graphs"] <= before["graphs"] == 86
    assert f"{before['padded_tokens']} -> {after['padded_tokens']} padded tokens" in text
    assert text.startswith("# Tuned by `plan optimize`")
    assert "# vLLM's defaults for Llama-3-8B" in text  # the author's comments stay


def test_cli_text_output_and_rerun_replace_the_old_header(tmp_path, capsys):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    args = ["--trace", str(TRACES / "long_prompt.jsonl"), "--max-graphs", "60", "--pin", "1"]
    assert main(["optimize", str(H100), *args, "-o", str(first)]) == 0
    out = capsys.readouterr().out
    assert "before (plan)" in out and "after (optimized)" in out and "padded tokens: -" in out
    assert main(["optimize", str(first), *args, "-o", str(second)]) == 0
    text = second.read_text()
    assert (
        text.count("# Tuned by") == 1 and yaml.safe_load(text)["cudagraph"]["capture_sizes"][0] == 1
    )


@pytest.mark.parametrize(
    "args, match",
    [
        (["--trace", "MISSING"], "cannot read trace"),
        (["--trace", "BAD"], ":2: num_tokens: expected an integer"),
        (["--trace", "CHAT", "--pin", "0"], "--pin 0"),
        (["--trace", "CHAT", "--max-graphs", "2"], "need at least"),
        (["--trace", "CHAT", "-o", "/nonexistent-dir/tuned.yaml"], "cannot write here"),
    ],
)
def test_cli_errors_exit_1_without_traceback_or_partial_file(tmp_path, capsys, args, match):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"num_tokens": 4, "num_reqs": 4, "max_query_len": 1}\n'
        '{"num_tokens": "4", "num_reqs": 4, "max_query_len": 1}\n'
    )
    sub = {
        "MISSING": str(tmp_path / "none.jsonl"),
        "BAD": str(bad),
        "CHAT": str(TRACES / "chat.jsonl"),
    }
    out = tmp_path / "tuned.yaml"
    args = [sub.get(a, a) for a in args]
    if "-o" not in args:
        args += ["-o", str(out)]
    assert main(["optimize", str(H100), *args]) == 1
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".tuned.yaml.*"))


def test_cli_memory_budget_uses_the_profile(tmp_path, capsys):
    prof = tmp_path / "p.json"
    save_profile(
        prof,
        {
            "format": FORMAT,
            "version": 1,
            "model_fingerprint": "m",
            "device": "d",
            "per_graph_bytes": 2 * MIB,
            "per_token_bytes": 64 * 1024,
        },
    )
    assert (
        main(
            [
                "optimize",
                str(H100),
                "--trace",
                str(TRACES / "chat.jsonl"),
                "--memory-budget",
                "100",
                "--profile",
                str(prof),
                "--format",
                "json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["budget_graphs"] == 34 and report["after"]["graphs"] <= 34
    assert report["after"]["memory_bytes"] <= 100 * MIB


def test_the_benchmark_program_runs_and_passes_its_bars(capsys):
    import optimize_bench

    assert optimize_bench.main(["--steps", "20000"]) == 0
    assert "overall: PASS" in capsys.readouterr().out


def test_the_cli_keeps_small_sizes_the_trace_never_saw_unless_told_not_to(capsys):
    chat = str(TRACES / "chat.jsonl")  # smallest step: 64 tokens
    assert main(["optimize", str(H100), "--trace", chat, "--format", "json"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["after"]["sizes"][:10] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56]
    assert kept["outside_trace"]["smallest_size"] == {"before": 1, "after": 1}
    assert any("below the trace's smallest step (64 tokens)" in n for n in kept["notes"])
    assert kept["after"]["padded_tokens"] <= 0.7 * kept["before"]["padded_tokens"]
    # --no-small: the user excludes them on purpose, and is told what a lone decode then costs
    assert main(["optimize", str(H100), "--trace", chat, "--no-small"]) == 0
    out = capsys.readouterr().out
    dropped = [s for s in out.splitlines() if s.startswith("  smallest size")][0]
    assert dropped.startswith("  smallest size 1 -> ") and "(a 1-token step pads to" in dropped
    assert "worst padding, decode FULL: 7 @ 9 -> " in out and "eager above 512 -> 512" in out
