"""Diagnostics and the exception classes, one per kind of failure, each with its CLI exit code."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

MAX_SHOWN = 200
"""An echoed run of text without a space longer than this is cut, its length said."""
MAX_LINE = 4000
"""A rendered diagnostic line longer than this keeps its start and end, its length said."""
MAX_REPORTED = 20
"""An error report shows at most this many diagnostics (and at most ``MAX_REPORT`` characters of
them), then a count of the rest: a plan with 100,000 unknown keys is not a 2 MB message."""
MAX_REPORT = 8_000
# C0/C1 controls, DEL, and the bidirectional overrides that reorder what a terminal shows
_HIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_SHOWN + 1))


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def _cut(m: re.Match) -> str:
    run = m.group()
    return f"{run[:60]}...[{len(run)} characters]...{run[-8:]}"


def visible(text: str) -> str:
    """Text as it may reach a terminal or a log: control and bidi characters as visible escapes
    (ESC prints as ``\\x1b``, a newline as ``\\x0a``), every run of more than ``MAX_SHOWN``
    characters without a space cut to its start and end with its length said, and at most ``MAX_LINE``
    characters in all. The one place echoed input is made safe to print."""
    text = _HIDDEN.sub(_escape, str(text))
    text = _LONG_RUN.sub(_cut, text)
    if len(text) > MAX_LINE:
        cut = len(text) - MAX_LINE + 400
        text = f"{text[: MAX_LINE - 600]} ...[{cut} characters]... {text[-200:]}"
    return text


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnostic:
    """One finding about a plan: a downgrade, a dropped size, or an error."""

    code: str
    """Stable kebab-case identifier, e.g. ``mode-downgrade`` or ``unknown-key``."""
    message: str
    """What happened, in one sentence."""
    path: str = ""
    """Dotted plan path, e.g. ``cudagraph.capture_sizes[3]``; empty for the whole plan."""
    hint: str = ""
    """How to fix or silence it."""
    severity: str = "warning"
    """``warning`` (the plan compiles) or ``error`` (it does not)."""
    file: str = ""
    line: int = 0
    col: int = 0

    def format(self) -> str:
        """One line for a terminal: ``file:line:col: severity[code]: path: message (hint)``, with
        anything echoed from the input made ``visible``."""
        where = self.file or "<plan>"
        if self.line:
            where += f":{self.line}:{self.col}"
        path = f"{self.path}: " if self.path else ""
        hint = f" ({self.hint})" if self.hint else ""
        return visible(f"{where}: {self.severity}[{self.code}]: {path}{self.message}{hint}")

    def to_json(self) -> dict:
        return {
            "code": self.code,
            "severity": self.severity,
            "path": visible(self.path),
            "message": visible(self.message),
            "hint": visible(self.hint),
        }


class GraphplanError(Exception):
    """Base class. ``exit_code`` is what the ``plan`` CLI returns for it."""

    exit_code = 1


def reported(diagnostics) -> tuple[list[Diagnostic], int]:
    """(the diagnostics an error report shows, how many it leaves out): the first ones, at most
    ``MAX_REPORTED`` and ``MAX_REPORT`` characters of formatted text (always the first)."""
    diagnostics = list(diagnostics)
    shown: list[Diagnostic] = []
    size = 0
    for d in diagnostics[:MAX_REPORTED]:
        size += len(d.format()) + 1
        if shown and size > MAX_REPORT:
            break
        shown.append(d)
    return shown, len(diagnostics) - len(shown)


def left_out_line(count: int, kind: str = "error") -> str:
    """The line that ends a report that left ``count`` diagnostics out."""
    return f"... and {count} more {kind}{'s' if count != 1 else ''} (the first are shown above)"


class PlanError(GraphplanError):
    """The plan is invalid: bad YAML, schema violations, or rules that span fields. Holds every
    diagnostic; its message shows the first (``reported``) and counts the rest."""

    exit_code = 2

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = list(diagnostics)
        shown, left_out = reported(self.diagnostics)
        lines = [d.format() for d in shown] + ([left_out_line(left_out)] if left_out else [])
        super().__init__("\n".join(lines))


class TableError(GraphplanError):
    """A compiled table cannot be used: wrong format version, corrupted, unreadable."""

    exit_code = 2


class BatchError(GraphplanError, ValueError):
    """A runtime batch is outside what the table covers (e.g. more tokens than planned)."""


class OutputError(GraphplanError):
    """An output file cannot be written."""


class UsageError(GraphplanError):
    """A command-line or admin argument is malformed (not a plan problem)."""


def did_you_mean(word: object, choices) -> str:
    """`` (did you mean 'X'?)`` style hint, or empty when nothing is close."""
    if not isinstance(word, str):
        return ""
    found = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    if not found:
        found = [c for c in map(str, choices) if c.lower() == word.lower() or c.startswith(word)][
            :1
        ]
    return f"did you mean '{found[0]}'?" if found else ""


def plan_error(code: str, path: str, message: str, hint: str = "") -> PlanError:
    return PlanError(
        [Diagnostic(code=code, path=path, message=message, hint=hint, severity="error")]
    )
