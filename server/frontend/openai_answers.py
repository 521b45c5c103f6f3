"""From the choices of one OpenAI request to its answer: the whole response, or the server-sent
events of a stream, each built as a model of server/frontend/openai_responses.py.

``echo`` puts the prompt's text first in each completion choice; with ``logprobs`` too, the
prompt's tokens come first in its logprobs (the first one null), then the generated ones, and
``text_offset`` runs on over both. A stream sends a choice's echoed prompt (and its logprobs)
in that choice's first chunk, joined to its first generated text, as vLLM does
(``completion_stream_generator`` in vllm/entrypoints/openai/serving_completion.py): prompt
logprobs are known once the prompt is prefilled, which is when the first token is sampled. A chat stream
opens each choice with a ``role`` delta; with ``stream_options.include_usage`` the last event
before ``data: [DONE]`` is a usage chunk with no choices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Callable, cast

import pydantic_core

from graphplan.models import Tokenizer

from ..errors import RequestError
from ..requests import Request
from .bodies import error_model
from .choices import Choice, Delta, usage
from .http_io import ClientGone
from .openai_format import chat_logprobs, completion_logprobs
from .openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    Completion,
    CompletionChoice,
    FinishReason,
    Usage,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """One HTTP request: its prompts (each with ``n`` choices) and how it is answered."""

    id: str
    created: int
    model: str
    chat: bool
    n: int
    prompts: list[list[int]]
    include_usage: bool = False
    echo: list[str] | None = None
    """Per prompt, its text, put first in each of its choices (completions' ``echo``)."""

    def chunk(self, choices: list, usage: Usage | None = None):
        """One stream event's object."""
        kind = ChatCompletionChunk if self.chat else Completion
        return kind(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )


def final(job: Job, choices: list[Choice], tokenizer: Tokenizer | None):
    """The non-streaming response."""
    if job.chat:
        return ChatCompletion(
            id=job.id,
            created=job.created,
            model=job.model,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=ChatMessage(content=c.text),
                    logprobs=chat_logprobs(c.logprobs, tokenizer) if _lp(c) else None,
                    finish_reason=_reason(c.finish_reason),
                )
                for c in choices
            ],
            usage=usage(job.prompts, choices),
        )
    out = []
    for c in choices:
        head = job.echo[c.index // job.n] if job.echo else ""
        steps = (c.prompt_logprobs if job.echo else []) + c.logprobs
        out.append(
            CompletionChoice(
                index=c.index,
                text=head + c.text,
                logprobs=completion_logprobs(steps, tokenizer)[0] if _lp(c) else None,
                finish_reason=_reason(c.finish_reason),
                token_ids=c.token_ids,
                prompt_token_ids=job.prompts[c.index // job.n],
            )
        )
    return Completion(
        id=job.id,
        created=job.created,
        model=job.model,
        choices=out,
        usage=usage(job.prompts, choices),
    )


async def stream(
    job: Job,
    run: AsyncIterator[tuple[Choice, Delta]],
    choices: list[Choice],
    tokenizer: Tokenizer | None,
    cancel: Callable[[list[Request]], None],
    waiting: Callable[[], bool] = lambda: False,
) -> AsyncIterator[bytes]:
    """The events of a stream; ``cancel`` gets the unfinished requests when it ends. While
    ``waiting()`` says more of the request's events are already queued (the front end fell a step
    or more behind), events are joined into one write: the same bytes, fewer sends."""
    reqs = [c.request for c in choices]
    offsets = [0] * len(choices)  # text_offset of each choice's next token
    opened = [job.echo is None] * len(choices)  # its echoed prompt was sent
    held: list[bytes] = []
    try:
        if job.chat:
            for c in choices:
                first = ChatDelta(role="assistant", content="")
                opening = ChatChunkChoice(
                    index=c.index, delta=first, logprobs=None, finish_reason=None
                )
                held.append(job.chunk([opening]).sse())
        try:
            async for c, d in run:
                plain = d.finish_reason is None and not (_lp(c) and d.logprobs)
                if plain and (job.chat or opened[c.index]):  # most tokens: text alone
                    held.append(plain_chunk(job, c.index, d))
                else:
                    choice: ChatChunkChoice | CompletionChoice
                    if job.chat:
                        choice = _chat_chunk(c, d, tokenizer)
                    else:
                        choice = _completion_chunk(job, c, d, tokenizer, offsets, opened)
                    held.append(job.chunk([choice]).sse())
                if not waiting():
                    yield b"".join(held)
                    held.clear()
        except RequestError as e:
            held.append(error_model(e).sse())
        if job.include_usage:
            held.append(job.chunk([], usage(job.prompts, choices)).sse())
        held.append(b"data: [DONE]\n\n")
        yield b"".join(held)
    except ClientGone:
        pass
    finally:
        cancel([r for r in reqs if not r.finished])


def plain_chunk(job: Job, index: int, d: Delta) -> bytes:
    """The stream event of a choice's delta that is text alone (no logprobs, no finish reason, no
    echoed prompt; a completion's token ids): the bytes ``job.chunk([...]).sse()`` gives for it,
    serialized from a dict by pydantic's own encoder instead of through the response models
    (their wrap serializers are Python calls per model), as this is the event of nearly every
    token. tests/test_openai_responses.py holds the two equal."""
    if job.chat:
        kind = "chat.completion.chunk"
        choice: dict = {
            "index": index,
            "delta": {"content": d.text},
            "logprobs": None,
            "finish_reason": None,
        }
    else:
        kind = "text_completion"
        choice = {
            "index": index,
            "text": d.text,
            "logprobs": None,
            "finish_reason": None,
            "token_ids": d.token_ids,
        }
    body = {"id": job.id, "object": kind, "created": job.created, "model": job.model}
    return b"data: " + pydantic_core.to_json({**body, "choices": [choice]}) + b"\n\n"


def _completion_chunk(
    job: Job, c: Choice, d: Delta, tokenizer, offsets: list[int], opened: list[bool]
) -> CompletionChoice:
    """A completion choice's chunk: its echoed prompt (and the prompt's logprobs) first when it is
    the choice's first; ``offsets`` and ``opened`` are updated."""
    head, steps = "", d.logprobs
    if not opened[c.index]:
        assert job.echo is not None
        head, steps = job.echo[c.index // job.n], c.prompt_logprobs + steps
        opened[c.index] = True
    logprobs = None
    if _lp(c) and steps:
        logprobs, offsets[c.index] = completion_logprobs(steps, tokenizer, offsets[c.index])
    return CompletionChoice(
        index=c.index,
        text=head + d.text,
        logprobs=logprobs,
        finish_reason=_reason(d.finish_reason),
        token_ids=d.token_ids,
    )


def _chat_chunk(c: Choice, d: Delta, tokenizer: Tokenizer | None) -> ChatChunkChoice:
    return ChatChunkChoice(
        index=c.index,
        delta=ChatDelta(content=d.text) if d.text or d.finish_reason is None else ChatDelta(),
        logprobs=chat_logprobs(d.logprobs, tokenizer) if _lp(c) and d.logprobs else None,
        finish_reason=_reason(d.finish_reason),
    )


def _lp(c: Choice) -> bool:
    return c.request.logprobs is not None


def _reason(reason: str | None) -> FinishReason | None:
    assert reason in (None, "stop", "length"), reason
    return cast("FinishReason | None", reason)
