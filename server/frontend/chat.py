"""Chat prompts: the model's own chat template (``chat_template.jinja`` or tokenizer_config.json's
``chat_template``, read by the ServingSpec) rendered in Jinja2's ImmutableSandboxedEnvironment, as
transformers renders it (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text), but with no access to Python beyond what
the sandbox allows, no loader (no include/import/extends) and a bound on the text it renders.

The template comes from the model directory the operator chose; clients give only data (the
messages). Jinja2 is imported here only: the runtime never imports it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..errors import RequestError

MAX_RENDERED = 4 << 20
"""Characters a rendered chat prompt may have (it is tokenized and checked against the context
after)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatTemplateSource:
    """A model's chat template and the special tokens templates refer to."""

    template: str
    where: str
    """The file it came from (for error messages)."""
    bos_token: str = ""
    eos_token: str = ""


class TemplateError(Exception):
    """The template itself is broken (a syntax error, or it raised while rendering)."""


class ChatTemplate:
    def __init__(self, source: ChatTemplateSource):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols"],
            autoescape=False,
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt))
        try:
            self._template = env.from_string(source.template)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"{source.where}: the chat template does not parse: line {e.lineno}: {e.message}"
            ) from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text; RequestError 400 when the template refuses the conversation (its
        ``raise_exception``, e.g. roles out of order) or fails on it."""
        import jinja2

        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.source.bos_token,
                eos_token=self.source.eos_token,
                tools=None,
                documents=None,
            )
        except _Refused as e:
            raise RequestError(
                400, f"the model's chat template refused the messages: {e}"
            ) from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise RequestError(
                400,
                f"the model's chat template ({self.source.where}) failed on these messages: "
                f"{type(e).__name__}: {str(e)[:200]}",
                "messages",
            ) from None
        if len(text) > MAX_RENDERED:
            raise RequestError(
                400, f"the rendered chat prompt has over {MAX_RENDERED} characters", "messages"
            )
        return text


class _Refused(Exception):
    pass


def _raise(message: Any) -> None:
    raise _Refused(str(message)[:300])


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=False, default=str)
