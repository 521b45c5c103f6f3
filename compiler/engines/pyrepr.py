"""A small, safe reader for the Python-repr / JSON text that engines print in their logs.

vLLM logs ``non-default args: {...}`` (a Python dict repr) and an engine-config line ending in
``compilation_config={...}`` whose values include enum reprs such as
``<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>`` and object reprs such as
``LoRAModulePath(name='a', path='/p')``. This is a hand-written recursive-descent parser over a
fixed grammar; it never evaluates anything (no ``eval``, no ``ast.literal_eval``):

    value  := dict | list | tuple | string | number | enum | call | name
    dict   := '{' [value ':' value (',' value ':' value)* [',']] '}'
    list   := '[' [value (',' value)* [',']] ']'        tuple := '(' ... ')'
    enum   := '<' dotted ':' value '>'                 -> Enum(name, member, value)
            | '<' ... '>' (any other repr, e.g. <class 'x.Y'>, balanced) -> Name(text)
    call   := dotted '(' [arg (',' arg)*] ')'           arg := [ident '='] value -> Call
    name   := dotted identifier: True/False/None, true/false/null, inf/nan, or kept as Name
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

MAX_DEPTH = 64
MAX_CHARS = 1 << 20


@dataclass(frozen=True, slots=True)
class Enum:
    """``<CUDAGraphMode.FULL: 2>``: ``cls='CUDAGraphMode', member='FULL', value=2``."""

    cls: str
    member: str
    value: object


@dataclass(frozen=True, slots=True)
class Call:
    """``Name(a, k=v)``: an object repr, kept as data."""

    name: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True, slots=True)
class Name:
    """A bare dotted identifier such as ``torch.bfloat16`` or ``cuda``."""

    text: str


class ReprError(ValueError):
    """Malformed text; ``pos`` is the 0-based offset where reading stopped."""

    def __init__(self, message: str, pos: int):
        super().__init__(message)
        self.pos = pos


_CONST = {
    "True": True,
    "False": False,
    "None": None,
    "true": True,
    "false": False,
    "null": None,
    "inf": float("inf"),
    "nan": float("nan"),
}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0"}


class _Reader:
    def __init__(self, text: str, pos: int = 0):
        if len(text) > MAX_CHARS:
            raise ReprError(f"{len(text)} characters is too long to be a config", 0)
        self.s, self.i, self.depth = text, pos, 0

    def fail(self, message: str) -> NoReturn:
        raise ReprError(message, self.i)

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def peek(self) -> str:
        self.ws()
        return self.s[self.i] if self.i < len(self.s) else ""

    def expect(self, ch: str) -> None:
        if self.peek() != ch:
            got = repr(self.s[self.i]) if self.i < len(self.s) else "the end of the text"
            self.fail(f"expected {ch!r}, found {got}")
        self.i += 1

    def value(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(f"nested more than {MAX_DEPTH} levels")
        c = self.peek()
        if c == "{":
            out = self._dict()
        elif c == "[":
            out = self._seq("[", "]", list)
        elif c == "(":
            out = self._seq("(", ")", tuple)
        elif c in "'\"":
            out = self._string()
        elif c == "<":
            out = self._enum()
        elif c.isdigit() or c in "-+.":
            out = self._number()
        elif c.isalpha() or c == "_":
            out = self._name_or_call()
        else:
            self.fail("expected a value, found " + (repr(c) if c else "the end of the text"))
        self.depth -= 1
        return out

    def _dict(self) -> dict:
        self.expect("{")
        out: dict = {}
        while self.peek() != "}":
            key = self.value()
            if isinstance(key, (dict, list)):
                self.fail("a dict key must be a plain value")
            self.expect(":")
            out[key] = self.value()
            if self.peek() != ",":
                break
            self.i += 1
        self.expect("}")
        return out

    def _seq(self, open_: str, close: str, kind):
        self.expect(open_)
        out = []
        while self.peek() != close:
            out.append(self.value())
            if self.peek() != ",":
                break
            self.i += 1
        self.expect(close)
        return kind(out)

    def _string(self) -> str:
        quote, start = self.s[self.i], self.i
        self.i += 1
        buf: list[str] = []
        while self.i < len(self.s):
            ch = self.s[self.i]
            if ch == quote:
                self.i += 1
                return "".join(buf)
            if ch == "\n":
                break
            if ch == "\\" and self.i + 1 < len(self.s):
                nxt = self.s[self.i + 1]
                buf.append(_ESCAPES.get(nxt, "\\" + nxt))
                self.i += 2
                continue
            buf.append(ch)
            self.i += 1
        self.i = start
        self.fail("a string is not closed")

    def _number(self):
        start = self.i
        while self.i < len(self.s) and (self.s[self.i].isalnum() or self.s[self.i] in "+-._"):
            self.i += 1
        text = self.s[start : self.i]
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            self.i = start
            self.fail(f"{text!r} is not a number")

    def dotted(self) -> str:
        self.ws()
        start = self.i
        while self.i < len(self.s) and (self.s[self.i].isalnum() or self.s[self.i] in "_."):
            self.i += 1
        if start == self.i:
            self.fail("expected a name")
        return self.s[start : self.i]

    def _enum(self):
        start = self.i
        self.expect("<")
        try:
            dotted = self.dotted()
            cls, _, member = dotted.rpartition(".")
            self.expect(":")
            value = self.value()
            self.expect(">")
            return Enum(cls, member, value)
        except ReprError:  # <class 'x.Y'>, <function f at 0x...>: kept as text, never read
            self.i, level = start, 0
            while self.i < len(self.s) and self.s[self.i] != "\n":
                level += {"<": 1, ">": -1}.get(self.s[self.i], 0)
                self.i += 1
                if level == 0:
                    return Name(self.s[start : self.i])
            self.i = start
            self.fail("a '<...>' repr is not closed")

    def _name_or_call(self):
        name = self.dotted()
        if name in _CONST:
            return _CONST[name]
        if self.i < len(self.s) and self.s[self.i] == "(":
            self.i += 1
            args, kwargs = [], {}
            while self.peek() != ")":
                save = self.i
                if self.peek().isalpha() or self.peek() == "_":
                    key = self.dotted()
                    if self.peek() == "=":
                        self.i += 1
                        kwargs[key] = self.value()
                    else:
                        self.i = save
                        args.append(self.value())
                else:
                    args.append(self.value())
                if self.peek() != ",":
                    break
                self.i += 1
            self.expect(")")
            return Call(name, tuple(args), kwargs)
        return Name(name)


def parse_value(text: str, pos: int = 0) -> tuple[object, int]:
    """Read one value starting at ``pos``; returns (value, offset just after it)."""
    r = _Reader(text, pos)
    v = r.value()
    return v, r.i


def parse_kwargs(text: str, pos: int = 0) -> dict:
    """Read ``name=value, name=value, ...`` up to the end of the text (an engine-config line)."""
    r, out = _Reader(text, pos), {}
    while r.peek():
        key = r.dotted()
        r.expect("=")
        out[key] = r.value()
        if r.peek() == ",":
            r.i += 1
        elif r.peek():
            r.fail(f"expected ',' after {key}=..., found {r.s[r.i]!r}")
    return out


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=(?!=)")
_OPEN = {"(": ")", "[": "]", "{": "}", "<": ">"}


def split_kwargs(text: str, pos: int = 0) -> tuple[list[tuple[str, str, int]], str]:
    """``name=value, name=value, ...`` -> ([(name, value text, offset of the value)], head):
    the split is made at top-level commas that start ``name=`` (outside quotes and brackets), so
    a value may be anything vLLM prints, quoted or not (``served_model_name=org/model``,
    ``model=/path``, ``dtype=torch.bfloat16``). ``head`` is text before the first ``name=``
    (a line whose beginning is missing). Bounded: MAX_CHARS, MAX_DEPTH; never recursive."""
    if len(text) > MAX_CHARS:
        raise ReprError(f"{len(text)} characters is too long to be a config", 0)
    starts, stack, quote, last, i, n = [], [], "", "", pos, len(text)
    first = _IDENT.match(text, _skip_ws(text, pos))
    if first:
        starts.append(first.start())
    while i < n:
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"" and last in ("", "=", "[", "{", "(", ",", ":"):
            quote = ch  # a quote opens a string only where a value starts
        elif ch in _OPEN and (ch != "<" or text[i + 1 : i + 2].isalpha()):
            stack.append(_OPEN[ch])
            if len(stack) > MAX_DEPTH:
                raise ReprError(f"nested more than {MAX_DEPTH} levels", i)
        elif stack and ch == stack[-1]:
            stack.pop()
        elif ch == "," and not stack:
            m = _IDENT.match(text, _skip_ws(text, i + 1))
            if m:
                starts.append(m.start())
        if ch not in " \t":
            last = ch
        i += 1
    out = []
    for k, start in enumerate(starts):
        eq = text.index("=", start)
        end = starts[k + 1] if k + 1 < len(starts) else n
        value = text[eq + 1 : end].rstrip()
        out.append((text[start:eq], value.removesuffix(",").strip(), eq + 1))
    head = text[pos : starts[0]] if starts else text[pos:]
    return out, head.strip()


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t":
        i += 1
    return i


def plain(value):
    """Enums -> member name, calls -> {'__call__': name, **kwargs}, names -> text; recursively."""
    if isinstance(value, Enum):
        return value.member
    if isinstance(value, Name):
        return value.text
    if isinstance(value, Call):
        return {"__call__": value.name, **{k: plain(v) for k, v in value.kwargs.items()}}
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
