"""Loading plans: every bad input gets a located error (file:line:col, code, hint); the schema's
defaults and the spec dataclasses agree field for field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from graphplan.compiler import PlanError, compile_plan, load_plan, records
from graphplan.compiler import spec as S
from graphplan.compiler.load import MAX_DEPTH, MAX_PLAN_BYTES

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "schemas" / "plan.schema.json").read_text("utf-8"))
GOOD = "version: 1\nname: ok\nscheduler:\n  max_num_seqs: 64\n  max_num_batched_tokens: 1024\n"


def errors_of(text: str | bytes, tmp_path: Path, name: str = "plan.yaml", overrides=None) -> list:
    """(code, line, col, message, hint) of every diagnostic a plan's PlanError carries."""
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(PlanError, match=r": error\[[\w-]+\]: ") as e:
        compile_plan(path, overrides)
    for d in e.value.diagnostics:
        assert d.file == str(path) and d.severity == "error"
    return [(d.code, d.line, d.col, d.message, d.hint) for d in e.value.diagnostics]


def only(text, tmp_path, **kw):
    found = errors_of(text, tmp_path, **kw)
    assert len(found) == 1, found
    return found[0]


# -- files that are not plans -------------------------------------------------------------------


def test_invalid_yaml_is_located(tmp_path):
    code, line, col, message, hint = only("version: 1\nname: [x\n", tmp_path)
    assert (code, line, col) == ("yaml", 3, 1)
    assert message.startswith("invalid YAML: ") and hint == "check indentation, colons and quotes"


def test_bad_indentation_is_located(tmp_path):
    code, line, col, *_ = only(
        "version: 1\nname: x\nscheduler:\n  max_num_seqs: 4\n max_num_batched_tokens: 8\n", tmp_path
    )
    assert (code, line) == ("yaml", 5)


@pytest.mark.parametrize("text", ["", "   \n\n", "# only a comment\n"])
def test_an_empty_file_is_an_error(tmp_path, text):
    code, _, _, message, hint = only(text, tmp_path)
    assert (code, message) == ("empty", "the plan is empty")
    assert "plans/llama3-8b-h100.yaml" in hint


def test_a_directory_is_an_error(tmp_path):
    with pytest.raises(PlanError, match=r"error\[not-a-file\]: is a directory \(give a plan file"):
        compile_plan(tmp_path)


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(PlanError, match=r"missing.yaml: error\[not-found\]: no such file"):
        compile_plan(tmp_path / "missing.yaml")


def test_non_utf8_bytes_are_located(tmp_path):
    code, line, col, message, hint = only(b"version: 1\nname: x\n# caf\xe9\n", tmp_path)
    assert (code, line, col, message, hint) == (
        "not-utf8",
        3,
        6,
        "byte 0xe9 is not UTF-8",
        "save the plan as UTF-8",
    )


def test_a_file_above_the_size_limit_is_an_error(tmp_path):
    code, *_, message, _ = only("#" * (MAX_PLAN_BYTES + 1), tmp_path)
    assert code == "too-large" and f"at most {MAX_PLAN_BYTES} bytes" in message


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", "42\n"])
def test_a_plan_that_is_not_a_mapping_is_an_error(tmp_path, text):
    code, line, col, message, _ = only(text, tmp_path)
    assert (code, line, col) == ("not-a-mapping", 1, 1)
    assert "must be a mapping" in message


def test_several_yaml_documents_are_an_error(tmp_path):
    assert only("version: 1\nname: a\n---\nversion: 1\nname: b\n", tmp_path)[0] == "yaml"


def test_python_tags_are_refused(tmp_path):
    code, line, *_ = only("version: 1\nname: !!python/object/apply:os.system [ls]\n", tmp_path)
    assert (code, line) == ("yaml", 2)


# -- keys -----------------------------------------------------------------------------------------


def test_an_unknown_key_suggests_the_closest_known_key(tmp_path):
    found = only(GOOD + "cudagraph:\n  captur_sizes: [1]\n", tmp_path)
    assert found == (
        "unknown-key",
        7,
        3,
        "unknown key 'captur_sizes'",
        "did you mean 'capture_sizes'?",
    )


def test_an_unknown_key_with_no_close_match_lists_the_known_keys(tmp_path):
    code, line, col, message, hint = only(GOOD + "lora:\n  zzz: 1\n", tmp_path)
    assert (code, line, col) == ("unknown-key", 7, 3)
    assert hint == "known keys: enabled, max_loras, specialize_count, separate_base"


def test_a_misspelt_enum_value_suggests_the_right_one(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(GOOD + "cudagraph:\n  mode: FULL_DECODE\n")
    with pytest.raises(
        PlanError, match=r"\[bad-value\]: cudagraph\.mode: 'FULL_DECODE' is not"
    ) as e:
        compile_plan(path)
    assert str(e.value) == (
        f"{path}:7:9: error[bad-value]: cudagraph.mode: 'FULL_DECODE' is not one of NONE, "
        "PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE (did you mean 'FULL_DECODE_ONLY'?)"
    )


def test_duplicate_keys_name_both_lines(tmp_path):
    found = only("version: 1\nname: a\nscheduler: {}\nname: b\n", tmp_path)
    assert found == (
        "duplicate-key",
        4,
        1,
        "key 'name' appears twice (first at line 2)",
        "remove one of them",
    )


def test_a_missing_required_key_is_an_error(tmp_path):
    code, _, _, message, _ = only("version: 1\n", tmp_path)
    assert (code, message) == ("missing-key", "missing required key(s): name")


def test_another_plan_version_is_an_error(tmp_path):
    found = only("version: 2\nname: x\n", tmp_path)
    assert found == ("bad-value", 1, 10, "2: this graphplan reads version 1", "write version: 1")


@pytest.mark.parametrize("text", ["? [a, b]\n: 1\nversion: 1\n", "{[1]: 2}\n", "{{a: 1}: 2}\n"])
def test_a_list_or_mapping_used_as_a_key_is_an_error(tmp_path, text):
    assert only(text, tmp_path)[0] == "bad-key"


def test_keys_that_are_not_strings_are_unknown_keys(tmp_path):
    found = errors_of("1: 2\nnull: 3\nversion: 1\nname: x\n", tmp_path)
    assert [(c, m) for c, _, _, m, _ in found] == [
        ("unknown-key", "unknown key '1'"),
        ("unknown-key", "unknown key 'None'"),
    ]


# -- values ---------------------------------------------------------------------------------------


def test_wrong_types_are_located_and_named(tmp_path):
    found = errors_of(
        "version: 1\nname: x\nscheduler:\n  max_num_seqs: lots\n"
        "lora: {enabled: yes please}\ncudagraph:\n  strict: 1\n",
        tmp_path,
    )
    assert [(c, line, col) for c, line, col, *_ in found] == [
        ("wrong-type", 4, 17),
        ("wrong-type", 5, 17),
        ("wrong-type", 7, 11),
    ]
    assert found[0][3] == "expected integer, got string 'lots'"
    assert found[2][3] == "expected boolean, got integer 1"


@pytest.mark.parametrize("value", ["0", "-8"])
def test_zero_or_negative_sizes_are_errors_at_their_item(tmp_path, value):
    found = only(f"version: 1\nname: x\ncudagraph:\n  capture_sizes: [1, {value}, 8]\n", tmp_path)
    assert found[:4] == ("out-of-range", 4, 22, f"{value} must be >= 1")


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "decode_query_len"])
def test_zero_scheduler_limits_are_errors(tmp_path, field):
    found = only(f"version: 1\nname: x\nscheduler:\n  {field}: 0\n", tmp_path)
    assert found[:4] == ("out-of-range", 4, len(field) + 5, "0 must be >= 1")


def test_absurdly_large_numbers_are_errors(tmp_path):
    found = only(
        "version: 1\nname: x\nscheduler:\n  max_num_batched_tokens: 99999999999999999999\n",
        tmp_path,
    )
    assert found[0] == "out-of-range" and "must be <= 1048576" in found[3]


@pytest.mark.parametrize("key", ["capture_sizes", "capture_sizes_include"])
def test_absurdly_long_size_lists_are_errors(tmp_path, key):
    items = ", ".join(["8"] * 4097)
    sizes = (
        f"[{items}]"
        if key == "capture_sizes"
        else f"{{ranges: [{{from: 8, to: 16, step: 8}}], include: [{items}]}}"
    )
    code, line, _, message, hint = only(
        f"version: 1\nname: x\ncudagraph:\n  capture_sizes: {sizes}\n", tmp_path
    )
    assert (code, line, message) == ("too-many-items", 4, "4097 items; at most 4096")
    assert hint == "use a preset or ranges instead of a long list"


@pytest.mark.parametrize(
    "sizes, hint",
    [
        ("{include: [1, 2]}", "add ranges: [{from: 8, to: 64, step: 8}] beside include"),
        (
            "{}",
            "add preset: vllm, or ranges: [{from: 8, to: 64, step: 8}]; or give a list, e.g. [1, 2, 4, 8]",
        ),
    ],
)
def test_a_size_mapping_of_neither_form_names_both_forms(tmp_path, sizes, hint):
    code, line, col, message, found_hint = only(
        GOOD + f"cudagraph:\n  capture_sizes: {sizes}\n", tmp_path
    )
    assert (code, line, col, found_hint) == ("missing-key", 7, 18, hint)
    assert message.startswith(
        "a mapping of capture sizes is the preset form {preset: vllm | sglang | trtllm, ceiling, "
        "max_size, enable_padding} or the ranges form {ranges: [{from, to, step}, ...], "
        "include: [...]}; this one has neither 'preset' nor 'ranges'"
    )


@pytest.mark.parametrize(
    "sizes, key, form",
    [
        ("{preset: vllm, include: [3]}", "include", "ranges"),
        ("{ranges: [], ceiling: 8}", "ceiling", "preset"),
    ],
)
def test_a_key_of_the_other_size_form_says_which_form_it_belongs_to(tmp_path, sizes, key, form):
    code, _, _, message, hint = only(GOOD + f"cudagraph:\n  capture_sizes: {sizes}\n", tmp_path)
    assert (code, message) == ("unknown-key", f"unknown key '{key}'")
    assert hint.startswith(f"'{key}' belongs to the {form} form {{")


def test_exactly_4096_sizes_are_allowed(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "version: 1\nname: x\nscheduler: {max_num_batched_tokens: 8192}\n"
        f"cudagraph: {{mode: PIECEWISE, capture_sizes: {list(range(1, 4097))}}}\n"
    )
    assert len(compile_plan(path).settings.capture_sizes) == 4096


def test_a_bad_plan_name_is_an_error(tmp_path):
    code, line, col, message, _ = only("version: 1\nname: has spaces\n", tmp_path)
    assert (code, line, col) == ("invalid", 2, 7) and "does not match" in message


def test_every_error_is_reported_sorted_by_line(tmp_path):
    found = errors_of(
        "version: 1\nname: x\nlora: {max_loras: 0}\nscheduler: {max_num_seqs: 0}\n"
        "cudagraph: {mode: EAGER}\n",
        tmp_path,
    )
    assert [(c, line) for c, line, *_ in found] == [
        ("out-of-range", 3),
        ("out-of-range", 4),
        ("bad-value", 5),
    ]


# -- YAML that would take the loader down -------------------------------------------------------


def test_nesting_deeper_than_the_limit_is_an_error_not_a_crash(tmp_path):
    deep = "[" * 200_000 + "]" * 200_000
    code, line, col, *_ = only(f"version: 1\nname: x\nlora: {deep}\n", tmp_path)
    assert (code, line) == ("too-deep", 3)
    assert (
        only("a: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n", tmp_path)[0]
        == "too-deep"
    )


def test_a_recursive_alias_is_an_error(tmp_path):
    found = only("version: 1\nname: x\nlora: &a {x: *a}\n", tmp_path)
    assert found[:2] == ("recursive-alias", 3)


def test_exponential_alias_expansion_is_an_error(tmp_path):
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    assert only("\n".join(lines) + "\n", tmp_path)[0] == "too-large"


def test_plain_aliases_still_work(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "version: 1\nname: x\nscheduler: &s {max_num_seqs: 64}\n"
        "cudagraph: {capture_sizes: &sz [1, 2, 4]}\nx-note: *s\n"
    )
    found = errors_of(path.read_text(), tmp_path)  # the alias key itself is unknown
    assert [c for c, *_ in found] == ["unknown-key"]
    path.write_text(
        "version: 1\nname: x\ncudagraph: {capture_sizes: &sz [1, 2, 4]}\nparallel: {}\n"
    )
    assert list(compile_plan(path).settings.capture_sizes) == [1, 2, 4]


# -- templates and overrides ----------------------------------------------------------------------


def test_an_undefined_template_variable_names_the_variable_and_its_line(tmp_path):
    found = only(
        "version: 1\nname: x\nscheduler:\n  max_num_seqs: {{ seqs }}\n",
        tmp_path,
        name="plan.yaml.j2",
    )
    assert found == (
        "template-undefined",
        4,
        1,
        "template variable 'seqs' is undefined",
        "pass it with --set seqs=VALUE",
    )


def test_the_shipped_template_needs_every_variable():
    with pytest.raises(
        PlanError,
        match=r"sweep.yaml.j2:5:1: error\[template-undefined\]: "
        r"template variable 'spec_tokens' is undefined",
    ):
        compile_plan(ROOT / "plans" / "sweep.yaml.j2", {"max_num_seqs": 64})


def test_a_template_syntax_error_is_located(tmp_path):
    found = only(
        "version: 1\nname: x\n{% if a %}\n", tmp_path, name="plan.yaml.j2", overrides={"a": 1}
    )
    assert found[:2] == ("template", 3) and "template syntax error" in found[3]


def test_a_failing_template_expression_is_a_plan_error(tmp_path):
    found = only(
        "version: 1\nname: x{{ 1 // n }}\n", tmp_path, name="plan.yaml.j2", overrides={"n": 0}
    )
    assert found[0] == "template" and "template failed to render" in found[3]


def test_template_variables_render_the_plan():
    t = compile_plan(ROOT / "plans" / "sweep.yaml.j2", {"max_num_seqs": 512, "spec_tokens": 0})
    assert t.plan["name"] == "sweep-seqs512-spec0"
    assert t.plan["scheduler"] == {
        "max_num_seqs": 512,
        "max_num_batched_tokens": 2048,
        "decode_query_len": 1,
    }
    assert t.plan["cudagraph"]["attention_support"] == "UNIFORM_SINGLE_TOKEN_DECODE"
    assert t.plan["cudagraph"]["capture_sizes"]["ceiling"] == 1024


def test_overrides_set_dotted_keys_of_a_plain_plan():
    path = ROOT / "plans" / "llama3-8b-h100.yaml"
    t = compile_plan(
        path, {"scheduler.max_num_seqs": 16, "cudagraph.mode": "PIECEWISE", "lora.enabled": True}
    )
    assert t.plan["scheduler"]["max_num_seqs"] == 16
    assert t.settings.mode.name == "PIECEWISE" and t.settings.lora_enabled is True
    assert list(t.settings.capture_sizes) == [1, 2, 4, 8, 16, 24, 32]
    assert compile_plan(path).plan["scheduler"]["max_num_seqs"] == 256  # file untouched


def test_overrides_of_a_dict_plan_leave_the_dict_untouched():
    plan = {"version": 1, "name": "p", "scheduler": {"max_num_seqs": 8}}
    t = compile_plan(plan, {"scheduler.max_num_seqs": 4})
    assert t.plan["scheduler"]["max_num_seqs"] == 4 and plan["scheduler"]["max_num_seqs"] == 8


def test_a_bad_override_is_reported_at_the_set_not_at_the_files_line(tmp_path):
    """The file's line holds the value the --set replaced: the error names the --set instead."""
    found = errors_of(GOOD, tmp_path, overrides={"scheduler.max_num_seqs": "many"})
    assert found == [
        (
            "wrong-type",
            0,
            0,
            "--set scheduler.max_num_seqs=many: expected integer, got string 'many'",
            "",
        )
    ]
    found = errors_of(GOOD, tmp_path, overrides={"cudagraph.capture_sizes": [4, 0]})
    assert found[0][:4] == (
        "out-of-range",
        0,
        0,
        "--set cudagraph.capture_sizes=[4, 0]: 0 must be >= 1",
    )


def test_an_override_of_an_unknown_key_is_an_unknown_key(tmp_path):
    found = errors_of(GOOD, tmp_path, overrides={"scheduler.max_seqs": 4})
    assert found[0][0] == "unknown-key" and found[0][4] == "did you mean 'max_num_seqs'?"


def test_a_source_that_is_neither_path_nor_dict_is_a_type_error():
    with pytest.raises(TypeError, match=r"source must be a path or a dict, not int"):
        compile_plan(42)


# -- defaults: the schema and the dataclasses agree -----------------------------------------------


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _props(path: str) -> dict:
    node = SCHEMA
    for part in path.split("/") if path else []:
        node = node["properties"][part] if part in node.get("properties", {}) else node[part]
    return node["properties"]


@pytest.mark.parametrize(
    "cls,path",
    [
        (S.PlanSpec, ""),
        (S.SchedulerSpec, "scheduler"),
        (S.CudagraphSpec, "cudagraph"),
        (S.LoraSpec, "lora"),
        (S.ParallelSpec, "parallel"),
        (S.UbatchSpec, "parallel/ubatch"),
        (S.LimitsSpec, "limits"),
    ],
)
def test_every_schema_property_is_a_dataclass_field_and_back(cls, path):
    assert set(_props(path)) == _fields(cls)


def test_capture_size_forms_map_to_capture_sizes_spec_fields():
    defs = SCHEMA["$defs"]
    schema_fields = set(defs["size_preset"]["properties"]) | set(defs["size_ranges"]["properties"])
    assert _fields(S.CaptureSizesSpec) == schema_fields | {"kind", "sizes"}
    range_props = set(defs["size_ranges"]["properties"]["ranges"]["items"]["properties"])
    assert range_props == {"from", "to", "step"}
    assert _fields(S.SizeRange) == {"start", "to", "step"}  # `from` is a Python keyword
    for name in ("ceiling", "max_size", "enable_padding"):  # the dataclass's own defaults agree
        field = next(f for f in dataclasses.fields(S.CaptureSizesSpec) if f.name == name)
        assert field.default == defs["size_preset"]["properties"][name]["default"], name


def test_enums_in_the_schema_are_the_enum_members():
    cg = _props("cudagraph")
    assert cg["mode"]["enum"] == [m.name for m in records.CudagraphMode]
    assert cg["attention_support"]["enum"] == [a.name for a in records.AttentionSupport]


def _every_property(node, where="$"):
    for key in ("properties", "$defs"):
        for name, sub in node.get(key, {}).items():
            yield f"{where}.{name}", sub
            yield from _every_property(sub, f"{where}.{name}")
    for key in ("items", "then", "else"):
        if isinstance(node.get(key), dict):
            yield from _every_property(node[key], f"{where}.{key}")


def test_every_schema_property_has_a_description_and_a_default():
    missing = [
        w
        for w, sub in _every_property(SCHEMA)
        if not sub.get("description") or "default" not in sub
    ]
    assert missing == []
    assert SCHEMA["additionalProperties"] is False


def test_every_schema_object_is_closed():
    open_ = [
        w
        for w, sub in _every_property(SCHEMA)
        if sub.get("type") == "object" and sub.get("additionalProperties") is not False
    ]
    assert open_ == []


def test_every_schema_default_validates_against_its_own_property():
    checked, bad = 0, []
    for where, sub in _every_property(SCHEMA):
        validator = jsonschema.Draft202012Validator({**sub, "$defs": SCHEMA["$defs"]})
        checked += 1
        if not validator.is_valid(sub["default"]):
            bad.append(where)
    assert bad == [] and checked >= 30


def test_a_minimal_plan_gets_every_default_from_the_schema():
    loaded = load_plan({"version": 1, "name": "m"})
    s = loaded.spec
    assert (
        s.scheduler.max_num_seqs,
        s.scheduler.max_num_batched_tokens,
        s.scheduler.decode_query_len,
    ) == (256, 8192, 1)
    assert (
        s.cudagraph.mode,
        s.cudagraph.attention_support,
        s.cudagraph.splitting_ops,
        s.cudagraph.strict,
    ) == (
        records.CudagraphMode.FULL_AND_PIECEWISE,
        records.AttentionSupport.UNIFORM_BATCH,
        ("attention",),
        False,
    )
    assert s.cudagraph.capture_sizes == S.CaptureSizesSpec(
        kind="preset", preset="vllm", ceiling=512, max_size=0
    )
    assert s.lora == S.LoraSpec(
        enabled=False, max_loras=4, specialize_count=True, separate_base=True
    )
    assert (s.parallel.data_parallel_size, s.parallel.backend, s.parallel.sync_timeout_s) == (
        1,
        "auto",
        300,
    )
    assert s.parallel.ubatch == S.UbatchSpec(
        enabled=False,
        num_ubatches=2,
        decode_token_threshold=32,
        prefill_token_threshold=512,
        plain_twins=True,
    )
    assert s.limits == S.LimitsSpec(max_graphs=4096)
    assert jsonschema.Draft202012Validator(SCHEMA).is_valid(loaded.plan)


def test_filled_defaults_are_the_schema_defaults():
    plan = load_plan({"version": 1, "name": "m"}).plan
    for section in ("scheduler", "lora", "limits"):
        assert plan[section] == {k: v["default"] for k, v in _props(section).items()}
    assert plan["parallel"]["ubatch"] == {
        k: v["default"] for k, v in _props("parallel/ubatch").items()
    }
