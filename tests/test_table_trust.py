"""A table is untrusted input: it verifies itself on load (compiler/table_format.py). Tampered,
resealed, oversized or malformed tables are TableErrors (exit 2 from the CLI), never a wrong route,
never another exception."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
from test_table import resealed  # the forger's helper, shared with the table tests

from graphplan.compiler import DispatchTable, TableError, compile_plan
from graphplan.compiler.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny() -> dict:
    return json.loads(compile_plan(ROOT / "plans" / "tiny-llama.yaml").dumps())


def test_a_decode_route_pointed_at_a_smaller_graph_is_refused_even_resealed(tiny, tmp_path):
    """The attack of issue 16: the 8-token decode route aimed at the 4-token graph, checksums
    recomputed. Loading must refuse it, not serve 8 tokens through a 4-token graph."""
    t = DispatchTable.from_json(tiny)
    sizes = list(t.capture_sizes)
    r8 = t.route(8, 8, 1)
    assert r8.graph.num_tokens == 8
    g4 = t.route(4, 4, 1).graph_id
    data = copy.deepcopy(tiny)
    data["routes"]["full_decode"][0][sizes.index(8)] = g4
    path = tmp_path / "t.json"
    path.write_text(json.dumps(resealed(data)))
    with pytest.raises(
        TableError,
        match=r"routes.full_decode\[0, \d+\]|routes.full_decode\[\[0, "
        r"\d+\]\] differs from a fresh compile.*recompile",
    ):
        DispatchTable.load(path)


def test_routes_that_differ_change_the_content_fingerprint_that_dp_ranks_compare(tiny):
    a = DispatchTable.from_json(tiny)
    other = compile_plan(
        ROOT / "plans" / "tiny-llama.yaml", {"cudagraph.capture_sizes": [1, 2, 4, 8, 16]}
    )
    assert a.content_fingerprint != other.content_fingerprint
    assert (
        a.content_fingerprint == DispatchTable.from_json(json.loads(a.dumps())).content_fingerprint
    )


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda d: d["graphs"][0].update(num_tokens=d["graphs"][0]["num_tokens"] + 1),
            r"graphs\[0\] differs from a fresh compile",
        ),
        (
            lambda d: d["graphs"][0].update(
                mode={"FULL": "PIECEWISE", "PIECEWISE": "FULL"}[d["graphs"][0]["mode"]]
            ),
            r"graphs\[0\] differs from a fresh",
        ),
        (lambda d: d["settings"].update(max_num_seqs=4), r"settings.max_num_seqs differs"),
        (
            lambda d: d["settings"].update(sync_timeout_s=float("nan")),
            r"not a number JSON allows"
            r"|sync_timeout_s",
        ),
        (lambda d: d["settings"].update(sync_timeout_s=-5), r"sync_timeout_s: -5 is not a number"),
        (lambda d: d["settings"].update(max_num_batched_tokens=2**40), r"outside 1\.\.1048576"),
        (
            lambda d: d["settings"].update(data_parallel_size=2.0),
            r"data_parallel_size: expected int, "
            r"got float",
        ),
        (
            lambda d: d["settings"].update(tensor_parallel_size=0),
            r"settings.tensor_parallel_size: 0 is outside 1\.\.64",
        ),
        (
            lambda d: d["settings"].update(tensor_parallel_size=True),
            r"settings.tensor_parallel_size: expected int, got bool",
        ),
        (
            lambda d: d["settings"].update(tensor_parallel_size=4),
            r"settings.tensor_parallel_size differs",
        ),
        (lambda d: d["plan"]["scheduler"].update(max_num_seqs="many"), r"embedded plan"),
        (lambda d: d["plan"].pop("cudagraph"), r"embedded plan is malformed"),
        (lambda d: d["routes"]["piecewise"][0].__setitem__(0, 0), r"routes.piecewise.*differs"),
    ],
)
def test_tampered_resealed_tables_are_table_errors_naming_the_field(tiny, tmp_path, edit, match):
    data = copy.deepcopy(tiny)
    edit(data)
    path = tmp_path / "t.json"
    try:
        text = json.dumps(resealed(data), allow_nan=True)
    except (TypeError, ValueError):
        text = json.dumps(data, allow_nan=True)
    path.write_text(text)
    with pytest.raises(TableError, match=match):
        DispatchTable.load(path)


@pytest.mark.parametrize(
    "text,match",
    [
        ('{"format": "graphplan.table", "format_version": ' + "9" * 5000 + "}", r"digits|int"),
        ("[" * 100_000 + "]" * 100_000, r"recursion|nested"),
        ('{"format": "graphplan.table", "format_version": Infinity}', r"Infinity is not a number"),
    ],
)
def test_hostile_json_is_a_table_error_not_a_crash(tmp_path, text, match):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(TableError, match=match):
        DispatchTable.load(path)


def test_non_regular_files_are_refused_before_reading(tmp_path):
    with pytest.raises(TableError, match=r"/dev/zero: cannot read table: is a character device"):
        DispatchTable.load("/dev/zero")
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(
        TableError,
        match=r"is a FIFO \(named pipe\); graphplan reads only "
        r"regular files",
    ):
        DispatchTable.load(fifo)  # would block forever if opened


def test_an_oversized_table_is_refused_by_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr("graphplan.compiler.fileio.MAX_JSON_BYTES", 100)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"x": "y" * 200}))
    from graphplan.compiler.fileio import read_json

    with pytest.raises(TableError, match=r"a table is at most 100 bytes"):
        read_json(path, TableError, "table", "recompile", limit=100)


def mutate(data, rnd: random.Random):
    """One random edit somewhere in a table document."""
    values = [
        None,
        True,
        False,
        0,
        -1,
        1,
        2,
        7,
        10**6,
        2**40,
        1.5,
        -0.0,
        "",
        "FULL",
        "NONE",
        [],
        {},
        [0],
        [1, 2],
        {"a": 1},
    ]
    node = data
    for _ in range(rnd.randint(0, 4)):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        inner = [k for k in keys if isinstance(node[k], (dict, list)) and node[k]]
        if not inner:
            break
        node = node[rnd.choice(inner)]
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    if not keys:
        return
    key = rnd.choice(keys)
    r = rnd.random()
    if r < 0.2:
        del node[key]
    elif r < 0.5 and isinstance(node[key], int) and not isinstance(node[key], bool):
        node[key] += rnd.choice((-1, 1, 8))
    else:
        node[key] = rnd.choice(values)


@pytest.mark.parametrize(
    "plan", ["tiny-llama.yaml", "llama3-8b-lora8.yaml", "deepseek-v3-dp8-dbo.yaml"]
)
def test_fuzzed_tables_load_only_as_their_plan_compiles_or_fail_as_table_errors(
    plan, tmp_path, capsys
):
    """Random edits, mostly resealed: the loader raises TableError, or (when the edit left the
    table meaning what its plan compiles to, e.g. a diagnostic changed) loads routes identical to
    a fresh compile of its embedded plan. `plan explain` exits 2 with one line, no traceback."""
    base = json.loads(compile_plan(ROOT / "plans" / plan).dumps())
    rnd = random.Random(plan)
    loaded = refused = 0
    for i in range(120):
        data = copy.deepcopy(base)
        for _ in range(rnd.randint(1, 2)):
            mutate(data, rnd)
        try:
            doc = resealed(data) if rnd.random() < 0.9 else data
        except (TypeError, KeyError, AttributeError, ValueError):
            doc = data
        try:
            t = DispatchTable.from_json(doc)
        except TableError:
            refused += 1
        else:
            loaded += 1
            fresh = compile_plan(copy.deepcopy(t.plan))
            assert t.settings == fresh.settings and t.graphs == fresh.graphs
            assert all(np.array_equal(t.routes[k], fresh.routes[k]) for k in fresh.routes)
        if i % 10 == 0:  # the CLI on the same document: exit 2 or 0, never a traceback
            path = tmp_path / "t.json"
            try:
                path.write_text(json.dumps(doc))
            except (TypeError, ValueError):
                continue
            code = main(["explain", str(path), "--tokens", "1"])
            out, err = capsys.readouterr()
            assert code in (0, 2) and "Traceback" not in err
            assert (code == 0) == (path.exists() and _loads(path))
    assert refused > 80


def _loads(path: Path) -> bool:
    try:
        DispatchTable.load(path)
        return True
    except TableError:
        return False


def test_the_runtime_plan_check_agrees_with_jsonschema_on_mutated_plans():
    """schema_lite (no jsonschema in the runtime) refuses what jsonschema refuses, and more
    only where it is stricter on purpose: integral floats and non-finite numbers."""
    import jsonschema

    from graphplan.compiler.schema import load_schema
    from graphplan.compiler.schema_lite import first_error

    schema = load_schema()
    strict = jsonschema.Draft202012Validator(schema)
    rnd = random.Random(7)
    bases = [
        compile_plan(p, {"max_num_seqs": 8, "spec_tokens": 1} if p.suffix == ".j2" else None).plan
        for p in sorted((ROOT / "plans").iterdir())
    ]
    disagreements = []
    for _i in range(600):
        plan = copy.deepcopy(rnd.choice(bases))
        mutate(plan, rnd)
        ours, theirs = first_error(plan, schema) is None, strict.is_valid(plan)
        floaty = "1.5" in json.dumps(plan) or "-0.0" in json.dumps(plan)
        if ours != theirs and not (theirs and not ours and floaty):
            disagreements.append((plan, ours, theirs))
    assert disagreements == []


def test_the_runtime_plan_check_refuses_integral_floats():
    from graphplan.compiler.schema import load_schema
    from graphplan.compiler.schema_lite import first_error

    plan = compile_plan(ROOT / "plans" / "tiny-llama.yaml").plan
    plan["scheduler"]["max_num_seqs"] = 8.0
    assert first_error(plan, load_schema()) == (
        "scheduler.max_num_seqs",
        "expected integer, got float",
    )


def test_a_table_compiled_before_tensor_parallelism_loads_as_tp_1(tiny, tmp_path):
    """Tables of the same format version written before ``tensor_parallel_size`` existed (no key
    in the settings nor in the embedded plan) load, with one rank per model; the recorded
    bench tables are such tables."""
    data = copy.deepcopy(tiny)
    del data["settings"]["tensor_parallel_size"]
    del data["plan"]["parallel"]["tensor_parallel_size"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(resealed(data)))
    assert DispatchTable.load(path).settings.tensor_parallel_size == 1
    recorded = ROOT / "bench" / "tables" / "decode-51.json"
    assert "tensor_parallel_size" not in recorded.read_text()
    assert DispatchTable.load(recorded).settings.tensor_parallel_size == 1
