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
    call   := dotted '(' [arg (',' arg)*] ')'           arg := [ident '='] value -> Call
    name   := dotted identifier: True/False/None, true/false/null, inf/nan, or kept as Name
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def fail(self, message: str):
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
        buf = []
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

    def _enum(self) -> Enum:
        self.expect("<")
        dotted = self.dotted()
        cls, _, member = dotted.rpartition(".")
        self.expect(":")
        value = self.value()
        self.expect(">")
        return Enum(cls, member, value)

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
