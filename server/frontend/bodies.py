"""Request bodies of graphplan's own routes (/generate, /admin/reload) and the error shape of every route: parse and check them before anything reaches the engine. Every problem is a
RequestError with a 4xx status and a message that names the field and the fix."""

from __future__ import annotations

import json
from dataclasses import dataclass

from graphplan.compiler.errors import did_you_mean

from ..errors import RequestError, error_type
from .openai_responses import ErrorBody, ErrorInfo

GENERATE_FIELDS = ("prompt", "prompts", "max_tokens", "stream")
RELOAD_FIELDS = ("path", "set")
DEFAULT_MAX_TOKENS = 16
MAX_BATCH = 256


def error_model(e: RequestError) -> ErrorBody:
    """The one error shape of every route: OpenAI's ``{"error": {message, type, param, code}}``."""
    info = ErrorInfo(message=e.message, type=error_type(e.status), param=e.param, code=e.code)
    return ErrorBody(error=info)


def error_body(e: RequestError) -> dict:
    """``error_model`` as plain data."""
    return error_model(e).model_dump()


def parse_json(body: bytes):
    """A request body as JSON: every way it can be malformed (bad UTF-8, bad syntax, numbers with
    more digits than Python converts, nesting deeper than the parser recurses) is a 400."""
    try:
        return json.loads(body)
    except UnicodeDecodeError as e:
        raise RequestError(400, f"malformed JSON body: not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise RequestError(400, f"malformed JSON body: {e}") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise RequestError(400, f"malformed JSON body: {str(e)[:200]}") from None
    except RecursionError:
        raise RequestError(400, "malformed JSON body: nested too deeply") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Generate:
    prompts: list[list[int]]
    max_tokens: int
    stream: bool
    batch: bool
    """The body used ``prompts`` (answer with ``results``) rather than ``prompt``."""


def _object(body: bytes, fields: tuple[str, ...], allow_empty: bool = False) -> dict:
    if allow_empty and not body.strip():
        return {}
    obj = parse_json(body)
    if not isinstance(obj, dict):
        raise RequestError(400, f"the body must be a JSON object, not {type(obj).__name__}")
    for key in obj:
        if key not in fields:
            hint = did_you_mean(key, fields)
            raise RequestError(
                400,
                f"unknown field {key!r}"
                + (f" ({hint})" if hint else "")
                + f"; fields are {', '.join(fields)}",
            )
    return obj


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prompt(p, where: str, max_tokens: int, limits: dict) -> list[int]:
    if not isinstance(p, list) or not all(_is_int(t) for t in p):
        raise RequestError(400, f"{where} must be a list of integer token ids")
    if not p:
        raise RequestError(422, f"{where} is empty: give at least one token id")
    vocab = limits["vocab_size"]
    for i, t in enumerate(p):
        if not 0 <= t < vocab:
            raise RequestError(
                422, f"{where}[{i}]: token id {t} is outside the vocabulary 0..{vocab - 1}"
            )
    cap = limits["max_model_len"]
    if len(p) >= cap:
        raise RequestError(
            422,
            f"{where} has {len(p)} tokens; the limit is {cap - 1} "
            f"(max_model_len={cap} minus one generated token)",
        )
    if len(p) + max_tokens > limits["max_model_len"]:
        raise RequestError(
            422,
            f"{where} has {len(p)} tokens and max_tokens is {max_tokens}: "
            f"together they exceed max_model_len={limits['max_model_len']}; "
            "shorten the prompt or lower max_tokens",
        )
    return list(p)


def parse_generate(body: bytes, limits: dict) -> Generate:
    obj = _object(body, GENERATE_FIELDS)
    if ("prompt" in obj) == ("prompts" in obj):
        raise RequestError(
            400,
            "give exactly one of 'prompt' (a list of token ids) or "
            "'prompts' (a list of such lists)",
        )
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not _is_int(max_tokens):
        raise RequestError(400, f"'max_tokens' must be an integer, not {type(max_tokens).__name__}")
    if max_tokens < 1:
        raise RequestError(422, f"'max_tokens' must be >= 1, not {max_tokens}")
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, f"'stream' must be true or false, not {stream!r}")
    if "prompt" in obj:
        return Generate(
            prompts=[_prompt(obj["prompt"], "'prompt'", max_tokens, limits)],
            max_tokens=max_tokens,
            stream=stream,
            batch=False,
        )
    ps = obj["prompts"]
    if not isinstance(ps, list) or not ps:
        raise RequestError(400, "'prompts' must be a non-empty list of token-id lists")
    if len(ps) > MAX_BATCH:
        raise RequestError(422, f"'prompts' has {len(ps)} prompts; the limit is {MAX_BATCH}")
    return Generate(
        prompts=[_prompt(p, f"'prompts'[{i}]", max_tokens, limits) for i, p in enumerate(ps)],
        max_tokens=max_tokens,
        stream=stream,
        batch=True,
    )


def parse_reload(body: bytes) -> tuple[str | None, dict | None]:
    """``{}`` or ``{"path": "plans/x.yaml", "set": {"cudagraph.mode": "NONE"}}``."""
    obj = _object(body, RELOAD_FIELDS, allow_empty=True)
    path, sets = obj.get("path"), obj.get("set")
    if path is not None and (not isinstance(path, str) or not path):
        raise RequestError(400, "'path' must be a non-empty string (a plan or a table.json)")
    if sets is not None and not isinstance(sets, dict):
        raise RequestError(
            400,
            "'set' must be an object of dotted plan keys to values, e.g. "
            '{"cudagraph.mode": "NONE"}',
        )
    return path, sets
