"""The code's own rules (DESIGN.md): no import circles in either half, no module reading another's
private attributes, no string-keyed access to the resolved table outside its serialisation, no
module over MAX_MODULE_LINES lines.

These read the source with ``ast``; README's contributing section names this file as the check.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HALVES = {
    "compiler": "graphplan.compiler",
    "runtime": "graphplan.runtime",
    "models": "graphplan.models",
    "server": "graphplan.server",
}


def modules_of(folder: str, package: str) -> dict[str, Path]:
    """Module name -> file of every module of one package folder."""
    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT / folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join([package, *parts])] = path
    return out


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in HALVES.items():
        out |= modules_of(folder, package)
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


def is_super_call(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


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
                or is_super_call(node.value)  # an override calling its own class's method
            ):
                continue
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


# A maintainer's script, run in a scratch venv beside an engine's wheel: argparse has no public
# list of a parser's actions, so reading the engine's parser means reading argparse's own.
READS_ARGPARSE = {"compiler/engines/flags_data/dump_flags.py"}


def test_private_reads_flags_another_objects_private_names_only(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)  # paths shown from the root
    src = tmp_path / "m.py"
    src.write_text(
        "class B(A):\n    def f(self, other):\n        super()._g()\n        self._h = 1\n"
        "        return other._x, torch._dynamo\n"
    )
    assert private_reads(src) == ["m.py:5: other._x"]


def test_no_module_reads_another_objects_private_attributes():
    found = []
    for folder in ("compiler", "runtime", "models", "server", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if str(path.relative_to(ROOT)) not in READS_ARGPARSE:
                found += private_reads(path)
    assert found == []


SERIALISATION = {
    "compiler/table_format.py",
    "compiler/table_fields.py",
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


# -- one place per rule --------------------------------------------------------------------------
RULE_FOLDERS = ("compiler", "runtime", "server", "models", "bench", "examples")
Q_NAMES = {"q", "decode_query_len"}  # what code calls decode_query_len


def _leaf(node) -> str:
    """``x`` for ``x``, ``b`` for ``a.b``; "" for anything else."""
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def _times_q(node) -> bool:
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mult)
        and (_leaf(node.left) in Q_NAMES or _leaf(node.right) in Q_NAMES)
    )


def _is_json(node) -> bool:
    return isinstance(node, ast.Constant) and node.value == ".json"


def _is_json_test(node) -> bool:
    """``x.endswith(".json")`` or ``x.suffix == ".json"``: "is this path a compiled table?"."""
    if isinstance(node, ast.Call) and _leaf(node.func) == "endswith":
        return any(_is_json(a) for a in node.args)
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        return any(_leaf(x) == "suffix" for x in sides) and any(_is_json(x) for x in sides)
    return False


def rule_copies(source: str) -> list[str]:
    """Places in ``source`` that write a batch-shape rule out instead of calling its function:
    uniform decode (``n == q * num_reqs``: records.is_uniform_decode), the top of the decode
    range (``q * max_num_seqs``: records.decode_token_range) and "is this path a compiled
    table?" (``".json"``: plan_or_table.is_table_path)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        eq = isinstance(node, ast.Compare) and any(isinstance(o, ast.Eq) for o in node.ops)
        if eq and any(_times_q(side) for side in (node.left, *node.comparators)):
            out.append(f"{node.lineno}: uniform decode: {ast.unparse(node)}")
        elif _times_q(node) and "seqs" in _leaf(node.left) + _leaf(node.right):
            out.append(f"{node.lineno}: decode range: {ast.unparse(node)}")
        elif _is_json_test(node):
            out.append(f"{node.lineno}: plan or table: {ast.unparse(node)}")
    return sorted(out, key=lambda found: int(found.split(":")[0]))


RULE_HOMES = {
    "compiler/records.py": "where the batch-shape rules are defined",
    "compiler/plan_or_table.py": "where plan-or-table loading is defined",
    "compiler/table.py": "the router writes uniform decode out (a call costs ~9% of a route); "
    "test_batch_rules checks that the two agree",
    "compiler/sizes.py": "the vllm preset mirrors vLLM's own default (max_num_seqs * q * 2)",
    "compiler/engines/vllm_rules.py": "mirrors vLLM's default max capture size",
}


def test_each_batch_shape_rule_is_written_once():
    found = []
    for folder in RULE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel not in RULE_HOMES:
                found += [f"{rel}:{c}" for c in rule_copies(path.read_text("utf-8"))]
    assert found == []


def test_the_rule_finder_finds_each_rule_written_out():
    assert rule_copies(
        "uniform = mql == table.q and n == table.q * r\n"
        "top = q * max_num_seqs\n"
        "is_table = path.endswith('.json') or p.suffix == '.json'\n"
        "name = f'rank{r}.json'\n"
    ) == [
        "1: uniform decode: n == table.q * r",
        "2: decode range: q * max_num_seqs",
        "3: plan or table: path.endswith('.json')",
        "3: plan or table: p.suffix == '.json'",
    ]


# The seam between the halves: the table (its records, router, answer, file format and errors) and
# the calibration profile's file format. The rest of the compiler (the YAML stack, the CLI, the
# tools, the engines) is never the runtime's to import.
SEAM = {
    "graphplan.compiler",
    "graphplan.compiler.errors",
    "graphplan.compiler.records",
    "graphplan.compiler.route",
    "graphplan.compiler.table",
    "graphplan.compiler.table_format",
    "graphplan.compiler.profile_format",
}


def test_the_runtime_imports_only_the_table_seam_of_the_compiler():
    compiler = {m: p for m, p in modules_of("compiler", "graphplan.compiler").items()}
    found = set()
    for name, path in modules_of("runtime", "graphplan.runtime").items():
        found |= {m for m in imports_of(name, path, set(compiler))}
    assert found and found <= SEAM, sorted(found - SEAM)


def test_the_seam_check_sees_a_runtime_import_of_the_compilers_cli(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("from graphplan.compiler.cli import main\nfrom ..table import x\n")
    known = set(modules_of("compiler", "graphplan.compiler"))
    assert imports_of("graphplan.runtime.x", path, known) - SEAM == {"graphplan.compiler.cli.main"}


# Small modules (DESIGN.md, house style 9): a module that outgrows this splits by responsibility.
MAX_MODULE_LINES = 400
SIZED_FOLDERS = ("compiler", "runtime", "models", "server", "schemas", "bench", "examples")


def long_modules(root: Path, folders=SIZED_FOLDERS, limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path: N lines`` for every .py file under ``folders`` of ``root`` longer than ``limit``."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            n = len(path.read_text("utf-8").splitlines())
            if n > limit:
                out.append(f"{path.relative_to(root).as_posix()}: {n} lines")
    return out


def test_no_module_is_over_400_lines():
    long = long_modules(ROOT)
    assert long == [], (
        f"modules over {MAX_MODULE_LINES} lines: {', '.join(long)}; split each into cohesive "
        "modules (keep its public names importable where they were)"
    )


def test_the_size_check_names_a_long_module(tmp_path):
    (tmp_path / "runtime" / "sub").mkdir(parents=True)
    (tmp_path / "runtime" / "sub" / "big.py").write_text("x = 1\n" * 401)
    (tmp_path / "runtime" / "small.py").write_text("x = 1\n" * 400)
    assert long_modules(tmp_path, ("runtime",)) == ["runtime/sub/big.py: 401 lines"]
