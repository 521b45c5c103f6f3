"""The plan's JSON Schema: validation with readable messages, and defaults (which live only there)."""

from __future__ import annotations

import copy
import json
import math
from functools import lru_cache
from importlib import resources

from .errors import did_you_mean


@lru_cache(maxsize=None)
def load_schema(name: str = "plan.schema.json") -> dict:
    return json.loads(resources.files("graphplan.schemas").joinpath(name).read_text("utf-8"))


def _is_integer(checker, v) -> bool:
    """JSON Schema counts 64.0 as an integer; graphplan does not (one rule for the schema, the
    compiler and the table: integers are written without a fractional part)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(checker, v) -> bool:
    """Finite numbers only: NaN and Infinity are refused everywhere."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))


@lru_cache(maxsize=None)
def _validator(name: str = "plan.schema.json"):
    import jsonschema

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine_many({"integer": _is_integer, "number": _is_number})
    strict = jsonschema.validators.extend(base, type_checker=checker)
    return strict(load_schema(name))


def _subschema(schema: dict, instance) -> dict:
    """Follow $ref and if/then/else to the schema that applies to ``instance``."""
    root = load_schema()
    while True:
        if "$ref" in schema:
            schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
        elif "if" in schema:
            import jsonschema

            ok = jsonschema.Draft202012Validator(schema["if"]).is_valid(instance)
            schema = schema["then"] if ok else schema["else"]
        else:
            return schema


def fill_defaults(instance, schema: dict | None = None):
    """A copy of a schema-valid instance with every missing property's default filled in."""
    schema = _subschema(schema if schema is not None else load_schema(), instance)
    if isinstance(instance, dict) and "properties" in schema:
        out = {}
        for key, sub in schema["properties"].items():
            if key in instance:
                out[key] = fill_defaults(instance[key], sub)
            elif "default" in sub:
                out[key] = fill_defaults(copy.deepcopy(sub["default"]), sub)
        return out
    if isinstance(instance, list) and "items" in schema:
        return [fill_defaults(v, schema["items"]) for v in instance]
    return instance


def _type_name(v) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "list",
        dict: "mapping",
        type(None): "null",
    }.get(type(v), type(v).__name__)


FORMS = {
    "preset": "{preset: vllm | sglang | trtllm, ceiling, max_size, enable_padding}",
    "ranges": "{ranges: [{from, to, step}, ...], include: [...]}",
}
"""capture_sizes' two mapping forms (beside a list), each told apart by its required key."""


def _form(schema) -> str | None:
    """ "preset" or "ranges" when ``schema`` is one of capture_sizes' mapping forms."""
    required = schema.get("required") if isinstance(schema, dict) else None
    return required[0] if required in (["preset"], ["ranges"]) else None


def _other_form(form: str | None) -> tuple[str, list] | None:
    if form is None:
        return None
    other = "ranges" if form == "preset" else "preset"
    return other, list(load_schema()["$defs"][f"size_{other}"]["properties"])


def _formless(instance: dict) -> tuple[str, str]:
    """(message, hint) for a capture_sizes mapping with neither ``preset`` nor ``ranges``."""
    keys = ", ".join(repr(k)[:40] for k in list(instance)[:8]) or "no keys"
    return (
        f"a mapping of capture sizes is the preset form {FORMS['preset']} or the ranges form "
        f"{FORMS['ranges']}; this one has neither 'preset' nor 'ranges' ({keys})",
        "add ranges: [{from: 8, to: 64, step: 8}] beside include"
        if "include" in instance
        else "add preset: vllm, or ranges: [{from: 8, to: 64, step: 8}]; or give a list, "
        "e.g. [1, 2, 4, 8]",
    )


def schema_errors(instance, name: str = "plan.schema.json") -> list[tuple[tuple, str, str, str]]:
    """Every schema violation as (path, code, message, hint); empty when valid."""
    out = []
    formless = set()  # paths of mappings in neither form, reported once
    for e in _validator(name).iter_errors(instance):
        path, v, val = tuple(e.absolute_path), e.validator, e.validator_value
        form = _form(e.schema)
        if form == "preset" and isinstance(e.instance, dict) and "preset" not in e.instance:
            if path not in formless:  # the schema fell through to the preset form
                formless.add(path)
                out.append((path, "missing-key", *_formless(e.instance)))
            continue
        if v == "additionalProperties":
            known = list(e.schema.get("properties", {}))
            other = _other_form(form)
            for key in sorted(set(e.instance) - set(known), key=str):
                hint = did_you_mean(key, known) or f"known keys: {', '.join(known)}"
                if other and key in other[1]:
                    hint = f"'{key}' belongs to the {other[0]} form {FORMS[other[0]]}"
                out.append((path + (key, "<key>"), "unknown-key", f"unknown key '{key}'", hint))
            continue
        if v == "enum":
            hint = did_you_mean(e.instance, val) or ""
            msg = f"{e.instance!r} is not one of {', '.join(map(str, val))}"
            out.append((path, "bad-value", msg, hint))
        elif v == "type":
            want = val if isinstance(val, str) else " or ".join(val)
            got = e.instance
            if isinstance(got, float) and not math.isfinite(got):
                out.append(
                    (
                        path,
                        "not-finite",
                        f"{got} is not a finite number",
                        "write a number (NaN and Infinity are refused)",
                    )
                )
            elif isinstance(got, float) and got.is_integer() and "integer" in want:
                out.append(
                    (
                        path,
                        "wrong-type",
                        f"expected integer, got {got!r}",
                        f"write {int(got)}: integers have no fractional part",
                    )
                )
            else:
                out.append(
                    (
                        path,
                        "wrong-type",
                        f"expected {want}, got {_type_name(got)} {got!r}"[:200],
                        "",
                    )
                )
        elif v in ("minimum", "maximum", "exclusiveMinimum"):
            word = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">"}[v]
            out.append((path, "out-of-range", f"{e.instance!r} must be {word} {val}", ""))
        elif v == "maxItems":
            out.append(
                (
                    path,
                    "too-many-items",
                    f"{len(e.instance)} items; at most {val}",
                    "use a preset or ranges instead of a long list",
                )
            )
        elif v == "required":
            missing = [k for k in val if k not in e.instance]
            out.append((path, "missing-key", f"missing required key(s): {', '.join(missing)}", ""))
        elif v == "const":
            out.append(
                (
                    path,
                    "bad-value",
                    f"{e.instance!r}: this graphplan reads version {val}",
                    f"write version: {val}",
                )
            )
        else:
            out.append((path, "invalid", e.message[:300], ""))
    return out
