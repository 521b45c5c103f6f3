"""Plans as Jinja2 templates (``*.yaml.j2``): render with ``--set key=value``; undefined is an
error, and so is a ``--set`` variable the template does not use.

Templates are data, never code: they render in Jinja2's immutable sandbox with no loader (no
include, import or extends), no ``cycler``/``joiner``/``namespace``/``lipsum``, no method calls
other than ``dict.items/keys/values/get``, a short list of filters, and bounds on everything that
can grow: ``range`` (``MAX_RANGE`` items), loop iterations and wall time (``MAX_RENDER_SECONDS``),
every string and the rendered text (``MAX_PLAN_BYTES``, the plan file limit) and the bytes built
while rendering (``MAX_BUILD_BYTES``). A violation is a PlanError naming the file and line.

Values are data, never YAML text: every string in a template variable (a ``--set`` value, at any
depth of a list or mapping) is plain words (letters, digits, ``_ . - / +`` and single spaces);
anything else (a newline, ``:``, ``,``, ``#``, brackets, quotes) could be read as YAML structure
once rendered into the plan, so it is refused before rendering, naming the file and the variable.
Lists and mappings render as JSON (a YAML flow value). Text the template itself writes is the
template author's and is not restricted.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
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
MAX_RENDER_SECONDS = 2.0
"""A template that renders longer than this is refused (a plan renders in milliseconds)."""
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
_REMOVED = ("cycler", "joiner", "namespace", "lipsum")


class TemplateLimit(Exception):
    """A template went past a bound; the loader reports it as a PlanError at the line."""


_PLAIN_WORDS = re.compile(r"[A-Za-z0-9_./+-]+(?: [A-Za-z0-9_./+-]+)*")


class _Budget:
    __slots__ = ("deadline", "built", "ticks")

    def __init__(self):
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.built = 0
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks & 255 == 0 and time.monotonic() > self.deadline:
            raise TemplateLimit(f"rendering took more than {MAX_RENDER_SECONDS:g} s")

    def charge(self, n: int) -> None:
        self.built += n
        if self.built > MAX_BUILD_BYTES:
            raise TemplateLimit(f"the template built more than {MAX_BUILD_BYTES} bytes of text")


_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("graphplan_template_budget")


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


def _check_variables(variables: dict, file: str) -> None:
    """Every string in the variables (keys included) is plain words, or a ``template-value``
    error naming the file and the ``--set`` variable."""
    for name, value in variables.items():
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
            elif isinstance(v, str) and v and not _PLAIN_WORDS.fullmatch(v):
                bad = next(
                    (c for c in v if not (c.isascii() and (c.isalnum() or c in "_./+- "))), " "
                )
                raise _error(
                    file,
                    "template-value",
                    f"--set {name}={value}: the text {v!r} has {bad!r}, which YAML would read "
                    "as structure once rendered into the plan, not as one value",
                    hint="a template value is data: numbers, true/false, plain words (letters, "
                    "digits, _ . - / + and single spaces), or lists and mappings of them",
                )


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


def _guard_tree(tree: nodes.Template, file: str) -> nodes.Template:
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
    for node in list(tree.find_all(nodes.Concat)):
        guarded = nodes.Call(
            nodes.ImportedName(f"{__name__}.concat"),
            list(node.nodes),
            [],
            None,
            None,
            lineno=node.lineno,
        )
        _replace(tree, node, guarded)
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


def _error(file: str, code: str, message: str, line: int = 0, hint: str = "") -> PlanError:
    return PlanError(
        [
            Diagnostic(
                code=code,
                severity="error",
                file=file,
                line=line,
                col=1 if line else 0,
                message=message,
                hint=hint,
            )
        ]
    )


def render(text: str, variables: dict, file: str) -> str:
    """Render a plan template; ``variables`` are the ``--set`` values (each one must be used)."""
    _check_variables(variables, file)
    env = PlanTemplateEnvironment()
    token = _budget.set(_Budget())
    try:
        try:
            tree = _guard_tree(env.parse(text), file)
            unused = sorted(set(variables) - _names(env, text))
            if unused:
                name = unused[0]
                known = ", ".join(sorted(_names(env, text))) or "none"
                if "." in name:
                    message = (
                        f"--set {name}: a dotted plan key cannot be set on a template (it "
                        "would be ignored)"
                    )
                    hint = (
                        f"set one of the template's variables ({known}), or edit the "
                        "template to take this value as a variable"
                    )
                else:
                    message = f"--set {name}: the template has no variable {name!r}"
                    hint = f"its variables are: {known}; remove --set {name}"
                raise _error(file, "template-unused-variable", message, hint=hint)
            template = env.template_class.from_code(env, env.compile(tree), env.make_globals(None))
            out, size, budget = [], 0, _budget.get()
            gen = template.generate(**variables)
            for chunk in gen:
                size += len(chunk)
                why = (
                    f"the rendered plan is over {MAX_PLAN_BYTES} bytes (the plan size limit)"
                    if size > MAX_PLAN_BYTES
                    else f"rendering took more than {MAX_RENDER_SECONDS:g} s"
                    if time.monotonic() > budget.deadline
                    else ""
                )
                if why:
                    line = _generator_line(template, gen)
                    gen.close()
                    raise _error(
                        file,
                        "template-limit",
                        f"template refused: {why}",
                        line,
                        "templates render small plans: use fewer, smaller values",
                    )
                out.append(chunk)
            return "".join(out)
        except jinja2.TemplateSyntaxError as e:
            hint = (
                f"templates may use these filters: {', '.join(FILTERS)}"
                if "filter" in str(e.message)
                else ""
            )
            raise _error(
                file, "template", f"template syntax error: {e.message}", e.lineno, hint
            ) from None
        except jinja2.UndefinedError as e:
            msg = str(e.message or e)
            name = msg.split("'")[1] if "'" in msg else "?"
            hint = (
                f"{name} is not available in plan templates (README: Security)"
                if name in _REMOVED
                else f"pass it with --set {name}=VALUE"
            )
            raise _error(
                file,
                "template-undefined",
                f"template variable {e.message}",
                _template_line(e.__traceback__),
                hint,
            ) from None
        except TemplateLimit as e:
            raise _error(
                file,
                "template-limit",
                f"template refused: {e}",
                _template_line(e.__traceback__),
                "templates render small plans: use fewer, smaller values",
            ) from None
        except jinja2.exceptions.SecurityError as e:
            raise _error(
                file,
                "template-unsafe",
                f"template refused: {e}",
                _template_line(e.__traceback__),
                "templates may use variables, arithmetic, if/for and the listed "
                "filters only (README: Security)",
            ) from None
        except PlanError:
            raise
        except (Exception, RecursionError) as e:  # a filter or expression failed while rendering
            raise _error(
                file,
                "template",
                f"template failed to render: {type(e).__name__}: {str(e)[:300]}",
                _template_line(e.__traceback__),
            ) from None
    finally:
        _budget.reset(token)


def _names(env, text: str) -> set[str]:
    from jinja2 import meta

    return meta.find_undeclared_variables(env.parse(text))


def _generator_line(template, gen) -> int:
    """The template line a suspended render is at (innermost template generator)."""
    line = 0
    while gen is not None:
        frame = getattr(gen, "gi_frame", None)
        if frame is not None and frame.f_code.co_filename == "<template>":
            line = template.get_corresponding_lineno(frame.f_lineno)
        gen = getattr(gen, "gi_yieldfrom", None)
    return line


def _template_line(tb) -> int:
    """Jinja2 maps template frames to ``<template>`` with template line numbers."""
    line = 0
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
