"""YAML text -> (data, positions) under the plan's bounds, with either of PyYAML's readers
(libyaml's ``CSafeLoader`` where installed, else the pure-Python one): duplicate and non-scalar
keys, nesting depth, recursive aliases and alias expansion, integer size. Every failure is a
PlanError located at file:line:col. A ``--set`` value is read the same way (text that is not YAML
stays a string)."""

from __future__ import annotations

from dataclasses import replace

import yaml

from .errors import PlanError
from .limits import MAX_DEPTH, MAX_NODES, MAX_PLAN_BYTES
from .limits import fail as _fail

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_INT_TAG = "tag:yaml.org,2002:int"


def _positions(node, path=(), out=None, file="<plan>", walk=None) -> dict:
    """Walk a composed YAML node: record positions, reject duplicate and non-scalar keys, and
    bound nesting, recursive aliases and alias expansion (a "billion laughs" plan)."""
    out = {} if out is None else out
    walk = {"open": set(), "size": {}, "total": 0} if walk is None else walk
    out.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
    if id(node) in walk["open"]:
        _fail(
            file,
            "recursive-alias",
            "an alias refers to a node that contains it",
            "remove the alias",
            node.start_mark.line + 1,
            node.start_mark.column + 1,
        )
    if id(node) in walk["size"]:  # an alias seen before: count its expansion, positions known
        walk["total"] += walk["size"][id(node)]
    else:
        before = walk["total"]
        walk["total"] += 1
        walk["open"].add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}  # key -> its line
            for k, v in node.value:
                if not isinstance(k, yaml.ScalarNode):
                    _fail(
                        file,
                        "bad-key",
                        "a key must be a plain word, not a list or mapping",
                        "write `name: value`",
                        k.start_mark.line + 1,
                        k.start_mark.column + 1,
                    )
                key = k.value
                if key in seen:
                    _fail(
                        file,
                        "duplicate-key",
                        f"key '{key}' appears twice (first at line {seen[key]})",
                        "remove one of them",
                        k.start_mark.line + 1,
                        k.start_mark.column + 1,
                    )
                seen[key] = k.start_mark.line + 1
                out.setdefault(
                    path + (key, "<key>"), (k.start_mark.line + 1, k.start_mark.column + 1)
                )
                _positions(v, path + (key,), out, file, walk)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                _positions(v, path + (i,), out, file, walk)
        elif node.tag == _INT_TAG and len(node.value) > 300:  # int("9" * 5000) is a ValueError
            _fail(
                file,
                "out-of-range",
                f"a {len(node.value)}-character integer; plan integers have a few digits",
                "use a plan-sized number",
                node.start_mark.line + 1,
                node.start_mark.column + 1,
            )
        walk["open"].discard(id(node))
        walk["size"][id(node)] = walk["total"] - before
    if walk["total"] > MAX_NODES:
        _fail(
            file,
            "too-large",
            f"more than {MAX_NODES} values (aliases expanded)",
            "plans are small: use a preset or ranges, and no nested aliases",
            node.start_mark.line + 1,
            node.start_mark.column + 1,
        )
    return out


def _check_depth(text: str, file: str) -> None:
    """libyaml composes recursively in C: a plan nested ~100k deep would crash the process, so
    the event stream (a flat state machine) is checked first. libyaml 0.2.6 (bundled from PyYAML
    6.0.4) refuses nesting past 1000 levels itself, and may do so while scanning ahead, before
    any event shows the depth: that refusal is the same too-deep error, located by the
    pure-Python reader, which streams (and stops at the plan's own limit)."""
    try:
        _walk_depth(text, file, _Loader)
    except yaml.YAMLError as e:
        if "nesting depth" not in str(e):
            raise
        _walk_depth(text, file, yaml.SafeLoader)  # raises too-deep where MAX_DEPTH is crossed
        mark = getattr(e, "problem_mark", None)
        _fail(
            file,
            "too-deep",
            f"nested more than {MAX_DEPTH} levels",
            "plans nest a few levels",
            mark.line + 1 if mark else 0,
            mark.column + 1 if mark else 0,
        )


def _walk_depth(text: str, file: str, loader) -> None:
    depth = 0
    for ev in yaml.parse(text, Loader=loader):
        if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                _fail(
                    file,
                    "too-deep",
                    f"nested more than {MAX_DEPTH} levels",
                    "plans nest a few levels",
                    ev.start_mark.line + 1,
                    ev.start_mark.column + 1,
                )
        elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def parse_yaml(text: str, file: str) -> tuple[object, dict]:
    loader = _Loader(text)
    try:
        _check_depth(text, file)
        node = loader.get_single_node()
        if node is None:
            _fail(
                file,
                "empty",
                "the plan is empty",
                "start from a shipped plan, e.g. plans/llama3-8b-h100.yaml",
            )
        positions = _positions(node, file=file)
        data = loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        _fail(
            file,
            "yaml",
            f"invalid YAML: {problem}",
            "check indentation, colons and quotes",
            mark.line + 1 if mark else 0,
            mark.column + 1 if mark else 0,
        )
    finally:
        loader.dispose()
    return data, positions


def parse_set_value(text: str, key: str, file: str = "<plan>"):
    """One ``--set KEY=VALUE`` value, read as YAML under the plan file's bounds (size, depth,
    aliases); text that is not YAML stays a string. An error names the plan ``file`` it applies
    to and the ``--set`` itself: ``plan.yaml: error[too-deep]: --set a.b=[[[...: ...``."""
    try:
        return _set_value(text, key)
    except PlanError as e:
        d = e.diagnostics[0]
        message = f"--set {key}={text}: {d.message}"
        raise PlanError([replace(d, file=file, line=0, col=0, message=message)]) from None


def _set_value(text: str, key: str):
    where = f"--set {key}"
    if len(text) > MAX_PLAN_BYTES:
        _fail(where, "too-large", f"{len(text)} characters; a value is at most {MAX_PLAN_BYTES}")
    if not text.strip():
        return ""
    loader = _Loader(text)
    try:
        _check_depth(text, where)
        node = loader.get_single_node()
        if node is None:
            return None
        _positions(node, file=where)
        return loader.construct_document(node)
    except yaml.YAMLError:
        return text
    finally:
        loader.dispose()
