"""An engine's own command-line options, per version, and argparse's rules for reading them.

``flags_data/<engine>-<label>.json`` lists every option string the engine's parser defines in the
release a version label names (written by ``flags_data/dump_flags.py`` from the parser the engine
builds; the file's ``_source`` names the release and source files) with what each consumes: 0 (a
switch), 1, N, or argparse's ``'?'``, ``'*'``, ``'+'``. ``resolve`` finds the option a word names
as argparse does with ``allow_abbrev=True`` (Python 3.11 ``_parse_optional``: an exact match, else
the options the word is a prefix of: one is taken, several are ambiguous, none is unknown).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "flags_data"
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}


@dataclass(frozen=True, slots=True)
class Options:
    """One release's option strings -> what each consumes."""

    engine: str
    label: str
    release: str
    arity: dict
    """option string -> 0 | 1 | N | '?' | '*' | '+'"""

    @property
    def name(self) -> str:
        """``vLLM 0.11.2``: the engine and the release the data was taken from."""
        return f"{_NAMES.get(self.engine, self.engine)} {self.release}"


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a word names: ``option`` (None when unknown) and the candidates when ambiguous."""

    option: str | None
    candidates: tuple[str, ...] = ()


def labels(engine: str) -> list[str]:
    """The version labels that have flag data."""
    return sorted(p.stem.split("-", 1)[1] for p in DATA.glob(f"{engine}-*.json"))


@functools.lru_cache(maxsize=8)
def load(engine: str, label: str) -> Options | None:
    """The option table of ``engine`` at version ``label``; None when no data file exists."""
    path = DATA / f"{engine}-{label}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return Options(engine, label, data["release"], dict(data["options"]))


def load_release(engine: str, label: str) -> Options:
    """The option table of a release graphplan reads: every label in an adapter's VERSIONS has
    its data file (tests/test_engines_inputs.py checks)."""
    options = load(engine, label)
    assert options is not None, f"no flags_data/{engine}-{label}.json"
    return options


def resolve(word: str, options: Options) -> Resolved:
    """The option ``word`` (the part before any ``=``) names, by argparse's prefix rules."""
    table = options.arity
    if word in table:
        return Resolved(word)
    if len(word) < 2 or not word.startswith("-"):
        return Resolved(None)
    if word[1] == "-":
        found = [o for o in table if o.startswith(word)]
    else:  # '-x...': a short option with its value attached, or a prefix of single-dash options
        found = [o for o in table if o == word[:2] or (o.startswith(word) and o[1] != "-")]
    if len(found) == 1:
        return Resolved(found[0])
    return Resolved(None, tuple(sorted(found)))


def is_option_word(word: str) -> bool:
    """Whether argparse reads ``word`` as an option (not a value): it starts with '-', is not a
    negative number, not '-' alone, and has no space (argparse's positional heuristics)."""
    return (
        word.startswith("-")
        and len(word) > 1
        and not _NEGATIVE_NUMBER.match(word)
        and not (" " in word and "=" not in word.split(" ", 1)[0])
    )


def take_values(arity, words: list[str], start: int) -> list[str] | str:
    """The values an option of ``arity`` consumes from ``words[start:]`` (argparse's greedy
    match), or a message saying what is missing."""
    free = 0
    while start + free < len(words) and not is_option_word(words[start + free]):
        free += 1
    if arity == 0:
        return []
    if arity == 1:
        return words[start : start + 1] if free else "expected one argument"
    if arity == "?":
        return words[start : start + min(free, 1)]
    if arity == "*":
        return words[start : start + free]
    if arity == "+":
        return words[start : start + free] if free else "expected at least one argument"
    if free < arity:
        return f"expected {arity} arguments"
    return words[start : start + arity]
