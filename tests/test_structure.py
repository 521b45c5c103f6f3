"""The code's own rules (DESIGN.md): no import circles in either half, no module reading another's
private attributes, no string-keyed access to the resolved table outside its serialisation.

These read the source with ``ast``; README's contributing section names this file as the check.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HALVES = {"compiler": "graphplan.compiler", "runtime": "graphplan.runtime"}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in HALVES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """graphplan modules ``path`` imports, at any depth (function-level imports count too)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import submodule` imports the submodule; `from pkg import name`, pkg
            names = [s for s in subs if s in known] or [base]
        else:
            continue
        found |= {n for n in names if n in known and n != name}
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_neither_half_has_an_import_circle():
    graph = import_graph()
    assert len(graph) > 30  # the walk found the modules
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def private_reads(path: Path) -> list[str]:
    """``x._name`` where x is not self/cls and not a third-party module (torch._dynamo and the
    like are those libraries' own spellings)."""
    tree = ast.parse(path.read_text("utf-8"))
    third_party = {
        "torch",
        "os",
        "sys",
        "np",
        "numpy",
        "threading",
        "socket",
        "gc",
        "json",
        "collections",
        "dist",
        "dynamo",
        "http",
        "socketserver",
    }
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if (
                isinstance(base, ast.Name)
                and base.id in {"self", "cls"} | third_party
                and not isinstance(node.value, ast.Name)
                or isinstance(node.value, ast.Name)
                and node.value.id in {"self", "cls"} | third_party
            ):
                continue
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_reads_another_objects_private_attributes():
    found = []
    for folder in ("compiler", "runtime", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += private_reads(path)
    assert found == []


SERIALISATION = {
    "compiler/table_format.py",
    "compiler/load.py",
    "compiler/tools/tuned_plan.py",
    "compiler/spec.py",
    "compiler/schema.py",
}


def test_the_resolved_table_is_read_by_attribute_outside_its_serialisation():
    pattern = re.compile(r"\bresolved\[|\.resolved\b|\.plan\[|\[\"resolved\"\]|\[\"settings\"\]")
    found = []
    for folder in ("compiler", "runtime", "examples", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in SERIALISATION:
                continue
            for i, line in enumerate(path.read_text("utf-8").splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{rel}:{i}: {line.strip()}")
    assert found == []
