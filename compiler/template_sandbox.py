"""The sandbox plan templates render in: what a template may call, and the bounds on what it may
build (template.py's docstring lists them; a violation raises TemplateLimit, which ``render``
reports as a PlanError at the template's line).

Rendering is guarded in two places: the environment (``PlanTemplateEnvironment``: filters,
globals, attribute and operator checks) and the template's own syntax tree (``guard_tree``:
every loop ticks the render's Budget, every ``~`` is checked before the string is built).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import time

import jinja2
from jinja2 import nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import Markup

from .errors import Diagnostic, PlanError
from .limits import MAX_PLAN_BYTES

MAX_RANGE = 10_000
"""``range(n)`` in a template yields at most this many numbers."""
MAX_BUILD_BYTES = 16 * MAX_PLAN_BYTES
"""Bytes of strings a render may build in all (intermediate values included)."""
MAX_INT_BITS = 256
"""Integers computed in a template stay below 2**256."""
FILTERS = (
    "abs",
    "capitalize",
    "count",
    "d",
    "default",
    "dictsort",
    "first",
    "float",
    "int",
    "items",
    "join",
    "last",
    "length",
    "list",
    "lower",
    "map",
    "max",
    "min",
    "reject",
    "rejectattr",
    "reverse",
    "round",
    "select",
    "selectattr",
    "sort",
    "string",
    "sum",
    "title",
    "tojson",
    "trim",
    "unique",
    "upper",
)
"""The filters a template may use (the rest can build unbounded output or read the system)."""
METHODS = {dict: ("items", "keys", "values", "get")}
REMOVED = ("cycler", "joiner", "namespace", "lipsum")
"""Jinja2 globals a template does not get (they build unbounded output or state)."""


class TemplateLimit(Exception):
    """A template went past a bound; the loader reports it as a PlanError at the line."""


class Budget:
    """What one render may still spend: wall time (checked every 256 ticks: a clock read per
    loop item would cost more than the item) and bytes of text built."""

    __slots__ = ("seconds", "deadline", "built", "ticks")

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.built = 0
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks & 255 == 0 and time.monotonic() > self.deadline:
            raise TemplateLimit(f"rendering took more than {self.seconds:g} s")

    def charge(self, n: int) -> None:
        self.built += n
        if self.built > MAX_BUILD_BYTES:
            raise TemplateLimit(f"the template built more than {MAX_BUILD_BYTES} bytes of text")


_budget: contextvars.ContextVar[Budget] = contextvars.ContextVar("graphplan_template_budget")
# the render's Budget: the guarded template code reaches it from anywhere while it renders


@contextlib.contextmanager
def budget(seconds: float):
    """A fresh Budget for the render inside (renders may nest: each has its own)."""
    token = _budget.set(Budget(seconds))
    try:
        yield _budget.get()
    finally:
        _budget.reset(token)


def _weight(value, limit: int = MAX_PLAN_BYTES) -> int:
    """Characters ``str(value)`` would have, roughly, counted without building it; raises past
    ``limit``."""
    total, stack = 0, [value]
    budget = _budget.get()
    while stack:
        v = stack.pop()
        budget.tick()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        else:
            total += 32
        if total > limit:
            raise TemplateLimit(f"a value of more than {limit} characters")
    return total


def _sized(value):
    """Charge a built value to the render's budget; refuse one above the plan size limit."""
    if isinstance(value, str):
        if len(value) > MAX_PLAN_BYTES:
            raise TemplateLimit(f"a string of more than {MAX_PLAN_BYTES} characters")
        _budget.get().charge(len(value))
    elif isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"an integer above 2**{MAX_INT_BITS}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise TemplateLimit(f"a number that is not finite ({value})")
    elif isinstance(value, (list, tuple, dict)):
        _budget.get().charge(_weight(value))
    return value


def _as_data(value):
    """``finalize`` for every ``{{ ... }}``: bounded, and a list or mapping as JSON (a YAML flow
    value) rather than Python's repr."""
    value = _sized(value)
    if isinstance(value, (list, tuple, dict)) and not isinstance(value, Markup):
        try:
            return json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            return value
    return value


def _binop(op: str, a, b):
    if op == "%" and isinstance(a, str):
        raise TemplateLimit("'%' string formatting is not allowed; join with '~'")
    if (
        op == "**"
        and isinstance(a, int)
        and isinstance(b, int)
        and b > 0
        and max(a.bit_length() - 1, 1) * b > MAX_INT_BITS * 2
        and abs(a) > 1
    ):
        raise TemplateLimit(f"an integer above 2**{MAX_INT_BITS}")
    if op == "*" and isinstance(b, (str, list, tuple)) and isinstance(a, int):
        a, b = b, a
    if op == "*" and isinstance(a, (str, list, tuple)) and isinstance(b, int):
        if _weight(a) * max(b, 0) > MAX_PLAN_BYTES:
            raise TemplateLimit(f"a value of more than {MAX_PLAN_BYTES} characters")
    if op == "+" and isinstance(a, (str, list, tuple)):
        if _weight(a) + _weight(b) > MAX_PLAN_BYTES:
            raise TemplateLimit(f"a value of more than {MAX_PLAN_BYTES} characters")
    return _sized(ImmutableSandboxedEnvironment.default_binop_table[op](a, b))


def loop_guard(iterable):
    """Every ``{% for %}`` iterates through this: a tick per item against the time limit."""
    budget = _budget.get()
    for item in iterable:
        budget.tick()
        yield item


def concat(*parts):
    """``a ~ b``: the length is checked before the string is built."""
    total = sum(_weight(p) for p in parts)
    if total > MAX_PLAN_BYTES:
        raise TemplateLimit(f"a string of more than {MAX_PLAN_BYTES} characters")
    return _sized("".join(map(str, parts)))


def _range(*args):
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise TemplateLimit(
            f"range{args} has {len(r)} items; templates may use at most {MAX_RANGE}"
        )
    return r


def _checked_filter(f):
    def checked(*args, **kwargs):
        for a in args:
            if isinstance(a, (list, tuple, dict, str)):
                _weight(a)
        return _sized(f(*args, **kwargs))

    for attr in ("jinja_pass_arg",):  # keep Jinja's context/environment passing markers
        if hasattr(f, attr):
            setattr(checked, attr, getattr(f, attr))
    return checked


class PlanTemplateEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "**", "%"])

    def __init__(self):
        super().__init__(
            undefined=jinja2.StrictUndefined,
            keep_trailing_newline=True,
            autoescape=False,
            loader=None,
            finalize=_as_data,
        )
        self.globals = {"range": _range, "dict": dict}
        self.filters = {name: _checked_filter(self.filters[name]) for name in FILTERS}
        self.tests = dict(self.tests)

    def call_binop(self, context, operator, left, right):
        return _binop(operator, left, right)

    def is_safe_attribute(self, obj, attr, value) -> bool:
        if not super().is_safe_attribute(obj, attr, value):
            return False
        if isinstance(obj, LoopContext) or not callable(value):
            return True
        return any(isinstance(obj, t) and attr in names for t, names in METHODS.items())


def guard_tree(tree: nodes.Template, file: str) -> nodes.Template:
    """Route every loop through ``loop_guard`` and every ``~`` through ``concat``; refuse
    include/import/extends (templates read no other file)."""
    for node in tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
        raise PlanError(
            [
                Diagnostic(
                    code="template",
                    severity="error",
                    file=file,
                    line=node.lineno,
                    col=1,
                    message="templates may not include, import or extend other files",
                    hint="put everything in this one file; pass values with --set",
                )
            ]
        )
    for node in tree.find_all(nodes.For):
        node.iter = nodes.Call(
            nodes.ImportedName(f"{__name__}.loop_guard"),
            [node.iter],
            [],
            None,
            None,
            lineno=node.lineno,
        )
    for concat in list(tree.find_all(nodes.Concat)):
        guarded = nodes.Call(
            nodes.ImportedName(f"{__name__}.concat"),
            list(concat.nodes),
            [],
            None,
            None,
            lineno=concat.lineno,
        )
        _replace(tree, concat, guarded)
    return tree


def _replace(tree: nodes.Node, old: nodes.Node, new: nodes.Node) -> None:
    for parent in tree.find_all(nodes.Node):
        for field in parent.fields:
            value = getattr(parent, field, None)
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return
