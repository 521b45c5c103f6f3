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

from .model import ServingSpec
from .openai_protocol import APIError, Completion, RequestError, error_body, parse_completion

log = logging.getLogger("graphplan.server")


class OpenAIFrontEnd:
    """Answers /v1 requests for one served model; built once by the Server."""

    def __init__(self, spec: ServingSpec):
        self.spec = spec
        self.model_name = spec.name
        self.created = int(time.time())
        self.tokenizer = spec.load_tokenizer()  # None: token-id prompts only
        self.default_stop = tuple(spec.stop_token_ids())

    # -- dispatch (called by app.Handler) ---------------------------------------------------
    def handle(self, handler, method: str, path: str) -> None:
        try:
            if method == "GET" and path == "/v1/models":
                return _json(handler, 200, {"object": "list", "data": [self._card()]})
            if method == "GET" and path.startswith("/v1/models/"):
                name = path[len("/v1/models/") :]
                if name != self.model_name:
                    raise APIError(
                        404,
                        f"model {name!r} does not exist; this server serves {self.model_name!r}",
                        "model",
                        "model_not_found",
                    )
                return _json(handler, 200, self._card())
            if method == "POST" and path == "/v1/completions":
                return self._completions(handler)
            if method == "POST":
                handler.close_connection = True  # the body was not read
            raise APIError(404, f"no such endpoint: {method} {path}")
        except RequestError as e:
            _json(handler, e.status, error_body(e))
        except Exception as e:
            log.exception("%s %s failed", method, path)
            handler.close_connection = True
            _json(
                handler,
                500,
                error_body(RequestError(500, f"internal error: {type(e).__name__}: {e}")),
            )

    def _card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "graphplan",
            "max_model_len": self.spec.limits()["max_model_len"],
        }

    # -- /v1/completions --------------------------------------------------------------------
    def _completions(self, handler) -> None:
        app = handler.server.app
        c = parse_completion(
            _read_body(handler, app.max_body_bytes),
            app.engine.limits(),
            model_name=self.model_name,
            tokenizer=self.tokenizer,
            default_stop=self.default_stop,
        )
        events, reqs = app.engine.submit(c.prompts, c.max_tokens, c.stream, c.stop_token_ids)
        meta = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
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
        return {
            "index": index,
            "text": self._decode(r.out),
            "logprobs": None,
            "finish_reason": _finish_reason(r, c),
            "token_ids": list(r.out),
            "prompt_token_ids": list(r.prompt),
        }

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def _stream(self, handler, events, reqs, c: Completion, meta: dict, timeout: float) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        sent = [""] * len(reqs)  # text sent so far per choice (decoded incrementally)
        ids: list[list[int]] = [[] for _ in reqs]  # tokens seen in events (r.out may be ahead)
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
            choice = {
                "index": tag,
                "text": "",
                "logprobs": None,
                "finish_reason": None,
                "token_ids": [],
            }
            if kind == "token":
                choice["token_ids"] = [val]
                ids[tag].append(val)
            else:  # done: flush any text held back, name the finish reason
                left -= 1
                choice["finish_reason"] = _finish_reason(r, c)
            text = self._decode(ids[tag] if kind == "token" else r.out)
            if text.startswith(sent[tag]) and (kind == "done" or not text.endswith("\ufffd")):
                choice["text"], sent[tag] = text[len(sent[tag]) :], text
            _event(handler, {**meta, "choices": [choice], **usage})
        if c.include_usage:
            _event(handler, {**meta, "choices": [], "usage": _usage(reqs)})
        _chunk(handler, b"data: [DONE]\n\n")
        handler.wfile.write(b"0\r\n\r\n")


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
