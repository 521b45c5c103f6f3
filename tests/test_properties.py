"""Properties over random valid plans (hypothesis): every batch lands on a graph at least its size
or runs eager for a stated reason, padding is minimal, decode pads to multiples of q, every graph is
reachable, and compilation is deterministic."""

from __future__ import annotations

import bisect
import copy

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from graphplan.compiler import PlanError, RuntimeMode, compile_plan
from graphplan.compiler.resolve import STRICT_CODES

# weighted towards plans that capture graphs (repeats = weight; hypothesis also favours the
# first entry); every value still appears
MODES = [
    "FULL_AND_PIECEWISE",
    "FULL_AND_PIECEWISE",
    "FULL",
    "FULL_DECODE_ONLY",
    "PIECEWISE",
    "FULL_AND_PIECEWISE",
    "FULL_DECODE_ONLY",
    "FULL",
    "NONE",
]
SUPPORT = [
    "ALWAYS",
    "UNIFORM_BATCH",
    "ALWAYS",
    "UNIFORM_SINGLE_TOKEN_DECODE",
    "UNIFORM_BATCH",
    "ALWAYS",
    "NEVER",
]
SPLITTING = [
    ["attention"],
    ["attention"],
    ["attention", "all_reduce"],
    ["attention"],
    ["all_reduce"],
    [],
]
# errors a random plan may legitimately hit: the property is over the plans that compile
PLAN_RULE_ERRORS = {"full-attention-never", "no-sizes"}


@st.composite
def capture_sizes(draw, tokens: int):
    kind = draw(st.sampled_from(["vllm", "list", "ranges", "sglang", "trtllm"]))
    if kind == "vllm":
        return {"preset": "vllm", "ceiling": draw(st.integers(1, 1024))}
    if kind == "sglang":
        return {"preset": "sglang", "max_size": draw(st.integers(0, 600))}
    if kind == "trtllm":
        return {
            "preset": "trtllm",
            "max_size": draw(st.integers(0, 600)),
            "enable_padding": draw(st.booleans()),
        }
    if kind == "list":  # may exceed max_num_batched_tokens: those are dropped with a diagnostic
        return draw(st.lists(st.integers(1, tokens + 64), min_size=1, max_size=40))
    ranges = []
    for _ in range(draw(st.integers(1, 3))):
        start = draw(st.integers(1, tokens))
        ranges.append(
            {
                "from": start,
                "to": draw(st.integers(start, tokens + 64)),
                "step": draw(st.integers(max(1, (tokens + 64) // 64), tokens + 64)),
            }
        )
    return {"ranges": ranges, "include": draw(st.lists(st.integers(1, tokens), max_size=8))}


@st.composite
def plans(draw) -> dict:
    q = draw(st.integers(1, 4))
    seqs = draw(st.integers(1, 160))
    tokens = draw(st.integers(max(seqs, q), 4096))
    plan = {
        "version": 1,
        "name": "prop",
        "scheduler": {
            "max_num_seqs": seqs,
            "max_num_batched_tokens": tokens,
            "decode_query_len": q,
        },
        "cudagraph": {
            "mode": draw(st.sampled_from(MODES)),
            "attention_support": draw(st.sampled_from(SUPPORT)),
            "splitting_ops": draw(st.sampled_from(SPLITTING)),
            "capture_sizes": draw(capture_sizes(tokens)),
        },
        "lora": {
            "enabled": draw(st.booleans()),
            "max_loras": draw(st.integers(1, 8)),
            "specialize_count": draw(st.booleans()),
            "separate_base": draw(st.booleans()),
        },
    }
    if draw(st.booleans()):
        k = draw(st.integers(2, 4))
        plan["parallel"] = {
            "data_parallel_size": draw(st.integers(2, 8)),
            "ubatch": {
                "enabled": True,
                "num_ubatches": k,
                "decode_token_threshold": draw(st.integers(k, 64) | st.integers(k, 600)),
                "prefill_token_threshold": draw(st.integers(k, 2000)),
                "plain_twins": draw(st.booleans()),
            },
        }
    return plan


def compile_or_reject(plan: dict):
    try:
        return compile_plan(plan)
    except PlanError as e:
        codes = {d.code for d in e.diagnostics}
        assert codes <= PLAN_RULE_ERRORS, str(e)  # any other error on a valid plan is a bug
        assume(False)


SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def check_route(t, r, n: int, c: int, uniform: bool) -> None:
    """A route lands on a graph of at least n tokens at the smallest capture size >= n, or is
    eager with a reason, and eager only when no applicable graph exists at that size."""
    sizes = t.capture_sizes
    i = bisect.bisect_left(sizes, n)
    assert r.reasons and r.reasons[0].startswith("batch: ")
    if r.mode is RuntimeMode.NONE:
        assert (r.graph_id, r.graph, r.padded_tokens) == (-1, None, n)
        if i < len(sizes):  # a graph existed at the padded size: it must not have applied
            routines = ["piecewise", "full_mixed"] + (["full_decode"] if uniform else [])
            assert all(t.routes[name][c][i] < 0 for name in routines), (n, r.reasons)
        return
    g = t.graphs[r.graph_id]
    assert r.graph == g.key and g.mode is r.mode
    assert g.key.num_tokens >= n
    assert r.padded_tokens == g.key.num_tokens == sizes[i]  # minimal: the smallest size >= n
    assert t.routes[g.routine][c][i] == r.graph_id
    assert g.key.num_ubatches == 1  # not asked to micro-batch
    if g.mode is RuntimeMode.FULL:
        assert r.padded_reqs == g.key.num_reqs
    else:
        assert g.key.num_reqs is None


@SETTINGS
@given(plans(), st.data())
def test_every_batch_routes_to_a_big_enough_graph_or_eager_with_a_reason(plan, data):
    t = compile_or_reject(plan)
    counts = len(t.settings.lora_case_of_count)
    loras = data.draw(st.integers(0, counts - 1), label="num_active_loras")
    c = t.settings.lora_case_of_count[loras]
    q = t.q
    for n in range(1, t.max_tokens + 1):  # mixed batches
        r = t.route(n, None, None, loras)
        check_route(t, r, n, c, uniform=False)
        assert r.padded_reqs is None or r.mode is RuntimeMode.FULL
    for reqs in range(1, min(t.max_num_seqs, t.max_tokens // q) + 1):  # uniform decode
        n = q * reqs
        r = t.route(n, reqs, q, loras)
        check_route(t, r, n, c, uniform=True)
        if r.mode is RuntimeMode.FULL and q > 1:
            assert r.padded_tokens % q == 0
        if r.mode is RuntimeMode.FULL and t.graphs[r.graph_id].routine == "full_decode":
            assert r.graph.uniform and r.padded_reqs == r.padded_tokens // q >= reqs


@SETTINGS
@given(plans())
def test_full_decode_graphs_are_multiples_of_q_within_q_to_q_times_max_num_seqs(plan):
    t = compile_or_reject(plan)
    q, seqs = t.q, t.max_num_seqs
    if t.settings.decode_mode.name == "FULL" and q > 1:
        assert all(s % q == 0 for s in t.capture_sizes)
    for g in t.graphs:
        if g.routine in ("full_decode", "full_decode_ubatched"):
            assert q <= g.key.num_tokens <= q * seqs and g.key.num_tokens % q == 0
            assert g.key.num_reqs == g.key.num_tokens // q and g.key.uniform


@SETTINGS
@given(plans())
def test_every_graph_in_the_route_matrices_is_reachable(plan):
    t = compile_or_reject(plan)
    cases, q = t.settings.lora_cases, t.q
    seen = []
    for name, matrix in t.routes.items():
        for c, row in enumerate(matrix.tolist()):
            for i, gid in enumerate(row):
                if gid < 0:
                    continue
                seen.append(gid)
                n, loras = t.capture_sizes[i], cases[c]
                if name == "full_decode":
                    r = t.route(n, n // q, q, loras)
                elif name == "full_decode_ubatched":
                    r = t.route(n, n // q, q, loras, ubatched=True)
                else:
                    r = t.route(n, None, None, loras)
                assert r.graph_id == gid, (name, n, loras, r.reasons)
    assert sorted(seen) == list(range(len(t.graphs)))  # each graph in exactly one cell


@SETTINGS
@given(plans())
def test_the_same_plan_compiles_to_the_same_bytes(plan):
    t = compile_or_reject(plan)
    again = compile_plan(copy.deepcopy(plan))
    assert again.dumps() == t.dumps()
    from graphplan.compiler import DispatchTable

    assert DispatchTable.from_json(t.to_json()).dumps() == t.dumps()


@SETTINGS
@given(plans())
def test_active_adapters_round_up_to_the_smallest_captured_case(plan):
    t = compile_or_reject(plan)
    cases = t.settings.lora_cases
    for k in range(len(t.settings.lora_case_of_count)):
        case = t.lora_case(k)
        assert case == min(c for c in cases if c >= k)
        r = t.route(t.max_tokens if not t.capture_sizes else t.capture_sizes[0], None, None, k)
        if r.graph is not None:
            assert r.graph.num_active_loras == case and r.graph.has_lora == (case > 0)


@SETTINGS
@given(plans())
def test_strict_only_turns_strict_diagnostics_into_errors(plan):
    t = compile_or_reject(plan)
    strict = copy.deepcopy(plan)
    strict["cudagraph"]["strict"] = True
    expected = {d["code"] for d in t.diagnostics} & STRICT_CODES
    if expected:
        with pytest.raises(PlanError, match=r"; or set strict: false\)") as e:
            compile_plan(strict)
        assert {d.code for d in e.value.diagnostics} == expected
    else:
        s = compile_plan(strict)
        assert (s.settings, s.graphs, s.diagnostics) == (t.settings, t.graphs, t.diagnostics)


@SETTINGS
@given(plans(), st.data())
def test_redispatch_never_exceeds_the_allowed_mode_and_pads_to_the_agreed_size(plan, data):
    t = compile_or_reject(plan)
    n = data.draw(st.integers(1, t.max_tokens), label="n")
    agreed = data.draw(st.integers(n, t.max_tokens), label="pad_to")
    allow = data.draw(st.sampled_from(list(RuntimeMode)), label="allow")
    ubatched = data.draw(st.booleans(), label="ubatched")
    r = t.route(n, None, None, 0, allow=allow, pad_to=agreed, ubatched=ubatched)
    if r.mode is RuntimeMode.NONE:
        assert r.padded_tokens == agreed
    else:
        assert r.mode is allow and r.padded_tokens >= agreed
        assert r.padded_tokens == t.capture_sizes[bisect.bisect_left(t.capture_sizes, agreed)]
        assert not ubatched  # mixed batches have no ubatched graphs
