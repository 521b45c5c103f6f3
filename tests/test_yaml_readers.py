"""The plan's YAML bounds hold with either of PyYAML's readers and whichever PyYAML release is
installed: the pure-Python one, libyaml (``CSafeLoader``) as installed here, and libyaml as
PyYAML 6.0.4 bundles it (0.2.6), whose scanner reads ahead and refuses nesting past 1000 levels
before the parser has produced an event. Nesting past ``MAX_DEPTH`` is ``too-deep`` at its line,
in a plan file and in a ``--set`` value alike; never ``yaml``, and never a string."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from yaml.scanner import ScannerError

from graphplan.compiler import PlanError, compile_plan
from graphplan.compiler import yaml_read as L
from graphplan.compiler.cli import main
from graphplan.compiler.limits import MAX_DEPTH

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "plans" / "tiny-llama.yaml")


class ScanAheadLoader(yaml.SafeLoader):
    """libyaml 0.2.6's scanner, in Python: it scans to the end before the first event, and
    refuses flow nesting past 1000 levels with "exceeded maximum nesting depth"."""

    def need_more_tokens(self) -> bool:
        return not self.done

    def fetch_flow_collection_start(self, TokenClass) -> None:
        if self.flow_level >= 1000:
            raise ScannerError(
                "while increasing flow level",
                None,
                "exceeded maximum nesting depth",
                self.get_mark(),
            )
        super().fetch_flow_collection_start(TokenClass)


READERS = [
    pytest.param(yaml.SafeLoader, id="pure-python"),
    pytest.param(
        getattr(yaml, "CSafeLoader", None),
        id="libyaml",
        marks=pytest.mark.skipif(not hasattr(yaml, "CSafeLoader"), reason="PyYAML without libyaml"),
    ),
    pytest.param(ScanAheadLoader, id="libyaml-0.2.6"),
]


@pytest.fixture(params=READERS)
def reader(request, monkeypatch):
    monkeypatch.setattr(L, "_Loader", request.param)
    return request.param


def deep(n: int, shape: str) -> str:
    """A plan's third line, ``lora:``, nested ``n`` levels in one YAML style."""
    if shape == "flow-list":
        return "lora: " + "[" * n + "]" * n
    if shape == "flow-mapping":
        return "lora: " + "{a: " * n + "1" + "}" * n
    if shape == "mixed":
        return "lora: " + "[{a: " * (n // 2) + "1" + "}]" * (n // 2)
    if shape == "block-mapping":
        return "lora:\n" + "".join(" " * (i + 1) + "k:\n" for i in range(n)) + " " * (n + 1) + "1"
    assert shape == "block-list"
    return "lora:\n" + "".join(" " * (i + 1) + "-\n" for i in range(n)) + " " * (n + 1) + "1"


@pytest.mark.parametrize(
    "n, shape",
    [
        (200_000, "flow-list"),
        (1001, "flow-list"),
        (MAX_DEPTH + 1, "flow-list"),
        (5000, "flow-mapping"),
        (5000, "mixed"),
        (2000, "block-mapping"),
        (2000, "block-list"),
    ],
)
def test_a_plan_nested_past_the_limit_is_too_deep_at_its_line(tmp_path, reader, n, shape):
    path = tmp_path / "plan.yaml"
    path.write_text(f"version: 1\nname: x\n{deep(n, shape)}\n")
    with pytest.raises(PlanError) as e:
        compile_plan(path)
    [d] = e.value.diagnostics
    assert (d.code, d.file, d.message) == (
        "too-deep",
        str(path),
        f"nested more than {MAX_DEPTH} levels",
    )
    assert d.line >= 3


def test_the_depth_is_located_where_the_limit_is_crossed(tmp_path, reader):
    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nname: x\nlora: " + "[" * 5000 + "]" * 5000 + "\n")
    # the plan's mapping is level 1: the 32nd "[" is level 33
    with pytest.raises(PlanError, match=rf"plan.yaml:3:{6 + MAX_DEPTH}: error\[too-deep\]"):
        compile_plan(path)


@pytest.mark.parametrize("n", [MAX_DEPTH + 1, 1001, 3000, 100_000])
def test_a_set_value_nested_past_the_limit_is_too_deep_not_a_string(capsys, reader, n):
    code = main(["validate", TINY, "--set", "lora=" + "[" * n + "]" * n])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith(f"{TINY}: error[too-deep]: --set lora=[[[")
    assert f"nested more than {MAX_DEPTH} levels" in err and len(err) < 1000


def test_an_unclosed_set_value_nested_past_the_limit_is_too_deep(capsys, reader):
    code = main(["validate", TINY, "--set", "lora=" + "[" * 3000])
    assert code == 2 and "error[too-deep]" in capsys.readouterr().err


def test_other_yaml_errors_stay_yaml_errors_and_set_text_stays_text(tmp_path, reader, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nname: [x\n")
    with pytest.raises(PlanError, match=r"plan.yaml:3:1: error\[yaml\]: invalid YAML"):
        compile_plan(path)
    assert L.parse_set_value("a: b: c", "name") == "a: b: c"


def test_shipped_plans_compile_the_same_with_either_reader(monkeypatch):
    plans = sorted((ROOT / "plans").glob("*.yaml"))
    assert plans
    fingerprints = {}
    for param in READERS:
        loader = param.values[0]
        if loader is None:
            continue
        monkeypatch.setattr(L, "_Loader", loader)
        fingerprints[param.id] = [compile_plan(p).fingerprint for p in plans]
    assert len({tuple(f) for f in fingerprints.values()}) == 1, fingerprints
