"""Plans as Jinja2 templates (``*.yaml.j2``): render with ``--set key=value``; undefined is an
error, and so is a ``--set`` variable the template does not use.

Templates are data, never code: they render in Jinja2's immutable sandbox with no loader (no
include, import or extends), no ``cycler``/``joiner``/``namespace``/``lipsum``, no method calls
other than ``dict.items/keys/values/get``, a short list of filters, and bounds on everything that
can grow: ``range`` (``MAX_RANGE`` items), loop iterations and wall time (``MAX_RENDER_SECONDS``),
every string and the rendered text (``MAX_PLAN_BYTES``, the plan file limit) and the bytes built
while rendering (``MAX_BUILD_BYTES``). A violation is a PlanError naming the file and line.
The sandbox and its bounds are ``template_sandbox``; rendering and its errors, here.

Values are data, never YAML text: every string in a template variable (a ``--set`` value, at any
depth of a list or mapping) is plain words (letters, digits, ``_ . - / +`` and single spaces);
anything else (a newline, ``:``, ``,``, ``#``, brackets, quotes) could be read as YAML structure
once rendered into the plan, so it is refused before rendering, naming the file and the variable.
Lists and mappings render as JSON (a YAML flow value). Text the template itself writes is the
template author's and is not restricted.
"""

from __future__ import annotations

import re
import time
from collections.abc import Generator
from typing import cast

import jinja2

from .errors import Diagnostic, PlanError
from .limits import MAX_PLAN_BYTES
from .template_sandbox import (
    FILTERS,
    MAX_BUILD_BYTES,
    MAX_INT_BITS,
    MAX_RANGE,
    METHODS,
    REMOVED,
    PlanTemplateEnvironment,
    TemplateLimit,
    budget,
    guard_tree,
)

__all__ = [
    "render",
    "MAX_RANGE",
    "MAX_RENDER_SECONDS",
    "MAX_BUILD_BYTES",
    "MAX_INT_BITS",
    "FILTERS",
    "METHODS",
    "TemplateLimit",
]


MAX_RENDER_SECONDS = 2.0
"""A template that renders longer than this is refused (a plan renders in milliseconds)."""


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


_PLAIN_WORDS = re.compile(r"[A-Za-z0-9_./+-]+(?: [A-Za-z0-9_./+-]+)*")


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


def render(text: str, variables: dict, file: str) -> str:
    """Render a plan template; ``variables`` are the ``--set`` values (each one must be used)."""
    _check_variables(variables, file)
    env = PlanTemplateEnvironment()
    with budget(MAX_RENDER_SECONDS) as spent:
        try:
            tree = guard_tree(env.parse(text), file)
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
            out, size = [], 0
            # jinja2 annotates generate() as an Iterator; it is a generator (closed below)
            gen = cast(Generator[str, None, None], template.generate(**variables))
            for chunk in gen:
                size += len(chunk)
                why = (
                    f"the rendered plan is over {MAX_PLAN_BYTES} bytes (the plan size limit)"
                    if size > MAX_PLAN_BYTES
                    else f"rendering took more than {MAX_RENDER_SECONDS:g} s"
                    if time.monotonic() > spent.deadline
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
                if name in REMOVED
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
