"""The batch-shape rules, one function each (compiler/records.py), and loading "a plan or a
compiled table" (compiler/plan_or_table.py): their exact behaviour, and that the compiler, the
router and the runtime agree with them. tests/test_structure.py checks that no other module
writes them out again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphplan.compiler import TableError, compile_plan
from graphplan.compiler.errors import UsageError
from graphplan.compiler.plan_or_table import is_table_path, load_plan_of, load_table_or_plan
from graphplan.compiler.records import decode_token_range, is_uniform_decode, padded_num_reqs
from graphplan.compiler.route import RouteContext

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "plans" / "tiny-llama.yaml"

counts = st.integers(1, 4096)
query_lens = st.integers(1, 64)


# -- uniform decode -------------------------------------------------------------------------------
def test_uniform_decode_is_every_request_at_exactly_q_tokens():
    assert is_uniform_decode(8, 8, 1, 1) is True  # 8 decodes
    assert is_uniform_decode(8, 4, 2, 2) is True  # 4 decodes of a draft token each
    assert is_uniform_decode(8, 4, 2, 1) is False  # q=1: two-token requests are a prefill
    assert is_uniform_decode(7, 4, 2, 2) is False  # one request has a single token
    assert is_uniform_decode(8, 8, None, 1) is False  # no query length: not known uniform


@given(counts, counts, query_lens, query_lens)
def test_uniform_decode_rule(n, r, m, q):
    assert is_uniform_decode(n, r, m, q) == (m == q and n == q * r)


@given(st.lists(st.tuples(counts, counts, query_lens), min_size=1, max_size=50), query_lens)
def test_uniform_decode_works_elementwise_on_a_traces_arrays(rows, q):
    n, r, m = (np.array(col) for col in zip(*rows))
    got = is_uniform_decode(n, r, m, q)
    assert got.dtype == bool
    assert got.tolist() == [is_uniform_decode(*row, q) for row in rows]


@pytest.fixture(scope="module", params=[1, 2, 3])
def table(request):
    q = request.param
    return compile_plan(
        {
            "version": 1,
            "name": f"q{q}",
            "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 64, "decode_query_len": q},
            "cudagraph": {
                "mode": "FULL_AND_PIECEWISE",
                "attention_support": "ALWAYS" if q > 1 else "UNIFORM_BATCH",
                "splitting_ops": ["attention"],
                "capture_sizes": {"preset": "vllm", "ceiling": 48},
            },
        }
    )


@given(data=st.data())
def test_the_router_tells_uniform_decode_as_the_rule_does(table, data):
    """table.py's router writes the rule out (speed): it must agree with is_uniform_decode."""
    n = data.draw(st.integers(1, table.max_tokens))
    r = data.draw(st.integers(1, min(n, table.max_num_seqs)))
    if data.draw(st.booleans()):  # often a uniform decode
        r = data.draw(st.integers(1, min(table.max_num_seqs, table.max_tokens // table.q)))
        n, m = table.q * r, table.q
    else:
        m = data.draw(st.integers(-(-n // r), n - r + 1))  # every valid longest request
    route = table.route(n, r, m)
    assert RouteContext(route.context).uniform == is_uniform_decode(n, r, m, table.q)
    if is_uniform_decode(n, r, m, table.q) and route.why.name == "FULL_DECODE":
        assert route.graph.uniform


# -- the decode size range ------------------------------------------------------------------------
@given(query_lens, st.integers(1, 512))
def test_decode_token_range_is_1_to_max_num_seqs_requests_of_q_tokens(q, seqs):
    r = decode_token_range(q, seqs)
    assert list(r) == [q * k for k in range(1, seqs + 1)]
    assert (r[0], r[-1], len(r)) == (q, q * seqs, seqs)
    for k in range(1, seqs + 1):  # every uniform decode of 1..max_num_seqs requests is in it
        assert is_uniform_decode(q * k, k, q, q) and q * k in r


@given(query_lens, st.integers(1, 512), counts)
def test_decode_token_range_membership_is_a_multiple_of_q_within_the_bounds(q, seqs, n):
    assert (n in decode_token_range(q, seqs)) == (n % q == 0 and q <= n <= q * seqs)


def test_full_decode_graphs_are_the_capture_sizes_in_the_decode_range(table):
    decode = decode_token_range(table.q, table.max_num_seqs)
    graphs = {g.key.num_tokens for g in table.graphs if g.routine == "full_decode"}
    assert graphs == {s for s in table.capture_sizes if s in decode} != set()


# -- the padded request count ---------------------------------------------------------------------
def test_padded_request_count_examples():
    assert padded_num_reqs(48, 256) == 48  # mixed: one token per request at least
    assert padded_num_reqs(600, 256) == 256  # never more than max_num_seqs
    assert padded_num_reqs(48, 256, 2) == 24  # uniform decode: q tokens per request
    assert padded_num_reqs(7, 256, 2) == 3


@given(counts, st.integers(1, 512), query_lens)
def test_padded_request_count_rule(n, seqs, q):
    got = padded_num_reqs(n, seqs, q)
    assert got == min(n // q, seqs) and 0 <= got <= seqs
    assert padded_num_reqs(n, seqs) == min(n, seqs)
    assert padded_num_reqs(n + 1, seqs, q) >= got  # more tokens never fewer requests
    if n in decode_token_range(q, seqs):  # a uniform decode of n tokens fills its graph exactly
        assert got * q == n and is_uniform_decode(n, got, q, q)


def test_every_full_graph_and_route_holds_the_padded_request_count(table):
    seqs, q = table.max_num_seqs, table.q
    for g in table.graphs:
        k = g.key
        if g.mode.name == "FULL":
            assert k.num_reqs == padded_num_reqs(k.num_tokens, seqs, q if k.uniform else 1)
        else:
            assert k.num_reqs is None  # PIECEWISE: any request count
    route = table.route(q * 3, 3, q)
    assert (
        route.padded_reqs == route.graph.num_reqs == padded_num_reqs(route.padded_tokens, seqs, q)
    )


def test_a_dummy_batch_is_a_uniform_decode_of_the_padded_request_count_when_it_can_be():
    from graphplan.runtime.dp.runner import dummy_shape

    for q, seqs in ((1, 256), (2, 256), (3, 4)):
        for tokens in range(1, 40):
            reqs, mql = dummy_shape(tokens, q, seqs)
            if tokens in decode_token_range(q, seqs):
                assert is_uniform_decode(tokens, reqs, mql, q)
            else:
                assert reqs == padded_num_reqs(tokens, seqs) and reqs * mql >= tokens


# -- a plan or a compiled table -------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, table",
    [
        ("table.json", True),
        ("out/t.json", True),
        (Path("t.json"), True),
        ("plans/tiny-llama.yaml", False),
        ("plans/sweep.yaml.j2", False),
        ("plan.json.yaml", False),
    ],
)
def test_a_json_path_is_a_compiled_table_and_any_other_a_plan(path, table):
    assert is_table_path(path) is table


def test_a_table_loads_as_it_is_and_a_plan_compiles_now(tmp_path):
    plan, diags = load_table_or_plan(TINY, {"scheduler.max_num_seqs": 8})
    assert plan.max_num_seqs == 8 and isinstance(diags, list)
    assert plan.fingerprint == compile_plan(TINY, {"scheduler.max_num_seqs": 8}).fingerprint
    path = tmp_path / "t.json"
    plan.save(path)
    table, diags = load_table_or_plan(path)
    assert diags == [] and table.content_fingerprint == plan.content_fingerprint
    assert load_plan_of(path).plan == load_plan_of(TINY, {"scheduler.max_num_seqs": 8}).plan


def test_overrides_on_a_compiled_table_are_refused_never_ignored(tmp_path):
    path = tmp_path / "t.json"
    compile_plan(TINY).save(path)
    for load in (load_table_or_plan, load_plan_of):
        with pytest.raises(UsageError, match="--set applies to plans, not to a compiled table"):
            load(path, {"scheduler.max_num_seqs": 8})
    assert UsageError.exit_code == 1


def test_a_table_that_is_not_one_is_a_table_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{}")
    with pytest.raises(TableError, match="not a graphplan table"):
        load_table_or_plan(path)


def test_the_cli_the_server_and_the_benchmarks_load_through_the_one_rule(tmp_path):
    from graphplan.compiler.cli.inputs import load_any
    from graphplan.server.core.model import load_table

    path = tmp_path / "t.json"
    compile_plan(TINY).save(path)
    want = load_table_or_plan(path)[0].content_fingerprint
    assert load_any(str(path))[0].content_fingerprint == want
    assert load_table(str(path)).content_fingerprint == want
    with pytest.raises(UsageError, match="applies to plans"):
        load_any(str(path), ["scheduler.max_num_seqs=8"])
    with pytest.raises(UsageError, match="applies to plans"):
        load_table(str(path), {"scheduler.max_num_seqs": 8})
