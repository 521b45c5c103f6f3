"""A strict checker for the JSON Schema keywords ``plan.schema.json`` uses, in plain Python.

The runtime has no jsonschema, yet a table it loads embeds a plan that must be checked before it is
resolved again (``table_format.verify_against_plan``): a forged plan with ``max_loras: 10**9`` or
``separate_base: "yes"`` must be refused, not resolved. Stricter than JSON Schema on purpose:
``integer`` means a JSON integer (``64.0`` is refused), ``number`` must be finite, and booleans
are never numbers. Returns the first problem as ``(path, message)``, or None.
"""

from __future__ import annotations

import math
import re

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) in (int, float) and math.isfinite(v),
    "null": lambda v: v is None,
}


def first_error(instance, schema: dict, root: dict | None = None, path: str = "") -> tuple | None:
    root = root if root is not None else schema
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    if "if" in schema:
        branch = "then" if first_error(instance, schema["if"], root, path) is None else "else"
        if branch in schema:
            err = first_error(instance, schema[branch], root, path)
            if err:
                return err
    where = path or "(top)"
    t = schema.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        if not any(_TYPES[x](instance) for x in types):
            return where, f"expected {' or '.join(types)}, got {type(instance).__name__}"
    if "const" in schema and (
        instance != schema["const"] or type(instance) is not type(schema["const"])
    ):
        return where, f"must be {schema['const']!r}"
    if "enum" in schema and not any(
        instance == e and type(instance) is type(e) for e in schema["enum"]
    ):
        return where, f"{instance!r} is not one of {schema['enum']}"
    if type(instance) in (int, float):
        if "minimum" in schema and instance < schema["minimum"]:
            return where, f"{instance} is below {schema['minimum']}"
        if "maximum" in schema and instance > schema["maximum"]:
            return where, f"{instance} is above {schema['maximum']}"
        if "exclusiveMinimum" in schema and instance <= schema["exclusiveMinimum"]:
            return where, f"{instance} must be above {schema['exclusiveMinimum']}"
    if isinstance(instance, str):
        if len(instance) < schema.get("minLength", 0) or len(instance) > schema.get(
            "maxLength", 1 << 62
        ):
            return where, "string length out of range"
        if "pattern" in schema and not re.search(schema["pattern"], instance):
            return where, f"{instance!r} does not match {schema['pattern']}"
    if isinstance(instance, list):
        if len(instance) > schema.get("maxItems", 1 << 62) or len(instance) < schema.get(
            "minItems", 0
        ):
            return where, f"{len(instance)} items is out of range"
        if schema.get("uniqueItems") and len({repr(x) for x in instance}) != len(instance):
            return where, "items must be distinct"
        if "items" in schema:
            for i, item in enumerate(instance):
                err = first_error(item, schema["items"], root, f"{path}[{i}]")
                if err:
                    return err
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in instance:
                return where, f"missing {key!r}"
        if schema.get("additionalProperties") is False:
            extra = sorted(set(map(str, instance)) - set(props))
            if extra:
                return where, f"unknown key {extra[0]!r}"
        for key, sub in props.items():
            if key in instance:
                err = first_error(instance[key], sub, root, f"{path}.{key}" if path else key)
                if err:
                    return err
    return None
