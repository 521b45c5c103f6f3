"""What vLLM's ``FlexibleArgumentParser.parse_args`` does to a command line before argparse reads
it (``vllm/utils/argparse_utils.py`` in 0.11.2, 0.16.0 and 0.23.0), written from its source:

- ``-O<x>`` / ``-O=<x>`` / ``-O <0-3>``: in 0.11 the compilation mode (``-O.mode=<x>``, where
  ``-O`` is ``--compilation-config``); in 0.16.0 and 0.23.0 ``--optimization-level <x>``.
- ``--json-arg.key value`` / ``--json-arg.key=value`` / ``--json-arg.key+ a,b``: each dotted
  argument becomes part of one JSON object per option, appended at the end as ``--json-arg
  '{...}'`` (so it wins over an earlier ``--json-arg '{...}'``: argparse keeps the last value).
"""

from __future__ import annotations

import json

MAX_DOTTED_DEPTH = 16


def flexible(words: list[str], version: str) -> tuple[list[str], str]:
    """(rewritten words, the dotted arguments that were folded into a JSON option, as text)."""
    words = _optimization(words, version)
    out: list[str] = []
    dicts: dict[str, dict] = {}  # --base.a.b=v -> {base: {a: {b: v}}}
    folded: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        head = word.split("=", 1)[0]
        if not (word.startswith("-") and "." in head and not _is_number(head)):
            out.append(word)
            i += 1
            continue
        if "=" in word:
            head, value = word.split("=", 1)
            shown = word
        elif i + 1 < len(words):
            value, shown = words[i + 1], f"{word} {words[i + 1]}"
            i += 1
        else:
            out.append(word)  # no value: argparse reports it
            i += 1
            continue
        i += 1
        if head.endswith("+"):
            head, value = head[:-1], json.dumps(value.split(","))
        base, *keys = head.split(".")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        keys = keys[:MAX_DOTTED_DEPTH]
        node = dicts.setdefault(base, {})
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        leaf = keys[-1]
        if isinstance(node.get(leaf), list) and isinstance(parsed, list):
            node[leaf] = node[leaf] + parsed  # vLLM appends to a list given twice
        else:
            node[leaf] = parsed
        folded.append(shown)
    for base, tree in dicts.items():
        out += [base, json.dumps(tree)]
    return out, " ".join(folded)


def _optimization(words: list[str], version: str) -> list[str]:
    out = []
    for i, word in enumerate(words):
        if word.startswith("-O") and word != "-O" and word[2] != ".":
            level = word[3:] if word[2] == "=" else word[2:]
            out += [f"-O.mode={level}"] if version == "0.11" else ["--optimization-level", level]
        elif word == "-O" and i + 1 < len(words) and words[i + 1] in ("0", "1", "2", "3"):
            out.append("-O.mode" if version == "0.11" else "--optimization-level")
        else:
            out.append(word)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
