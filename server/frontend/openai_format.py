"""Logprobs in OpenAI's two shapes: completions' ``{tokens, token_logprobs, top_logprobs,
text_offset}`` and chat's ``{content: [{token, logprob, bytes, top_logprobs: [...]}]}``.

Completions follow the legacy API (and vLLM): ``top_logprobs`` holds the ``logprobs`` likeliest
tokens and the chosen one (so up to ``logprobs`` + 1 entries); an entry without a logprob (the
first prompt token with ``echo``) is null in both lists; ``text_offset`` is the running sum of the
returned tokens' text lengths from ``offset``. A logprob of -inf is sent as -9999.0, as vLLM does
(JSON has no infinities). Sources: vLLM's ``vllm/entrypoints/openai/serving_completion.py``
(``request_output_to_completion_response``: with echo, the prompt's logprobs then the output's;
``_create_completion_logprobs``: a position without logprobs is null in ``token_logprobs`` and
``top_logprobs``, the top holds the token and ``logprobs`` more), OpenAI's spec
(openai/openai-openapi ``CreateCompletionResponse.choices[].logprobs``)."""

from __future__ import annotations

from typing import Sequence

from graphplan.models import Tokenizer

from ..requests import Sampled
from .choices import token_text
from .openai_responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

FLOOR = -9999.0


def _lp(v: float) -> float:
    return max(v, FLOOR)


def completion_logprobs(
    steps: Sequence[Sampled], tokenizer: Tokenizer | None, offset: int = 0
) -> tuple[CompletionLogprobs, int]:
    """The logprobs of ``steps`` and the offset after their last token's text."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    for s in steps:
        text = token_text(tokenizer, s.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if s.logprob is None:
            tops.append(None)
            continue
        top = {token_text(tokenizer, t): _lp(lp) for t, lp in s.top}
        top.setdefault(text, _lp(s.logprob))
        tops.append(top)
    out = CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if s.logprob is None else _lp(s.logprob) for s in steps],
        top_logprobs=tops,
        text_offset=offsets,
    )
    return out, offset


def _entry(tokenizer: Tokenizer | None, token: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token)
    return TopLogprob(token=text, logprob=_lp(logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(steps: Sequence[Sampled], tokenizer: Tokenizer | None) -> ChatLogprobs:
    content = []
    for s in steps:
        assert s.logprob is not None  # generated tokens always carry theirs
        e = _entry(tokenizer, s.token, s.logprob)
        top = [_entry(tokenizer, t, lp) for t, lp in s.top]
        content.append(
            TokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes, top_logprobs=top)
        )
    return ChatLogprobs(content=content)
