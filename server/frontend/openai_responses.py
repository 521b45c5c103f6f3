"""Response bodies of the OpenAI-compatible API as pydantic models: every route's JSON is one of
these, serialized with ``body()`` / ``sse()``.

Which fields are present as ``null`` and which are left out follows OpenAI's OpenAPI spec
(github.com/openai/openai-openapi, ``CreateCompletionResponse``, ``CreateChatCompletionResponse``,
``CreateChatCompletionStreamResponse``) and the ``openai`` package's types generated from it:
a field the spec *requires* but allows to be null is always sent (``logprobs: null`` in every
choice, ``finish_reason: null`` in stream chunks until the last, ``content``/``refusal`` in a chat
message); an optional field that has no value is left out (``usage`` in stream chunks, ``role``
after a chat stream's first delta, the vLLM extensions ``token_ids``/``prompt_token_ids``).
Classes list the latter in ``OMIT_NONE``.

Two things the spec's types do not allow are sent on purpose, as OpenAI's legacy completions and
vLLM do: a completions stream chunk's ``finish_reason`` is null until the choice ends (the spec
shares the non-streaming type, whose finish_reason is not nullable; the ``openai`` client reads
chunks without validating them), and with ``echo`` + ``logprobs`` the first prompt token's entries
in ``token_logprobs`` and ``top_logprobs`` are null (it has no logprob: nothing precedes it)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_serializer

FinishReason = Literal["stop", "length"]


class Out(BaseModel):
    """A response object: fields named in ``OMIT_NONE`` are left out when None, every other
    field is always present (null when None)."""

    model_config = ConfigDict(extra="forbid")
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _leave_out_none(self, handler):
        d = handler(self)
        return {k: v for k, v in d.items() if v is not None or k not in self.OMIT_NONE}

    def body(self) -> bytes:
        return self.model_dump_json().encode() + b"\n"

    def sse(self) -> bytes:
        """One server-sent event: ``data: {json}`` and a blank line."""
        return b"data: " + self.model_dump_json().encode() + b"\n\n"


# -- errors and models ---------------------------------------------------------------------------
class ErrorInfo(Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Out):
    """The one error shape of every route: ``{"error": {message, type, param, code}}``."""

    error: ErrorInfo


class ModelCard(Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int
    """vLLM's extension: the context length served."""
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (vLLM's; None for the base model itself)."""


class ModelList(Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(Out):
    cached_tokens: int
    """Prompt tokens whose K/V came from the prefix cache (not computed again)."""


class Usage(Out):
    OMIT_NONE = frozenset({"prompt_tokens_details"})
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# -- /v1/completions -----------------------------------------------------------------------------
class CompletionLogprobs(Out):
    """Per returned token (with ``echo``, the prompt's tokens first): its text, its logprob, the
    top alternatives (text -> logprob, with the token itself: up to ``logprobs`` + 1 entries) and
    its text offset. The first prompt token's logprob and top are null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Out):
    OMIT_NONE = frozenset({"token_ids", "prompt_token_ids"})
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None
    """vLLM's ``return_token_ids``: the generated ids (of this chunk, when streaming)."""
    prompt_token_ids: list[int] | None = None


class Completion(Out):
    """A completion, or (``stream``) one chunk of one: the two share the shape."""

    OMIT_NONE = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- /v1/chat/completions ------------------------------------------------------------------------
class TopLogprob(Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Out):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatMessage(Out):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChatChoice(Out):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Out):
    OMIT_NONE = frozenset({"role", "content"})
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(Out):
    OMIT_NONE = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
