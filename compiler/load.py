"""Read a plan: file or dict -> (Jinja2) -> YAML with positions -> JSON Schema -> defaults -> PlanSpec.

Every failure is a PlanError whose diagnostics carry file, line and column.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn

from .errors import Diagnostic, PlanError
from .limits import MAX_DEPTH, MAX_PLAN_BYTES, check_value, read_regular_file
from .schema import fill_defaults, schema_errors
from .spec import PlanSpec, plan_from_dict
from .yaml_read import parse_set_value, parse_yaml

__all__ = [
    "MAX_DEPTH",
    "MAX_PLAN_BYTES",
    "LoadedPlan",
    "load_plan",
    "parse_set_value",
    "parse_yaml",
    "read_plan",
    "read_text",
]


@dataclass
class LoadedPlan:
    spec: PlanSpec
    plan: dict
    """The plan as written, every default filled in."""
    file: str = "<plan>"
    positions: dict = field(default_factory=dict)
    """Plan path tuple -> (line, col), 1-based, for diagnostics."""

    def locate(self, d: Diagnostic) -> Diagnostic:
        """Attach file:line:col to a diagnostic from its dotted path (nearest ancestor known)."""
        line, col = _position(self.positions, _parse_path(d.path))
        return replace(d, file=self.file, line=line, col=col)


def _fail(
    file: str, code: str, message: str, hint: str = "", line: int = 0, col: int = 0
) -> NoReturn:
    raise PlanError(
        [
            Diagnostic(
                code=code,
                message=message,
                hint=hint,
                severity="error",
                file=file,
                line=line,
                col=col,
            )
        ]
    )


def read_text(path: Path) -> str:
    f = str(path)
    raw = read_regular_file(path)  # regular files only, size checked before reading
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        _fail(
            f,
            "not-utf8",
            f"byte 0x{raw[e.start]:02x} is not UTF-8",
            "save the plan as UTF-8",
            line,
            col,
        )


def check_overrides(overrides: dict, file: str) -> None:
    """``--set`` values (and API/server dicts) get the bounds of the plan file."""
    for key, value in overrides.items():
        if not isinstance(key, str) or not key or len(key) > 256:
            _fail(
                file,
                "bad-override",
                f"--set {str(key)[:64]!r}: a key is a dotted plan path or a template variable name",
                "e.g. --set scheduler.max_num_seqs=128",
            )
        try:
            check_value(value, file, key)
        except PlanError as e:
            d = e.diagnostics[0]
            shown = value if isinstance(value, str) else repr(value)
            message = f"--set {key}={shown}: {d.message}"
            raise PlanError([replace(d, path="", message=message)]) from None


def _locate_bounds(data, positions: dict, file: str) -> None:
    """The bounds of check_value on a plan read from YAML, located at the offending value."""
    try:
        check_value(data, file)
    except PlanError as e:
        located = []
        for d in e.diagnostics:
            line, col = _position(positions, _parse_path(d.path))
            located.append(replace(d, line=line, col=col))
        raise PlanError(located) from None


def _parse_path(dotted: str) -> tuple:
    out: list = []
    for part in dotted.replace("]", "").split("."):
        if not part:
            continue
        name, *idx = part.split("[")
        if name:
            out.append(name)
        out += [int(i) for i in idx]
    return tuple(out)


def _position(positions: dict, path: tuple) -> tuple[int, int]:
    while path and path not in positions:
        path = path[:-1]
    return positions.get(path, (0, 0))


def apply_overrides(data: dict, overrides: dict, file: str) -> dict:
    """``--set a.b=value`` on a plain YAML plan: set nested keys (values are YAML scalars)."""
    data = dict(data)
    for dotted, value in overrides.items():
        node, parts = data, dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return data


def read_plan(path: Path, overrides: dict) -> tuple[str, object, dict]:
    """A plan file as written: (text after templating, data with overrides, positions); no
    schema, no defaults. ``plan optimize`` rewrites plans from this."""
    file = str(path)
    check_overrides(overrides, file)
    text = read_text(path)
    if path.name.endswith(".j2"):
        from .template import render  # Jinja2 only when a template is used

        text = render(text, overrides, file)
        overrides = {}
    if not text.strip():
        _fail(
            file,
            "empty",
            "the plan is empty",
            "start from a shipped plan, e.g. plans/llama3-8b-h100.yaml",
        )
    data, positions = parse_yaml(text, file)
    _locate_bounds(data, positions, file)
    if overrides:
        if not isinstance(data, dict):
            _fail(file, "not-a-mapping", "the plan must be a mapping of keys to values")
        data = apply_overrides(data, overrides, file)
    return text, data, positions


def load_plan(source, overrides: dict | None = None) -> LoadedPlan:
    """Load and validate a plan from a path or a dict (overrides: template variables for a
    ``.j2`` plan, dotted keys for a plain one)."""
    overrides = dict(overrides or {})
    data: object
    positions: dict  # plan path -> (line, col)
    dotted = overrides  # the ones set as dotted plan keys (a template's are its variables)
    if isinstance(source, dict):
        check_overrides(overrides, "<plan>")
        check_value(source, "<plan>")
        file, data, positions = "<plan>", apply_overrides(source, overrides, "<plan>"), {}
    elif isinstance(source, (str, os.PathLike)):
        file = str(source)
        _, data, positions = read_plan(Path(source), overrides)
        dotted = {} if Path(source).name.endswith(".j2") else overrides
    else:
        raise TypeError(
            f"compile_plan: source must be a path or a dict, not {type(source).__name__}"
        )
    if not isinstance(data, dict):
        _fail(
            file,
            "not-a-mapping",
            f"the plan must be a mapping of keys to values, not {type(data).__name__}",
            "start with `version: 1` and `name: ...`",
            1,
            1,
        )
    errors = schema_errors(data)
    if errors:
        located = []
        for path, code, message, hint in errors:
            line, col = _position(positions, path)
            key = _override_of(path, dotted)
            if key is not None:  # the value came from --set: the file's line holds another
                line, col = 0, 0
                message = f"--set {key}={_shown(dotted[key])}: {message}"
            located.append(
                Diagnostic(
                    code=code,
                    path=_dotted(path),
                    message=message,
                    hint=hint,
                    severity="error",
                    file=file,
                    line=line,
                    col=col,
                )
            )
        raise PlanError(sorted(located, key=lambda d: (d.line, d.col)))
    plan = fill_defaults(data)
    return LoadedPlan(spec=plan_from_dict(plan), plan=plan, file=file, positions=positions)


def _override_of(path: tuple, overrides: dict) -> str | None:
    """The ``--set`` key whose value holds plan ``path`` (the longest one), or None."""
    keys = [k for k in overrides if path[: len(k.split("."))] == tuple(k.split("."))]
    return max(keys, key=len) if keys else None


def _shown(value) -> str:
    """An override's value as a ``--set`` would write it (JSON is YAML), cut to a glance."""
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else f"{text[:60]}...[{len(text)} characters]"


def _dotted(path: tuple) -> str:
    out = ""
    for i, p in enumerate(path):
        if p == "<key>":
            continue
        is_key = i + 1 < len(path) and path[i + 1] == "<key>"  # a mapping key, maybe not a str
        out += f"[{p}]" if isinstance(p, int) and not is_key else (f".{p}" if out else str(p))
    return out
