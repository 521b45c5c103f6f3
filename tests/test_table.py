"""The table (compiler/table.py, schemas/table.schema.json): round trips, byte-identical output,
version and corruption checks, the schema contract, atomic saves."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from graphplan.compiler import (
    DispatchTable,
    OutputError,
    TableError,
    compile_plan,
    records,
    table_fields,
    table_format,
)

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_VARS = {"sweep.yaml.j2": {"max_num_seqs": 128, "spec_tokens": 2}}
PLANS = sorted(p for p in (ROOT / "plans").iterdir() if p.is_file())
TABLE_SCHEMA = json.loads((ROOT / "schemas" / "table.schema.json").read_text("utf-8"))
PLAN_SCHEMA = json.loads((ROOT / "schemas" / "plan.schema.json").read_text("utf-8"))


def compile_shipped(path: Path) -> DispatchTable:
    return compile_plan(path, TEMPLATE_VARS.get(path.name))


@pytest.fixture(scope="module")
def h100() -> DispatchTable:
    return compile_plan(ROOT / "plans" / "llama3-8b-h100.yaml")


def resealed(data: dict) -> dict:
    """A table dict with fingerprint and checksum recomputed, as a forger would."""
    data = copy.deepcopy(data)
    try:
        version = data.get("compiler_version")
        data["fingerprint"] = table_format.plan_fingerprint(
            data.get("plan"), data.get("settings"), version
        )
        data["content_fingerprint"] = table_format.content_fingerprint(
            data.get("settings"), data.get("graphs"), data.get("routes"), version
        )
    except (TypeError, ValueError, AttributeError):
        pass  # damage that cannot be hashed; the loader must still refuse it cleanly
    data["checksum"] = checksum(data)
    return data


def checksum(data: dict) -> str:
    """The checksum of everything but the checksum, as the compiler writes it."""
    body = {k: v for k, v in data.items() if k != "checksum"}
    return (
        "sha256:"
        + hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
        ).hexdigest()
    )


def all_routes(t: DispatchTable) -> list[tuple]:
    """Every mixed and uniform-decode route of a table, as plain tuples."""
    out = []
    for n in range(1, t.max_tokens + 1):
        r = t.route(n, 1, n)
        out.append((r.mode, r.graph_id, r.padded_tokens, r.padded_reqs, r.why))
        if n % t.q == 0 and n // t.q <= t.max_num_seqs:
            r = t.route(n, n // t.q, t.q)
            out.append((r.mode, r.graph_id, r.padded_tokens, r.padded_reqs, r.why))
    return out


# -- round trip and determinism ----------------------------------------------------------------


def test_save_then_load_gives_the_same_table_and_routes(h100, tmp_path):
    path = tmp_path / "table.json"
    h100.save(path)
    loaded = DispatchTable.load(path)
    assert path.read_bytes() == h100.dumps() == loaded.dumps()
    assert loaded.graphs == h100.graphs
    assert loaded.fingerprint == h100.fingerprint
    assert {k: v.tolist() for k, v in loaded.routes.items()} == {
        k: v.tolist() for k, v in h100.routes.items()
    }
    assert all(v.dtype.name == "int32" for v in loaded.routes.values())
    assert all_routes(loaded) == all_routes(h100)


def test_a_table_pickles_and_copies_with_its_own_routes(h100):
    import pickle

    for other in (pickle.loads(pickle.dumps(h100)), copy.copy(h100), copy.deepcopy(h100)):
        assert other.dumps() == h100.dumps()
        assert all_routes(other) == all_routes(h100)
        assert other.route(9, 9, 1).context[0] is other  # routes refer to their own table


def test_table_bytes_are_canonical_json_with_one_trailing_newline(h100):
    raw = h100.dumps()
    assert raw.endswith(b"}\n") and raw.count(b"\n") == 1
    assert (
        raw[:-1]
        == json.dumps(
            json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        ).encode()
    )


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_two_compiles_give_the_same_bytes(plan):
    assert compile_shipped(plan).dumps() == compile_shipped(plan).dumps()


def test_other_processes_with_other_hash_seeds_give_the_same_bytes():
    code = (
        "import hashlib, json, sys; from pathlib import Path; from graphplan.compiler import compile_plan; "
        f"v = {TEMPLATE_VARS!r}; "
        "ps = sorted(p for p in Path('plans').iterdir() if p.is_file()); "
        "print(json.dumps({p.name: hashlib.sha256(compile_plan(p, v.get(p.name)).dumps())"
        ".hexdigest() for p in ps}))"
    )
    here = {p.name: hashlib.sha256(compile_shipped(p).dumps()).hexdigest() for p in PLANS}
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert json.loads(out.stdout) == here


def test_defaults_written_out_or_left_out_give_the_same_table(tmp_path):
    short = compile_plan({"version": 1, "name": "p"})
    full = compile_plan(short.plan)  # the plan with every default filled in
    assert full.dumps() == short.dumps()


def test_the_fingerprint_follows_the_plan_not_its_spelling():
    a = compile_plan({"version": 1, "name": "p", "scheduler": {"max_num_seqs": 128}})
    b = compile_plan({"version": 1, "name": "p", "scheduler": {"max_num_seqs": 64}})
    c = compile_plan({"version": 1, "name": "q", "scheduler": {"max_num_seqs": 128}})
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
    assert a.fingerprint.startswith("sha256:") and len(a.fingerprint) == 7 + 64


# -- versions and corruption --------------------------------------------------------------------


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_a_table_of_another_format_version_names_both_versions(h100, tmp_path):
    data = json.loads(h100.dumps())
    data["format_version"] = 1
    with pytest.raises(
        TableError,
        match=r"table format version 1, this graphplan reads version 2"
        r".*recompile",
    ):
        DispatchTable.load(write(tmp_path / "t.json", resealed(data)))
    del data["format_version"]
    with pytest.raises(TableError, match=r"table format version None"):
        DispatchTable.load(write(tmp_path / "t.json", data))


def test_an_edited_graph_is_a_checksum_mismatch(h100, tmp_path):
    data = json.loads(h100.dumps())
    data["graphs"][3]["num_tokens"] += 8
    with pytest.raises(TableError, match=r"t.json: corrupted table: checksum mismatch"):
        DispatchTable.load(write(tmp_path / "t.json", data))


def test_an_edited_route_is_a_checksum_mismatch(h100, tmp_path):
    data = json.loads(h100.dumps())
    data["routes"]["piecewise"][0][0] = 1
    with pytest.raises(TableError, match=r"checksum mismatch"):
        DispatchTable.load(write(tmp_path / "t.json", data))


def test_a_flipped_fingerprint_is_caught(h100, tmp_path):
    data = json.loads(h100.dumps())
    fp = data["fingerprint"]
    data["fingerprint"] = fp[:-1] + ("0" if fp[-1] != "0" else "1")
    with pytest.raises(TableError, match=r"checksum mismatch"):
        DispatchTable.load(write(tmp_path / "t.json", data))
    # even with the checksum recomputed, the fingerprint no longer matches the plan
    data["checksum"] = checksum(data)
    with pytest.raises(TableError, match=r"corrupted table: fingerprint mismatch"):
        DispatchTable.load(write(tmp_path / "t.json", data))


def test_edited_settings_are_caught_even_with_a_fresh_checksum(h100, tmp_path):
    data = json.loads(h100.dumps())
    data["settings"]["max_num_seqs"] = 8
    data["checksum"] = checksum(data)
    with pytest.raises(TableError, match=r"fingerprint mismatch"):
        DispatchTable.load(write(tmp_path / "t.json", data))
    with pytest.raises(
        TableError,
        match=r"settings.max_num_seqs differs from a fresh compile of "
        r"the embedded plan.*recompile",
    ):
        DispatchTable.load(write(tmp_path / "t.json", resealed(data)))


@pytest.mark.parametrize("cut", [0, 1, 100, -2])
def test_a_truncated_table_is_a_table_error(h100, tmp_path, cut):
    raw = h100.dumps()
    path = tmp_path / "t.json"
    path.write_bytes(raw[:cut])
    with pytest.raises(TableError, match=r"t.json: not a graphplan table"):
        DispatchTable.load(path)


@pytest.mark.parametrize(
    "content,match",
    [
        (b"\xff\xfe", r"not a graphplan table"),
        (b"[]", r"not a graphplan table \(no \"format\""),
        (b'{"format": "other"}', r"not a graphplan table"),
        (b"null", r"not a graphplan table"),
    ],
)
def test_files_that_are_not_tables_are_table_errors(tmp_path, content, match):
    path = tmp_path / "t.json"
    path.write_bytes(content)
    with pytest.raises(TableError, match=match):
        DispatchTable.load(path)


def test_missing_paths_and_directories_are_table_errors(tmp_path):
    with pytest.raises(TableError, match=r"cannot read table"):
        DispatchTable.load(tmp_path / "missing.json")
    with pytest.raises(TableError, match=r"is a directory"):
        DispatchTable.load(tmp_path)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d["settings"].pop("ubatch"), r"settings: missing 'ubatch'"),
        (lambda d: d["settings"]["ubatch"].pop("enabled"), r"settings.ubatch: missing 'enabled'"),
        (lambda d: d["settings"].update(mode="FAST"), r"settings.mode: 'FAST' is not one of NONE"),
        (
            lambda d: d["settings"].update(decode_query_len=0),
            r"decode_query_len: 0 is outside 1\.\.64",
        ),
        (
            lambda d: d["settings"].update(lora_case_of_count=[-1]),
            r"lora_case_of_count: expected "
            r"integers in 0\.\.0",
        ),
        (lambda d: d["settings"].update(capture_sizes=[8, 4]), r"capture_sizes: expected sorted"),
        (
            lambda d: d["settings"].update(sync_timeout_s=-1.0),
            r"sync_timeout_s: -1.0 is not a number",
        ),
        (lambda d: d["settings"].update(max_num_batched_tokens=2**40), r"outside 1\.\.1048576"),
        (lambda d: d["graphs"][0].pop("num_reqs"), r"graphs\[0\]: missing 'num_reqs'"),
        (lambda d: d["graphs"][0].update(id=5), r"graphs\[0\].id: 5"),
        (lambda d: d["graphs"][0].update(num_tokens=True), r"graphs\[0\].num_tokens: expected int"),
        (lambda d: d["routes"].pop("piecewise"), r"routes: expected exactly"),
        (lambda d: d["routes"]["piecewise"][0].append(0), r"routes.piecewise: expected a \[1 lora"),
        (lambda d: d["routes"]["full_decode"][0].__setitem__(0, 10**6), r"graph ids in -1\.\.85"),
    ],
)
def test_structurally_broken_tables_are_table_errors_even_when_resealed(
    h100, tmp_path, edit, match
):
    data = json.loads(h100.dumps())
    edit(data)
    with pytest.raises(TableError, match=match):
        DispatchTable.load(write(tmp_path / "t.json", resealed(data)))


def test_randomly_damaged_resealed_tables_raise_only_table_errors(tmp_path):
    """Forged tables (fresh checksum and fingerprint) with random damage never crash the loader."""
    base = json.loads(compile_plan(ROOT / "plans" / "llama3-8b-lora8.yaml").dumps())
    values = [None, True, 0, -1, 3, 10**9, "", "FULL", [], {}, [0], {"a": 1}, 1.5]
    rnd = random.Random(0)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        data = copy.deepcopy(base)
        node = data
        for _ in range(rnd.randint(0, 3)):  # walk down to a random container
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            inner = [k for k in keys if isinstance(node[k], (dict, list)) and node[k]]
            if not inner:
                break
            node = node[rnd.choice(inner)]
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            continue
        key = rnd.choice(keys)
        if rnd.random() < 0.3:
            del node[key]
        else:
            node[key] = rnd.choice(values)
        try:
            t = DispatchTable.from_json(resealed(data) if rnd.random() < 0.9 else data)
            t.route(1)
            outcomes["ok"] += 1
        except TableError:
            outcomes["error"] += 1
    assert outcomes["error"] > 100


# -- the schema ---------------------------------------------------------------------------------


def test_table_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(TABLE_SCHEMA)
    assert TABLE_SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def _objects(schema, where="$"):
    """Every (where, subschema) in a schema tree."""
    yield where, schema
    for key in ("properties", "$defs"):
        for name, sub in schema.get(key, {}).items():
            yield from _objects(sub, f"{where}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _objects(schema["items"], f"{where}[]")


def test_every_table_schema_object_is_closed_and_every_field_described():
    for where, sub in _objects(TABLE_SCHEMA):
        assert sub.get("description"), f"{where} has no description"
        if sub.get("type") == "object" and "properties" in sub:
            assert sub.get("additionalProperties") is False, where
            assert sorted(sub["required"]) == sorted(sub["properties"]), where


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_every_shipped_plan_emits_a_table_that_validates_against_the_schema(plan):
    data = json.loads(compile_shipped(plan).dumps())
    errors = [
        f"{list(e.absolute_path)}: {e.message}"
        for e in jsonschema.Draft202012Validator(TABLE_SCHEMA).iter_errors(data)
    ]
    assert errors == []
    assert list(jsonschema.Draft202012Validator(PLAN_SCHEMA).iter_errors(data["plan"])) == []


def test_the_schema_rejects_what_the_loader_rejects(h100):
    validator = jsonschema.Draft202012Validator(TABLE_SCHEMA)
    data = json.loads(h100.dumps())
    for edit in [
        lambda d: d.update(format_version=1),
        lambda d: d.update(extra=1),
        lambda d: d["graphs"][0].update(mode="NONE"),
        lambda d: d["settings"].pop("ubatch"),
        lambda d: d["routes"].pop("full_mixed"),
        lambda d: d["settings"].update(lora_case_of_count=[-1]),
    ]:
        bad = copy.deepcopy(data)
        edit(bad)
        assert not validator.is_valid(bad)
        with pytest.raises(
            TableError,
            match=r"^<table>: (table format version 1|table: unknown key "
            r"'extra'|graphs\[0\].mode: 'NONE' is not one of|settings: missing "
            r"'ubatch'|routes: expected exactly|settings\.lora_case_of_count: "
            r"expected integers)",
        ):
            DispatchTable.from_json(resealed(bad))


def test_the_schema_names_exactly_the_fields_table_format_writes_and_reads(h100):
    data = json.loads(h100.dumps())
    props = TABLE_SCHEMA["properties"]
    assert set(props) == set(data) == set(table_fields.TOP_FIELDS)
    assert (
        set(props["settings"]["properties"])
        == set(data["settings"])
        == set(table_fields.SETTINGS_FIELDS)
        == set(records.TableSettings.__slots__)
    )
    assert (
        set(props["settings"]["properties"]["ubatch"]["properties"])
        == set(data["settings"]["ubatch"])
        == set(table_fields.UBATCH_FIELDS)
        == set(records.UbatchSettings.__slots__)
    )
    graph = props["graphs"]["items"]["properties"]
    assert set(graph) == set(data["graphs"][0]) == set(table_fields.GRAPH_FIELDS)
    assert set(graph) - {"id", "mode", "routine"} == set(records.BatchDescriptor.__slots__)
    assert set(props["routes"]["properties"]) == set(records.ROUTINES) == set(data["routes"])
    assert props["format"]["const"] == table_format.FORMAT
    assert props["format_version"]["const"] == table_format.FORMAT_VERSION
    diag = props["diagnostics"]["items"]["properties"]
    assert set(diag) == {"code", "severity", "path", "message", "hint"}


# -- atomic saves -------------------------------------------------------------------------------


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "table.json")


def test_a_failing_rename_leaves_no_temp_file_and_the_old_table_untouched(
    h100, tmp_path, monkeypatch
):
    path = tmp_path / "table.json"
    path.write_bytes(b"old table")

    def fail(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OutputError, match=r"table.json: cannot write \(No space left on device\)"):
        h100.save(path)
    assert path.read_bytes() == b"old table"
    assert _leftovers(tmp_path) == []


def test_an_interrupted_write_leaves_no_temp_file_and_reraises(h100, tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    path.write_bytes(b"old table")

    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt, match=r"^$"):  # raised bare, with no message
        h100.save(path)
    assert path.read_bytes() == b"old table"
    assert _leftovers(tmp_path) == []


def test_saving_into_a_missing_folder_or_onto_a_folder_is_an_output_error(h100, tmp_path):
    with pytest.raises(OutputError, match=r"cannot write here"):
        h100.save(tmp_path / "missing" / "table.json")
    with pytest.raises(OutputError, match=r"is a directory"):
        h100.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions"
)
def test_saving_into_a_read_only_folder_is_an_output_error(h100, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(OutputError, match=r"cannot write here"):
            h100.save(folder / "table.json")
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


def test_a_folder_without_write_permission_is_an_output_error(h100, tmp_path, monkeypatch):
    import tempfile

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(
        OutputError,
        match=r"cannot write here \(Permission denied\); choose a "
        r"writable directory with -o",
    ):
        h100.save(tmp_path / "table.json")
    assert list(tmp_path.iterdir()) == []


def test_save_replaces_an_existing_table_whole(h100, tmp_path):
    path = tmp_path / "table.json"
    path.write_bytes(b"x" * 10_000_000)
    h100.save(path)
    assert path.read_bytes() == h100.dumps()
    assert _leftovers(tmp_path) == []


# -- routes stay what they were -------------------------------------------------------------------


def route_digest(t: DispatchTable) -> str:
    """sha256 over every route on a grid of (tokens, requests, query length) x allowed mode x
    ubatched: mode, graph key, padded tokens and requests, wants_ubatch."""
    h = hashlib.sha256()
    for n in range(1, t.max_tokens + 1, max(1, t.max_tokens // 700)):
        decode = (n // t.q, t.q) if n % t.q == 0 and n // t.q <= t.max_num_seqs else (1, n)
        for r, q in ((1, n), (None, None), decode):
            for allow in (None, "NONE", "PIECEWISE", "FULL"):
                for ub in (False, True):
                    rt = t.route(n, r, q, 0, allow=allow, ubatched=ub)
                    g = rt.graph
                    key = (
                        None
                        if g is None
                        else (
                            g.num_tokens,
                            g.num_reqs,
                            g.uniform,
                            g.num_active_loras,
                            g.num_ubatches,
                        )
                    )
                    h.update(
                        repr(
                            (rt.mode.name, key, rt.padded_tokens, rt.padded_reqs, rt.wants_ubatch)
                        ).encode()
                    )
    return h.hexdigest()


def test_every_shipped_plan_routes_exactly_as_recorded():
    """tests/data/route_digests.json was recorded with graphplan 0.1.0 (before the typed table):
    a refactor must not move a single route. Change it only with a rule change, saying why."""
    recorded = json.loads((ROOT / "tests" / "data" / "route_digests.json").read_text())
    now = {
        p.name: {"graphs": len(t.graphs), "routes_sha256": route_digest(t)}
        for p in PLANS
        for t in [compile_shipped(p)]
    }
    assert now == recorded
