"""The OpenAI-compatible API beside /generate: ``POST /v1/completions`` and ``GET /v1/models``.

    POST /v1/completions  {"model": NAME, "prompt": [ids] | [[ids], ...] | "text" | ["text", ...],
                           "max_tokens": 16, "temperature": 0, "stream": false,
                           "stream_options": {"include_usage": true}, "stop_token_ids": [ids],
                           "ignore_eos": false}
    GET  /v1/models, /v1/models/NAME

Greedy decoding only: ``temperature`` must be 0 (or absent). Text prompts need a tokenizer in the
model directory; every choice carries its generated ids as ``token_ids`` (and the prompt's as
``prompt_token_ids``), as vLLM does with ``return_token_ids``, so clients without a tokenizer can
read the result. Streams are server-sent events, one per token, ending in ``data: [DONE]``.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status
(5xx only for the server's own failures).
"""

from __future__ import annotations

import json
import logging
import queue
import time
import uuid
from dataclasses import dataclass

from graphplan.compiler.errors import did_you_mean
from examples.server.protocol import RequestError

log = logging.getLogger("graphplan.server")
DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 256
FIELDS = ("model", "prompt", "max_tokens", "temperature", "stream", "stream_options", "n", "top_p",
          "best_of", "echo", "logprobs", "suffix", "stop", "seed", "user", "frequency_penalty",
          "presence_penalty", "logit_bias", "return_token_ids", "stop_token_ids", "ignore_eos")
# accepted only at the value that means "off" (greedy, one choice, no extras)
NEUTRAL = {"n": (1,), "best_of": (1,), "top_p": (1, 1.0), "echo": (False,), "logprobs": (),
           "suffix": (), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
           "logit_bias": ({},)}


class APIError(RequestError):
    """A RequestError that also names the offending field (OpenAI's ``param``) and a code."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(status, message)
        self.param, self.code = param, code


def error_body(e: RequestError) -> dict:
    kind = ("invalid_request_error" if e.status < 500 and e.status not in (429, 503, 504)
            else "server_error" if e.status >= 500 else "rate_limit_error" if e.status == 429
            else "server_error")
    return {"error": {"message": e.message, "type": kind, "param": getattr(e, "param", None),
                      "code": getattr(e, "code", None)}}


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    prompts: list[list[int]]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop_token_ids: tuple[int, ...]


class OpenAIFrontEnd:
    """Answers /v1 requests for one served model; built once by the Server."""

    def __init__(self, spec):
        self.spec = spec
        self.model_name = spec.name
        self.created = int(time.time())
        self.tokenizer = None
        if hasattr(spec, "model"):  # a Hugging Face checkpoint: its tokenizer, if it has one
            from examples.server.hf_model import load_tokenizer
            self.tokenizer = load_tokenizer(spec.model)
        self.default_stop = tuple(spec.stop_token_ids())

    # -- dispatch (called by app.Handler) ---------------------------------------------------
    def handle(self, handler, method: str, path: str) -> None:
        try:
            if method == "GET" and path == "/v1/models":
                return _json(handler, 200, {"object": "list", "data": [self._card()]})
            if method == "GET" and path.startswith("/v1/models/"):
                name = path[len("/v1/models/"):]
                if name != self.model_name:
                    raise APIError(404, f"model {name!r} does not exist; this server serves "
                                   f"{self.model_name!r}", "model", "model_not_found")
                return _json(handler, 200, self._card())
            if method == "POST" and path == "/v1/completions":
                return self._completions(handler)
            if method == "POST":
                handler.close_connection = True  # the body was not read
            raise APIError(404, f"no such endpoint: {method} {path}")
        except RequestError as e:
            _json(handler, e.status, error_body(e))
        except Exception as e:  # noqa: BLE001 - a handler bug answers 500, the server lives on
            log.exception("%s %s failed", method, path)
            handler.close_connection = True
            _json(handler, 500, error_body(RequestError(500, f"internal error: "
                                                             f"{type(e).__name__}: {e}")))

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "graphplan", "max_model_len": self.spec.limits()["max_model_len"]}

    # -- /v1/completions --------------------------------------------------------------------
    def _completions(self, handler) -> None:
        app = handler.server.app
        c = self.parse(_read_body(handler, app.max_body_bytes), app.engine.limits())
        events, reqs = app.engine.submit(c.prompts, c.max_tokens, c.stream, c.stop_token_ids)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}
        try:
            if c.stream:
                self._stream(handler, events, reqs, c, meta, app.request_timeout)
            else:
                _wait_all(events, len(reqs), app.request_timeout)
                choices = [self._choice(i, r, c) for i, r in enumerate(reqs)]
                _json(handler, 200, {**meta, "choices": choices, "usage": _usage(reqs)})
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True
        finally:
            for r in reqs:  # a timed-out or disconnected client frees its seats
                r.cancelled = True

    def _choice(self, index: int, r, c: Completion) -> dict:
        return {"index": index, "text": self._decode(r.out), "logprobs": None,
                "finish_reason": _finish_reason(r, c), "token_ids": list(r.out),
                "prompt_token_ids": list(r.prompt)}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def _stream(self, handler, events, reqs, c: Completion, meta: dict, timeout: float) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        sent = [""] * len(reqs)  # text sent so far per choice (decoded incrementally)
        left = len(reqs)
        usage = {"usage": None} if c.include_usage else {}
        while left:
            try:
                tag, kind, val = events.get(timeout=timeout)
            except queue.Empty:
                _event(handler, error_body(RequestError(504, f"no token in {timeout} s")))
                break
            r = reqs[tag]
            if kind == "error":
                _event(handler, error_body(val))
                break
            choice = {"index": tag, "text": "", "logprobs": None, "finish_reason": None,
                      "token_ids": []}
            if kind == "token":
                choice["token_ids"] = [val]
            else:  # done: flush any text held back, name the finish reason
                left -= 1
                choice["finish_reason"] = _finish_reason(r, c)
            text = self._decode(r.out) if self.tokenizer else ""
            if text.startswith(sent[tag]) and (kind == "done" or not text.endswith("\ufffd")):
                choice["text"], sent[tag] = text[len(sent[tag]):], text
            _event(handler, {**meta, "choices": [choice], **usage})
        if c.include_usage:
            _event(handler, {**meta, "choices": [], "usage": _usage(reqs)})
        _chunk(handler, b"data: [DONE]\n\n")
        handler.wfile.write(b"0\r\n\r\n")

    # -- parsing ----------------------------------------------------------------------------
    def parse(self, body: bytes, limits: dict) -> Completion:
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
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", "model", "model_not_found")
        temperature = obj.get("temperature")
        if temperature not in (None, 0, 0.0):
            raise APIError(400, f"temperature {temperature!r} is not supported: this server "
                           "decodes greedily; send temperature 0", "temperature")
        for key, ok in NEUTRAL.items():
            if obj.get(key) is not None and obj[key] not in ok:
                raise APIError(400, f"{key!r} {obj[key]!r} is not supported (greedy decoding, "
                               f"one choice per prompt): leave it out", key)
        if obj.get("stop") not in (None, [], ""):
            raise APIError(400, "'stop' strings are not supported; stop on token ids with "
                           "'stop_token_ids'", "stop")
        max_tokens = obj.get("max_tokens")
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        if not _is_int(max_tokens) or max_tokens < 1:
            raise APIError(400, f"'max_tokens' must be an integer >= 1, not {max_tokens!r}",
                           "max_tokens")
        stream = obj.get("stream") or False
        if not isinstance(stream, bool):
            raise APIError(400, f"'stream' must be true or false, not {stream!r}", "stream")
        opts = obj.get("stream_options") or {}
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise APIError(400, "'stream_options' takes {\"include_usage\": true|false}",
                           "stream_options")
        if opts and not stream:
            raise APIError(400, "'stream_options' needs 'stream': true", "stream_options")
        stop = obj.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(_is_int(t) for t in stop):
            raise APIError(400, "'stop_token_ids' must be a list of token ids", "stop_token_ids")
        if not isinstance(obj.get("ignore_eos", False), bool):
            raise APIError(400, "'ignore_eos' must be true or false", "ignore_eos")
        if not obj.get("ignore_eos"):
            stop = [*stop, *self.default_stop]
        prompts = [self._check_prompt(p, where, max_tokens, limits)
                   for p, where in self._prompts(obj.get("prompt"))]
        return Completion(prompts=prompts, max_tokens=max_tokens, stream=stream,
                          include_usage=bool(opts.get("include_usage")),
                          stop_token_ids=tuple(dict.fromkeys(stop)))

    def _prompts(self, p):
        """(prompt, where) pairs: one string, one id list, or a list of either."""
        if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
            return [(p, "prompt")]
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            if len(p) > MAX_PROMPTS:
                raise APIError(400, f"'prompt' has {len(p)} prompts; the limit is {MAX_PROMPTS}",
                               "prompt")
            return [(x, f"prompt[{i}]") for i, x in enumerate(p)]
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a non-empty list "
                       "of either", "prompt")

    def _check_prompt(self, p, where: str, max_tokens: int, limits: dict) -> list[int]:
        if isinstance(p, str):
            if self.tokenizer is None:
                raise APIError(400, f"{where} is text, but this model has no tokenizer: send "
                               "token ids", "prompt")
            p = self.tokenizer.encode(p)
        if not isinstance(p, list) or not all(_is_int(t) for t in p):
            raise APIError(400, f"{where} must be a list of integer token ids", "prompt")
        if not p:
            raise APIError(400, f"{where} is empty", "prompt")
        vocab = limits["vocab_size"]
        bad = next((i for i, t in enumerate(p) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{where}[{bad}]: token id {p[bad]} is outside the vocabulary "
                           f"0..{vocab - 1}", "prompt")
        cap = limits["max_model_len"]
        if len(p) + max_tokens > cap:
            raise APIError(400, f"{where} has {len(p)} tokens and max_tokens is {max_tokens}: "
                           f"together they exceed the model's context of {cap} tokens",
                           "max_tokens", "context_length_exceeded")
        return list(p)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finish_reason(r, c: Completion) -> str:
    return "stop" if r.out and r.out[-1] in c.stop_token_ids else "length"


def _usage(reqs) -> dict:
    prompt, gen = sum(len(r.prompt) for r in reqs), sum(len(r.out) for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}


def _wait_all(events, n: int, timeout: float) -> None:
    errors = {}
    while n:
        try:
            tag, kind, val = events.get(timeout=timeout)
        except queue.Empty:
            raise RequestError(504, f"no result in {timeout} s") from None
        if kind != "token":
            n -= 1
            if kind == "error":
                errors[tag] = val
    if errors:
        tag, e = min(errors.items())
        raise RequestError(e.status, f"prompt[{tag}]: {e.message}")


def _read_body(handler, limit: int) -> bytes:
    length = handler.headers.get("Content-Length")
    if length is None:
        handler.close_connection = True
        raise APIError(411, "send the JSON body with a Content-Length header")
    try:
        n = int(length)
    except ValueError:
        handler.close_connection = True
        raise APIError(400, f"bad Content-Length {length!r}") from None
    if n > limit or n < 0:
        handler.close_connection = True  # the body stays unread
        raise APIError(413, f"body of {n} bytes is over the limit of {limit} bytes")
    return handler.rfile.read(n)


def _json(handler, status: int, obj) -> None:
    data = (json.dumps(obj) + "\n").encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    if handler.close_connection:
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(data)


def _chunk(handler, data: bytes) -> None:
    handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


def _event(handler, obj) -> None:
    _chunk(handler, b"data: " + json.dumps(obj).encode() + b"\n\n")
