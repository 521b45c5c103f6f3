"""Docs that stay true: docs/api.md lists exactly each package's ``__all__``; docs/architecture.md
has a paragraph for every folder and subpackage; every repository path, ``python -m`` module and
``graphplan.*`` name that README.md and docs/ mention exists."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
API = ROOT / "docs" / "api.md"
PACKAGES = [
    "graphplan.compiler",
    "graphplan.runtime",
    "graphplan.runtime.dp",
    "graphplan.models",
    "graphplan.models.hf",
    "graphplan.server",
]


def api_sections(text: str) -> dict[str, list[str]]:
    """``## `graphplan.x` `` headings -> the names of their ``- `name`: ...`` lines."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        heading = re.match(r"## `(graphplan(?:\.\w+)*)`\s*$", line)
        if heading:
            current = sections.setdefault(heading.group(1), [])
        elif current is not None and (item := re.match(r"- `([\w.]+)`:", line)):
            current.append(item.group(1))
    return sections


def test_the_api_page_documents_exactly_the_packages_it_covers():
    assert sorted(api_sections(API.read_text("utf-8"))) == sorted(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_the_api_page_lists_every_exported_name_once_and_nothing_else(package):
    listed = api_sections(API.read_text("utf-8"))[package]
    exported = importlib.import_module(package).__all__
    assert len(listed) == len(set(listed)), f"{package}: a name is listed twice"
    assert sorted(set(exported) - set(listed)) == [], f"exported by {package}, not in docs/api.md"
    assert sorted(set(listed) - set(exported)) == [], f"in docs/api.md, not in {package}.__all__"


def test_the_api_parser_reads_sections_and_names():
    text = (
        "## `graphplan.a`\n\nintro\n\n- `f`: does f\n- `G`: a class\n## `graphplan.b`\n- `h`: x\n"
    )
    assert api_sections(text) == {"graphplan.a": ["f", "G"], "graphplan.b": ["h"]}


def package_folders() -> set[str]:
    """Top-level folders of the repository, and every subpackage (a folder with __init__.py)."""
    top = {"compiler", "runtime", "models", "server", "schemas", "plans", "examples", "bench"}
    top |= {"docs", "tests"}
    subs = {
        str(init.parent.relative_to(ROOT))
        for folder in ("compiler", "runtime", "models", "server")
        for init in (ROOT / folder).glob("*/__init__.py")
    }
    return top | subs


def test_the_architecture_page_has_a_paragraph_for_every_folder():
    text = (ROOT / "docs" / "architecture.md").read_text("utf-8")
    described = {m.rstrip("/") for m in re.findall(r"^\*\*([\w/]+/)", text, re.M)}
    assert package_folders() - described == set(), "folders without a paragraph"
    assert described - package_folders() == set(), "paragraphs for folders that do not exist"


PATH = re.compile(
    r"(?<![\w./-])((?:compiler|runtime|models|server|examples|bench|tests|docs|plans|schemas)"
    r"/[\w./-]*[\w/])(?![\w.*/-])"  # a glob (tests/test_trust_*.py) is not a path
)


def named_paths(text: str) -> list[str]:
    return PATH.findall(text)


def test_every_path_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for i, line in enumerate(doc.read_text("utf-8").splitlines(), 1):
            missing += [
                f"{doc.name}:{i}: {p}"
                for p in named_paths(line)
                if not (ROOT / p.split(":")[0]).exists()
            ]
    assert missing == []


def test_the_path_finder_finds_paths():
    line = (
        "see `examples/server/` and runtime/hf/adapter.py, not tests/test_trust_*.py or x/runtime"
    )
    assert named_paths(line) == ["examples/server/", "runtime/hf/adapter.py"]


def test_every_module_the_docs_run_with_python_m_is_graphplans_and_exists():
    """The repository's folders are importable only as ``graphplan.*`` (``python -m
    examples.server`` was the server's old location); other modules (pip, sglang) are not ours."""
    wrong = []
    for doc in DOCS:
        for module in re.findall(r"python -m ([\w.]+)", doc.read_text("utf-8")):
            top = module.split(".")[0]
            if top in package_folders() or (
                top == "graphplan" and importlib.util.find_spec(module) is None
            ):
                wrong.append(f"{doc.name}: python -m {module}")
    assert wrong == []


def resolves(dotted: str) -> bool:
    """``graphplan.pkg.module.Name...``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for name in parts[k:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_graphplan_name_the_docs_mention_exists():
    missing = []
    for doc in DOCS:
        for dotted in set(re.findall(r"`(graphplan(?:\.\w+)+)", doc.read_text("utf-8"))):
            if not resolves(dotted):
                missing.append(f"{doc.name}: {dotted}")
    assert sorted(missing) == []


def test_the_name_resolver_refuses_old_locations():
    assert resolves("graphplan.models.tiny_llama.make_batch")
    assert resolves("graphplan.runtime.split_point")
    assert not resolves("graphplan.runtime.breakable")
    assert not resolves("graphplan.runtime.hf")
