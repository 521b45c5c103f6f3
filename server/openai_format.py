"""Logprobs in OpenAI's two shapes: completions' ``{tokens, token_logprobs, top_logprobs,
text_offset}`` and chat's ``{content: [{token, logprob, bytes, top_logprobs: [...]}]}``."""

from __future__ import annotations

from typing import Sequence

from graphplan.models import Tokenizer

from .choices import token_text
from .requests import Sampled


def completion_logprobs(steps: Sequence[Sampled], tokenizer: Tokenizer | None, offset: int) -> dict:
    tokens, offsets = [], []
    for s in steps:
        text = token_text(tokenizer, s.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [s.logprob for s in steps],
        "top_logprobs": [
            {token_text(tokenizer, t): lp for t, lp in s.top} if s.top else None for s in steps
        ],
        "text_offset": offsets,
    }


def _entry(tokenizer: Tokenizer | None, token: int, logprob: float | None) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(steps: Sequence[Sampled], tokenizer: Tokenizer | None) -> dict:
    return {
        "content": [
            {
                **_entry(tokenizer, s.token, s.logprob),
                "top_logprobs": [_entry(tokenizer, t, lp) for t, lp in s.top],
            }
            for s in steps
        ]
    }
