"""Request bodies of the OpenAI-compatible API (openai_api.py): parse and check them before anything
reaches the engine. Every problem is an APIError: a 4xx status, a message naming the field and the
fix, and OpenAI's ``param``/``code``."""

from __future__ import annotations

import json
from dataclasses import dataclass

from graphplan.compiler.errors import did_you_mean

from .protocol import RequestError

DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 256
FIELDS = (
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "stream",
    "stream_options",
    "n",
    "top_p",
    "best_of",
    "echo",
    "logprobs",
    "suffix",
    "stop",
    "seed",
    "user",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "return_token_ids",
    "stop_token_ids",
    "ignore_eos",
)
# accepted only at the value that means "off" (greedy, one choice, no extras)
NEUTRAL = {
    "n": (1,),
    "best_of": (1,),
    "top_p": (1, 1.0),
    "echo": (False,),
    "logprobs": (),
    "suffix": (),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
}


class APIError(RequestError):
    """A RequestError that also names the offending field (OpenAI's ``param``) and a code."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(status, message)
        self.param, self.code = param, code


def error_body(e: RequestError) -> dict:
    kind = (
        "rate_limit_error"
        if e.status == 429
        else "invalid_request_error"
        if e.status < 500
        else "server_error"
    )
    return {
        "error": {
            "message": e.message,
            "type": kind,
            "param": getattr(e, "param", None),
            "code": getattr(e, "code", None),
        }
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    prompts: list[list[int]]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop_token_ids: tuple[int, ...]


def parse_completion(
    body: bytes,
    limits: dict,
    *,
    model_name: str,
    tokenizer=None,
    default_stop: tuple[int, ...] = (),
) -> Completion:
    """A /v1/completions body, checked; text prompts tokenized with ``tokenizer``."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(obj).__name__}")
    for key in obj:
        if key not in FIELDS:
            hint = did_you_mean(key, FIELDS)
            raise APIError(400, f"unknown field {key!r}" + (f" ({hint})" if hint else ""), key)
    model = obj.get("model")
    if not isinstance(model, str):
        raise APIError(400, "'model' is required: the name GET /v1/models lists", "model")
    if model != model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {model_name!r}",
            "model",
            "model_not_found",
        )
    temperature = obj.get("temperature")
    if temperature not in (None, 0, 0.0):
        raise APIError(
            400,
            f"temperature {temperature!r} is not supported: this server "
            "decodes greedily; send temperature 0",
            "temperature",
        )
    for key, ok in NEUTRAL.items():
        if obj.get(key) is not None and obj[key] not in ok:
            raise APIError(
                400,
                f"{key!r} {obj[key]!r} is not supported (greedy decoding, "
                f"one choice per prompt): leave it out",
                key,
            )
    if obj.get("stop") not in (None, [], ""):
        raise APIError(
            400, "'stop' strings are not supported; stop on token ids with 'stop_token_ids'", "stop"
        )
    max_tokens = obj.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not _is_int(max_tokens) or max_tokens < 1:
        raise APIError(
            400, f"'max_tokens' must be an integer >= 1, not {max_tokens!r}", "max_tokens"
        )
    stream = obj.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be true or false, not {stream!r}", "stream")
    opts = obj.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise APIError(
            400, "'stream_options' takes {\"include_usage\": true|false}", "stream_options"
        )
    if opts and not stream:
        raise APIError(400, "'stream_options' needs 'stream': true", "stream_options")
    stop = obj.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(_is_int(t) for t in stop):
        raise APIError(400, "'stop_token_ids' must be a list of token ids", "stop_token_ids")
    if not isinstance(obj.get("ignore_eos", False), bool):
        raise APIError(400, "'ignore_eos' must be true or false", "ignore_eos")
    if not obj.get("ignore_eos"):
        stop = [*stop, *default_stop]
    prompts = [
        _check_prompt(p, where, max_tokens, limits, tokenizer)
        for p, where in _prompts(obj.get("prompt"))
    ]
    return Completion(
        prompts=prompts,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(opts.get("include_usage")),
        stop_token_ids=tuple(dict.fromkeys(stop)),
    )


def _prompts(p):
    """(prompt, where) pairs: one string, one id list, or a list of either."""
    if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
        return [(p, "prompt")]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_PROMPTS:
            raise APIError(
                400, f"'prompt' has {len(p)} prompts; the limit is {MAX_PROMPTS}", "prompt"
            )
        return [(x, f"prompt[{i}]") for i, x in enumerate(p)]
    raise APIError(
        400,
        "'prompt' must be a string, a list of token ids, or a non-empty list of either",
        "prompt",
    )


def _check_prompt(p, where: str, max_tokens: int, limits: dict, tokenizer) -> list[int]:
    if isinstance(p, str):
        if tokenizer is None:
            raise APIError(
                400, f"{where} is text, but this model has no tokenizer: send token ids", "prompt"
            )
        p = tokenizer.encode(p)
    if not isinstance(p, list) or not all(_is_int(t) for t in p):
        raise APIError(400, f"{where} must be a list of integer token ids", "prompt")
    if not p:
        raise APIError(400, f"{where} is empty", "prompt")
    vocab = limits["vocab_size"]
    bad = next((i for i, t in enumerate(p) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(
            400,
            f"{where}[{bad}]: token id {p[bad]} is outside the vocabulary 0..{vocab - 1}",
            "prompt",
        )
    cap = limits["max_model_len"]
    if len(p) + max_tokens > cap:
        raise APIError(
            400,
            f"{where} has {len(p)} tokens and max_tokens is {max_tokens}: "
            f"together they exceed the model's context of {cap} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    return list(p)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
