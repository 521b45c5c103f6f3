"""Fuzz: mutated shipped plans never make `plan compile` or `plan validate` raise, exit other than 0
or 2, run code, take long, or leave a file behind.

Seeded and bounded: every mutation is reproducible from (plan, seed), the whole file runs in
seconds. A failure message names the plan, the mutation and the seed.
"""

from __future__ import annotations

import contextlib
import copy
import io
import random
import time
from pathlib import Path

import pytest
import yaml

from graphplan.compiler import cli

ROOT = Path(__file__).resolve().parents[1]
PLANS = sorted(p for p in (ROOT / "plans").iterdir() if p.is_file())
TEMPLATE_SETS = {"sweep.yaml.j2": ["--set", "max_num_seqs=64", "--set", "spec_tokens=2"]}
MUTATIONS_PER_PLAN = 120

_INTS = [0, -1, -(2**31), 1, 2, 3, 7, 64, 513, 4097, 2**31, 2**63, 10**30]
_SCALARS = _INTS + [
    "",
    "x",
    "FULL",
    "NONE",
    "vllm",
    "über",
    "0x10",
    "1e3",
    1.5,
    -0.0,
    True,
    False,
    None,
    [],
    {},
    [1, 2],
    {"a": 1},
    float("inf"),
    float("nan"),
]


def _paths(node, path=()):
    """Every (path, value) in a nested plan dict."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _set(root, path, value):
    node = root
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def _delete(root, path):
    node = root
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]


def mutate_structure(data: dict, rnd: random.Random) -> str:
    """Delete keys, swap types, put odd numbers and strings in, add unknown keys; dump as YAML."""
    for _ in range(rnd.randint(1, 4)):
        paths = [p for p, _ in _paths(data) if p]
        if not paths:
            break
        path = rnd.choice(paths)
        op = rnd.randrange(5)
        if op == 0:
            _delete(data, path)
        elif op == 1:
            _set(data, path, rnd.choice(_SCALARS))
        elif op == 2:
            _set(data, path, rnd.choice(_INTS) * rnd.choice([1, 1, 1000]))
        elif op == 3:
            _set(
                data,
                path,
                "".join(rnd.choice("abcdefg_-. ÿ{}[]:#") for _ in range(rnd.randint(0, 12))),
            )
        else:
            parent = path[:-1]
            node = data
            for p in parent:
                node = node[p]
            if isinstance(node, dict):
                node[rnd.choice(["strict", "mode", "extra", "max_num_seq", "ranges", 1])] = (
                    rnd.choice(_SCALARS)
                )
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def mutate_text(text: str, rnd: random.Random) -> bytes:
    """Line and byte damage: duplicates, garbage lines, truncation, random bytes, swaps."""
    lines = text.splitlines(keepends=True) or [""]
    op = rnd.randrange(6)
    if op == 0:
        i = rnd.randrange(len(lines))
        lines.insert(rnd.randrange(len(lines) + 1), lines[i])
    elif op == 1:
        garbage = rnd.choice(
            [
                "}",
                "- -",
                "\t  x: [",
                "version: 1",
                "name: &a [*a]",
                "? [a]: 1",
                "::::",
                "'",
                "!!python/object:os.system x",
                "a: {{ b }}",
                "%YAML 9",
                "---",
                "...",
                "@",
                "\x00",
                "name: " + "[" * 64,
            ]
        )
        lines.insert(rnd.randrange(len(lines) + 1), garbage + "\n")
    elif op == 2:
        return text.encode()[: rnd.randrange(len(text) + 1)]
    elif op == 3:
        raw = bytearray(text.encode())
        for _ in range(rnd.randint(1, 8)):
            raw[rnd.randrange(len(raw))] = rnd.randrange(256)
        return bytes(raw)
    elif op == 4:
        i, j = rnd.randrange(len(lines)), rnd.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    else:
        i = rnd.randrange(len(lines))
        lines[i] = lines[i].replace(":", rnd.choice(["", " :", ":  ", "=", "::"]), 1)
    return "".join(lines).encode()


def run_compile(path: Path, out: Path, extra: list[str]) -> tuple[int, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["compile", str(path), "-o", str(out), *extra])
    return code, stderr.getvalue()


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_mutated_plans_exit_0_or_2_without_traceback_or_stray_output(plan, tmp_path):
    extra = TEMPLATE_SETS.get(plan.name, [])
    text = plan.read_text("utf-8")
    data = None if plan.name.endswith(".j2") else yaml.safe_load(text)
    # a template is damaged as text only, and its --set values are fuzzed too
    seen = {0: 0, 1: 0, 2: 0}
    for seed in range(MUTATIONS_PER_PLAN):
        rnd = random.Random(f"{plan.name}:{seed}")
        target = tmp_path / (plan.name if seed % 2 else f"m{seed}{plan.suffix}")
        args = list(extra)
        if data is not None and rnd.random() < 0.5:
            target.write_text(mutate_structure(copy.deepcopy(data), rnd), "utf-8")
            how = "structure"
        else:
            target.write_bytes(mutate_text(text, rnd))
            how = "text"
            if extra and rnd.random() < 0.3:
                args = [
                    "--set",
                    f"max_num_seqs={rnd.choice(_SCALARS)!s}",
                    "--set",
                    f"spec_tokens={rnd.choice(_INTS)}",
                ]
        out = tmp_path / "table.json"
        try:
            code, err = run_compile(target, out, args)
        except BaseException as e:
            pytest.fail(f"{plan.name} seed {seed} ({how}): {type(e).__name__}: {e}")
        where = f"{plan.name} seed {seed} ({how})"
        assert code in (0, 2), f"{where}: exit {code}: {err[-500:]}"  # 2: an invalid plan
        assert "Traceback" not in err, where
        assert out.exists() == (code == 0), where
        if code:
            assert "error" in err, f"{where}: exit {code} without an error message"
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert not leftovers, where
        out.unlink(missing_ok=True)
        target.unlink()
        seen[code] += 1
    # the mutations reach both outcomes, so the test exercises failures and successes
    assert seen[2] > 0, seen


# -- hostile mutations: what an attacker would write, not only what a typo makes ---------------

_HOSTILE_VALUES = [
    "64.0",
    "1.0",
    "2.0",
    ".nan",
    ".inf",
    "-.inf",
    "9" * 5000,
    "1e400",
    "0x" + "f" * 400,
    "[" * 40 + "]" * 40,
    "&a [*a]",
    "!!python/object/apply:os.system ['touch PWNED']",
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "'" + "x" * 10000 + "'",
]
_HOSTILE_LINES = [
    "x: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\ny: &a1 [*a0, *a0, *a0, *a0, *a0, *a0, *a0, *a0]\n"
    "z: &a2 [*a1, *a1, *a1, *a1, *a1, *a1, *a1, *a1]\nw: [*a2, *a2, *a2, *a2, *a2, *a2, *a2]",
    "limits: {max_graphs: 1}",
    "limits: {max_graphs: 1.0}",
    "version: 1.0",
    "cudagraph: {capture_sizes: {preset: vllm, ceiling: 1048576}}",
    "cudagraph: {capture_sizes: {ranges: [{from: 1, to: 1048576, step: 1}]}}",
    "lora: {enabled: true, max_loras: 256, specialize_count: true}",
]
_HOSTILE_JINJA = [
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ (''|attr('__class__')) }}",
    "{{ lipsum.__globals__ }}",
    "{{ self.__init__ }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{% for i in range(9999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**8 }}",
    "{{ 2 ** 10 ** 6 }}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}",
    "{{ '%099999999d' % 1 }}",
    "{{ 'a'|center(10**9) }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ range.__self__ }}",
    "{{ max_num_seqs.__class__.__base__.__subclasses__() }}",
    "{{ {}.items.__self__ }}",
]
HOSTILE_PER_PLAN = 40


def _hostile(text: str, template: bool, rnd: random.Random) -> str:
    lines = text.splitlines(keepends=True) or [""]
    op = rnd.randrange(3 if template else 2)
    if op == 0:  # a value replaced by something hostile
        i = rnd.randrange(len(lines))
        key, colon, _ = lines[i].partition(":")
        if colon:
            lines[i] = f"{key}: {rnd.choice(_HOSTILE_VALUES)}\n"
    elif op == 1:
        lines.append(rnd.choice(_HOSTILE_LINES) + "\n")
    else:
        lines.insert(rnd.randrange(len(lines) + 1), "# " + rnd.choice(_HOSTILE_JINJA) + "\n")
    return "".join(lines)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_hostile_plans_are_refused_fast_with_exit_2_and_never_run_code(plan, tmp_path, monkeypatch):
    from graphplan.compiler import template

    monkeypatch.setattr(template, "MAX_RENDER_SECONDS", 0.2)
    monkeypatch.chdir(tmp_path)
    extra = TEMPLATE_SETS.get(plan.name, [])
    text = plan.read_text("utf-8")
    seen = {0: 0, 2: 0}
    for seed in range(HOSTILE_PER_PLAN):
        rnd = random.Random(f"hostile:{plan.name}:{seed}")
        target = tmp_path / f"h{seed}{plan.name}"
        target.write_text(_hostile(text, plan.name.endswith(".j2"), rnd), "utf-8")
        out = tmp_path / "table.json"
        for cmd in (["compile", str(target), "-o", str(out)], ["validate", str(target)]):
            where = f"{plan.name} hostile seed {seed} ({cmd[0]})"
            stdout, stderr = io.StringIO(), io.StringIO()
            t0 = time.monotonic()
            try:
                with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                    code = cli.main([*cmd, *extra])
            except BaseException as e:
                pytest.fail(f"{where}: {type(e).__name__}: {e}")
            err = stderr.getvalue()
            assert time.monotonic() - t0 < 5, where
            assert code in (0, 2) and "Traceback" not in err, f"{where}: exit {code}: {err[-300:]}"
            assert code == 0 or "error" in err, where
            assert len(err) < 100_000, where  # no megabyte echo of a hostile value
            seen[code] += 1
        assert out.exists() == (code == 0), where
        assert not (tmp_path / "PWNED").exists(), where
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], where
        out.unlink(missing_ok=True)
        target.unlink()
    assert seen[2] > 0, seen
