"""Request bodies of the OpenAI-compatible API as pydantic models: strict types (a string is never
taken for a number or a boolean, nor a float for an integer), unknown fields refused with a
did-you-mean, bounded sizes, and every problem an ``APIError`` (400) naming the field
(OpenAI's ``param``). Ranges of the sampling fields are SamplingParams' (one place)."""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from graphplan.compiler.errors import did_you_mean

from ..errors import APIError, RequestError
from ..sampling_params import SamplingParams
from .bodies import error_body

__all__ = ["APIError", "RequestError", "error_body", "parse"]

MAX_PROMPTS = 256
MAX_MESSAGES = 1024
MAX_TEXT = 1 << 20
MAX_IDS = 1 << 20
BIG = 2**63
Number = StrictFloat | StrictInt
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=-BIG, le=BIG)]], Field(max_length=MAX_IDS)]
PromptIds = Annotated[list[StrictInt], Field(max_length=MAX_IDS)]
"""A prompt's ids, any size (JSON's own bound: 4300 digits): the front end names one outside the
vocabulary, and the vocabulary (openai_api's ``_tokens``)."""
Text = Annotated[StrictStr, Field(max_length=MAX_TEXT)]
Stop = Text | Annotated[list[Text], Field(max_length=64)] | None


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(Body):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class Sampling(Body):
    """The fields both endpoints share (OpenAI's, and vLLM's extensions)."""

    model: Text
    max_tokens: Annotated[StrictInt, Field(ge=-BIG, le=BIG)] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: Annotated[StrictInt, Field(ge=-BIG, le=BIG)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[Text, Number] | None = None
    user: Text | None = None
    # vLLM's extensions
    top_k: Annotated[StrictInt, Field(ge=-BIG, le=BIG)] | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise APIError(400, "'logit_bias' is not supported; leave it out", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' needs 'stream': true", "stream_options")
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            n=self.n,
            logprobs=logprobs,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = Text | PromptIds | Annotated[list[Text] | list[PromptIds], Field(max_length=MAX_PROMPTS)]


class CompletionRequest(Sampling):
    prompt: Prompt
    max_tokens: Annotated[StrictInt, Field(ge=-BIG, le=BIG)] | None = 16
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=-BIG, le=BIG)] | None = None
    best_of: Annotated[StrictInt, Field(ge=-BIG, le=BIG)] | None = None
    suffix: Text | None = None
    return_token_ids: StrictBool | None = None

    def prompts(self) -> list[str | list[int]]:
        """One text or id list per prompt (a bare id list is one prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(
                400, "'prompt' must be a string or a list of token ids, not empty", "prompt"
            )
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def checked(self) -> SamplingParams:
        if self.suffix:
            raise APIError(400, "'suffix' is not supported; leave it out", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "'best_of' is not supported (other than equal to 'n')", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400,
                "'max_tokens' 0 generates nothing: it needs 'echo': true (the prompt alone, with "
                "its logprobs when 'logprobs' is set), or use max_tokens >= 1",
                "max_tokens",
            )
        # echo with max_tokens 0: the engine runs the prompt and one token, which is dropped
        return self.sampling_params(1 if self.prompt_only else self.max_tokens, self.logprobs)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: only the prompt (and its logprobs) is returned."""
        return self.echo and self.max_tokens == 0

    @property
    def prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token: ``logprobs`` when echoed, else None (none computed)."""
        return self.logprobs if self.echo else None


class TextPart(Body):
    type: Literal["text"]
    text: Text


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=256)] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None

    def text(self) -> str:
        c = self.content
        if c is None:
            return ""
        return c if isinstance(c, str) else "".join(p.text for p in c)


class ChatCompletionRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=-BIG, le=BIG)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=-BIG, le=BIG)] | None = None
    add_generation_prompt: StrictBool = True

    def checked(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else None
        limit = self.max_tokens if limit is None else limit
        return self.sampling_params(limit, (self.top_logprobs or 0) if self.logprobs else None)


T = TypeVar("T", bound=Body)


def parse(kind: type[T], body: bytes) -> T:
    """``body`` as a ``kind``, or APIError 400 naming the first problem and its field."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as e:
        raise _api_error(kind, e) from None


def _api_error(kind: type[Body], e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    # a union (prompt: text, ids, or lists of either) fails once per member: the deepest failure
    # is the one the client meant ("prompt[1]: ... integer, not 1.5", not "... a valid string")
    field = errors[0]["loc"][:1]
    err = max(
        errors,
        key=lambda x: sum(not _union_tag(p) for p in x["loc"]) if x["loc"][:1] == field else 0,
    )
    loc = [str(x) for x in err["loc"] if not _union_tag(x)]
    param = _dotted(loc) or None
    t = err["type"]
    if t == "json_invalid":
        return APIError(400, f"malformed JSON body: {err['msg']}")
    if t == "model_type" and not loc:
        return APIError(400, "the body must be a JSON object")
    if t == "extra_forbidden":
        fields = list(kind.model_fields) if len(loc) == 1 else []
        hint = did_you_mean(loc[-1], fields) if fields else None
        return APIError(400, f"unknown field {loc[-1]!r}" + (f" ({hint})" if hint else ""), param)
    if t == "missing":
        return APIError(400, f"'{param}' is required", param)
    shown = repr(err.get("input"))
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return APIError(400, f"'{param}': {err['msg']}, not {shown}", param)


def _union_tag(x) -> bool:
    """pydantic names the union member tried in ``loc`` ("str", "list[int]", ...): not a field."""
    return isinstance(x, str) and (
        x in ("str", "int", "float", "bool")
        or "[" in x
        or x.startswith(("function", "constrained"))
    )


def _dotted(loc: list[str]) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if x.isdigit() else (f".{x}" if out else x)
    return out
