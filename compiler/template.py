"""Plans as Jinja2 templates (``*.yaml.j2``): render with ``--set key=value``; undefined is an error."""

from __future__ import annotations

import jinja2

from graphplan.compiler.errors import Diagnostic, PlanError


def render(text: str, variables: dict, file: str) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False)
    try:
        return env.from_string(text).render(**variables)
    except jinja2.TemplateSyntaxError as e:
        raise PlanError([Diagnostic(code="template", severity="error", file=file, line=e.lineno,
                                    col=1, message=f"template syntax error: {e.message}")]) from None
    except jinja2.UndefinedError as e:
        name = str(e.message or e).split("'")[1] if "'" in str(e.message or e) else "?"
        raise PlanError([Diagnostic(code="template-undefined", severity="error", file=file,
                                    line=_template_line(e.__traceback__), col=1,
                                    message=f"template variable {e.message}",
                                    hint=f"pass it with --set {name}=VALUE")]) from None
    except Exception as e:  # a filter or expression failed while rendering
        raise PlanError([Diagnostic(code="template", severity="error", file=file,
                                    message=f"template failed to render: {e}")]) from None


def _template_line(tb) -> int:
    """Jinja2 maps template frames to ``<template>`` with template line numbers."""
    line = 0
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
