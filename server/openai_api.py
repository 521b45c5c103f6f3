"""The OpenAI-compatible API: ``GET /v1/models[/NAME]``, ``POST /v1/completions`` and
``POST /v1/chat/completions``, non-streaming or as server-sent events ending in ``data: [DONE]``.

Each prompt and each of its ``n`` choices is one engine request with its own SamplingParams (seed + i
for choice i). Text prompts and stop strings need the model's tokenizer; chat needs its chat
template. Every completion choice also carries its generated ids as ``token_ids`` (and the prompt's
as ``prompt_token_ids``), as vLLM does with ``return_token_ids``, so clients without a tokenizer
can read the result. A client that disconnects, or a stop string that matches, cancels the engine
request: its seat and KV blocks are freed at the next step."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from graphplan.compiler.errors import UsageError

from .chat import ChatTemplate, TemplateError
from .choices import Choice, Delta, usage
from .http_io import ClientGone, events, json_response, read_body
from .openai_format import chat_logprobs, completion_logprobs
from .openai_protocol import ChatCompletionRequest, CompletionRequest, parse
from .protocol import APIError, RequestError, error_body
from .requests import AsyncSink, Request
from .sampling_params import SamplingParams

MAX_CHOICES = 256
"""Prompts times n of one HTTP request."""
CHAT_RENDER_SECONDS = 5.0


class OpenAIFrontEnd:
    """The /v1 routes for one served model; built once by the Server."""

    def __init__(self, server: Any):
        self.server, self.engine, spec = server, server.engine, server.engine.spec
        self.model_name = spec.name
        self.created = int(time.time())
        self.tokenizer = spec.load_tokenizer()  # None: token-id prompts only
        self.eos = tuple(spec.stop_token_ids())
        source = spec.chat_template()
        try:
            self.chat = ChatTemplate(source) if source is not None else None
        except TemplateError as e:
            raise UsageError(str(e)) from None

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/v1/models", self.models, methods=["GET"])
        r.add_api_route("/v1/models/{name:path}", self.model, methods=["GET"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return r

    # -- routes -------------------------------------------------------------------------------
    async def models(self) -> Response:
        return json_response(200, {"object": "list", "data": [self._card()]})

    async def model(self, name: str) -> Response:
        self._check_model(name)
        return json_response(200, self._card())

    async def completions(self, request: HTTPRequest) -> Response:
        req = parse(CompletionRequest, await self._body(request))
        self._check_model(req.model)
        params = req.checked()
        prompts = [
            self._tokens(p, "prompt" if len(req.prompts()) == 1 else f"prompt[{i}]")
            for i, p in enumerate(req.prompts())
        ]
        echo = [self._decode(p) for p in prompts] if req.echo else None
        return await self._serve(
            request, "text_completion", params, prompts, req.stream, req.include_usage, echo
        )

    async def chat_completions(self, request: HTTPRequest) -> Response:
        req = parse(ChatCompletionRequest, await self._body(request))
        self._check_model(req.model)
        params = req.checked()
        if self.chat is None or self.tokenizer is None:
            raise APIError(
                400,
                f"model {self.model_name!r} has no chat template (chat_template.jinja or "
                "tokenizer_config.json's chat_template) and tokenizer: use /v1/completions, or "
                "serve a directory that has them",
                "messages",
                "no_chat_template",
            )
        messages = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
            for m in req.messages
        ]
        try:
            text = await asyncio.wait_for(
                asyncio.to_thread(self.chat.render, messages, req.add_generation_prompt),
                CHAT_RENDER_SECONDS,
            )
        except asyncio.TimeoutError:
            raise APIError(
                400, f"the chat template took more than {CHAT_RENDER_SECONDS} s", "messages"
            ) from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        prompt = self._tokens(list(ids), "messages")
        return await self._serve(
            request, "chat.completion", params, [prompt], req.stream, req.include_usage, None
        )

    # -- shared -------------------------------------------------------------------------------
    async def _body(self, request: HTTPRequest) -> bytes:
        return await read_body(request, self.server.max_body_bytes, self.server.idle_timeout)

    def _card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "graphplan",
            "max_model_len": self.engine.limits()["max_model_len"],
        }

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def _tokens(self, p: str | list[int], where: str) -> list[int]:
        if isinstance(p, str):
            if self.tokenizer is None:
                raise APIError(
                    400,
                    f"{where} is text, but this model has no tokenizer: send token ids",
                    "prompt",
                )
            p = list(self.tokenizer.encode(p))
        if not p:
            raise APIError(400, f"{where} is empty", "prompt")
        vocab = self.engine.limits()["vocab_size"]
        bad = next((i for i, t in enumerate(p) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400,
                f"{where}[{bad}]: token id {p[bad]} is outside the vocabulary 0..{vocab - 1}",
                "prompt",
            )
        return p

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def _requests(self, params: SamplingParams, prompts: list[list[int]], sink) -> list[Request]:
        if len(prompts) * params.n > MAX_CHOICES:
            raise APIError(
                400,
                f"{len(prompts)} prompts x n={params.n} choices is over the limit of "
                f"{MAX_CHOICES} per request",
                "n",
            )
        if params.stop and self.tokenizer is None:
            raise APIError(400, "'stop' strings need a tokenizer: use 'stop_token_ids'", "stop")
        limits = self.engine.limits()
        stop = tuple(dict.fromkeys(params.stop_token_ids + (() if params.ignore_eos else self.eos)))
        reqs = []
        for i, p in enumerate(prompts):
            new = params.max_new_tokens(
                len(p), vocab_size=limits["vocab_size"], max_model_len=limits["max_model_len"]
            )
            for j in range(params.n):
                choice = params.for_choice(j)
                reqs.append(
                    Request(
                        p,
                        new,
                        sink,
                        choice,
                        tag=i * params.n + j,
                        stop=stop,
                        logprobs=params.logprobs,
                    )
                )
        return reqs

    async def _serve(self, request, kind, params, prompts, stream, include_usage, echo) -> Response:
        sink = AsyncSink(asyncio.get_running_loop())
        reqs = self._requests(params, prompts, sink)
        self.engine.enqueue(reqs)
        choices = [Choice(r.tag, r, self.tokenizer, params.stop) for r in reqs]
        chat = kind == "chat.completion"
        meta = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind + (".chunk" if chat and stream else ""),
            "created": int(time.time()),
            "model": self.model_name,
        }
        run = self._run(request, sink, choices)
        if stream:
            gen = self._sse(run, choices, prompts, meta, chat, include_usage, echo, params.n)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
        try:
            async for _ in run:
                pass
        finally:
            self.engine.cancel([r for r in reqs if not r.finished])
        out = [self._final(c, chat, echo, params.n, prompts) for c in choices]
        return json_response(200, {**meta, "choices": out, "usage": usage(prompts, choices)})

    async def _run(
        self, request, sink, choices: list[Choice]
    ) -> AsyncIterator[tuple[Choice, Delta]]:
        left = len(choices)
        async for tag, kind, value in events(sink, request):
            c = choices[tag]
            if c.done:
                continue  # a stop string ended it; the engine's last events are dropped
            if kind == "error":
                raise value
            d = c.token(value) if kind == "token" else c.end(value)
            if c.done:
                left -= 1
                if not c.request.finished:
                    self.engine.cancel([c.request])
            yield c, d
            if not left:
                return

    def _final(self, c: Choice, chat: bool, echo, n: int, prompts) -> dict:
        prompt = prompts[c.index // n]
        if chat:
            return {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs, self.tokenizer)
                if c.request.logprobs is not None
                else None,
                "finish_reason": c.finish_reason,
            }
        head = echo[c.index // n] if echo else ""
        return {
            "index": c.index,
            "text": head + c.text,
            "logprobs": completion_logprobs(c.logprobs, self.tokenizer, len(head))
            if c.request.logprobs is not None
            else None,
            "finish_reason": c.finish_reason,
            "token_ids": c.token_ids,
            "prompt_token_ids": prompt,
        }

    async def _sse(self, run, choices, prompts, meta, chat, include_usage, echo, n):
        reqs = [c.request for c in choices]
        try:
            if chat:
                for c in choices:
                    yield _sse(
                        {
                            **meta,
                            "choices": [
                                {
                                    "index": c.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
            elif echo:
                for c in choices:
                    yield _sse(
                        {
                            **meta,
                            "choices": [
                                {
                                    "index": c.index,
                                    "text": echo[c.index // n],
                                    "logprobs": None,
                                    "finish_reason": None,
                                    "token_ids": [],
                                }
                            ],
                        }
                    )
            try:
                async for c, d in run:
                    yield _sse({**meta, "choices": [self._chunk(c, d, chat)]})
            except RequestError as e:
                yield _sse(error_body(e))
            if include_usage:
                yield _sse({**meta, "choices": [], "usage": usage(prompts, choices)})
            yield b"data: [DONE]\n\n"
        except ClientGone:
            pass
        finally:
            self.engine.cancel([r for r in reqs if not r.finished])

    def _chunk(self, c: Choice, d: Delta, chat: bool) -> dict:
        lp = c.request.logprobs is not None
        if chat:
            return {
                "index": c.index,
                "delta": {"content": d.text} if d.text or d.finish_reason is None else {},
                "logprobs": chat_logprobs(d.logprobs, self.tokenizer)
                if lp and d.logprobs
                else None,
                "finish_reason": d.finish_reason,
            }
        return {
            "index": c.index,
            "text": d.text,
            "logprobs": completion_logprobs(d.logprobs, self.tokenizer, 0)
            if lp and d.logprobs
            else None,
            "finish_reason": d.finish_reason,
            "token_ids": d.token_ids,
        }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
