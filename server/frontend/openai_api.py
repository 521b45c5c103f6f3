"""The OpenAI-compatible API: ``GET /v1/models[/NAME]``, ``POST /v1/completions`` and
``POST /v1/chat/completions``, non-streaming or as server-sent events ending in ``data: [DONE]``.

Each prompt and each of its ``n`` choices is one engine request with its own SamplingParams (seed + i
for choice i). Text prompts and stop strings need the model's tokenizer; chat needs its chat
template. Every completion choice also carries its generated ids as ``token_ids`` (and the prompt's
as ``prompt_token_ids``), as vLLM does with ``return_token_ids``, so clients without a tokenizer
can read the result. ``echo`` with ``logprobs`` asks the engine for the prompt's logprobs
(server/core/prompt_logprobs.py); ``echo`` with ``max_tokens`` 0 returns the prompt alone. Responses
are server/frontend/openai_responses.py's models, built by server/frontend/openai_answers.py. A client that
disconnects, or a stop string that matches, cancels the engine request: its seat and KV blocks
are freed at the next step."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from graphplan.compiler.errors import UsageError

from ..errors import APIError
from ..requests import AsyncSink, Request
from ..sampling_params import SamplingParams
from . import openai_answers as answers
from .chat import ChatTemplate, TemplateError
from .choices import Choice, Delta
from .http_io import events, read_body
from .lora_routes import LoraRoutes
from .openai_answers import Job
from .openai_protocol import ChatCompletionRequest, CompletionRequest, parse
from .openai_responses import ModelCard, ModelList, Out

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
        self.lora = LoraRoutes(self, getattr(spec, "lora_modules", ()))
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
        self.lora.add_routes(r)
        return r

    # -- routes -------------------------------------------------------------------------------
    async def models(self) -> Response:
        cards = [self._card(n) for n in (None, *self.lora.names)]
        return _json(ModelList(data=cards))

    async def model(self, name: str) -> Response:
        return _json(self._card(self._check_model(name)))

    async def completions(self, request: HTTPRequest) -> Response:
        req = parse(CompletionRequest, await self._body(request))
        lora = self._check_model(req.model)
        params = req.checked()
        texts = req.prompts()
        prompts = [
            self._tokens(p, "prompt" if len(texts) == 1 else f"prompt[{i}]")
            for i, p in enumerate(texts)
        ]
        echo = [self._decode(p) for p in prompts] if req.echo else None
        job = self._job(False, params, prompts, req.include_usage, echo, req.model)
        return await self._serve(
            request, job, params, req.stream, req.prompt_logprobs, req.prompt_only, lora
        )

    async def chat_completions(self, request: HTTPRequest) -> Response:
        req = parse(ChatCompletionRequest, await self._body(request))
        lora = self._check_model(req.model)
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
        job = self._job(True, params, [prompt], req.include_usage, None, req.model)
        return await self._serve(request, job, params, req.stream, lora=lora)

    # -- shared -------------------------------------------------------------------------------
    async def _body(self, request: HTTPRequest) -> bytes:
        return await read_body(request, self.server.max_body_bytes, self.server.idle_timeout)

    def _card(self, lora: str | None = None) -> ModelCard:
        """The base model's card, or a LoRA adapter's (``parent``: the base model)."""
        return ModelCard(
            id=lora or self.model_name,
            created=self.created,
            owned_by="graphplan",
            max_model_len=self.engine.limits()["max_model_len"],
            root=self.model_name,
            parent=self.model_name if lora else None,
        )

    def _job(
        self, chat: bool, params, prompts, include_usage: bool, echo, model: str | None = None
    ) -> Job:
        return Job(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model or self.model_name,
            chat=chat,
            n=params.n,
            prompts=prompts,
            include_usage=include_usage,
            echo=echo,
        )

    def _check_model(self, name: str) -> str | None:
        """The LoRA adapter ``name`` picks (None: the base model); APIError 404 if unknown."""
        return self.lora.lora_of(name)

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
            t = p[bad]  # JSON allows 4300 digits
            shown = str(t) if abs(t).bit_length() <= 133 else f"of {abs(t).bit_length()} bits"
            raise APIError(
                400,
                f"{where}[{bad}]: token id {shown} is outside the vocabulary 0..{vocab - 1} "
                f"of model {self.model_name!r}",
                "prompt",
            )
        return p

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def _requests(
        self, params: SamplingParams, prompts: list[list[int]], sink, prompt_logprobs: int | None
    ) -> list[Request]:
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
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        return reqs

    async def _serve(
        self,
        request,
        job: Job,
        params: SamplingParams,
        stream: bool,
        prompt_logprobs: int | None = None,
        prompt_only: bool = False,
        lora: str | None = None,
    ) -> Response:
        sink = AsyncSink(asyncio.get_running_loop())
        reqs = self._requests(params, job.prompts, sink, prompt_logprobs)
        for r in reqs:
            r.lora = lora
        self.engine.enqueue(reqs)
        choices = [Choice(r.tag, r, self.tokenizer, params.stop, prompt_only) for r in reqs]
        run = self._run(request, sink, choices)
        if stream:
            # the first token (or the engine's refusal: a full queue is a 429, not an SSE error)
            # before the response starts
            try:
                first = await anext(run)
            except BaseException:
                self.engine.cancel([r for r in reqs if not r.finished])
                raise
            gen = answers.stream(
                job,
                _after(first, run),
                choices,
                self.tokenizer,
                self.engine.cancel,
                waiting=lambda: not sink.queue.empty(),
            )
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
        try:
            async for _ in run:
                pass
        finally:
            self.engine.cancel([r for r in reqs if not r.finished])
        return _json(answers.final(job, choices, self.tokenizer))

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
            if kind == "prompt_logprobs":
                c.prompt(value)
                continue
            d = c.token(value) if kind == "token" else c.end(value)
            if c.done:
                left -= 1
                if not c.request.finished:  # a stop string: served whole, counted as 200
                    self.engine.cancel([c.request], status=200)
            yield c, d
            if not left:
                return


async def _after(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


def _json(body: Out) -> Response:
    return Response(body.body(), 200, media_type="application/json")
