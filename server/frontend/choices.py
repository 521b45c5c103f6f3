"""From a request's tokens to what its client sees: text decoded incrementally (a token whose bytes
do not yet form whole characters waits for the next), stop strings matched across token boundaries
and never emitted (server/frontend/stop_strings.py), logprobs, the finish reason, and the usage counts.
Pure Python over a ``Tokenizer``; one ``Choice`` per request (one prompt, one of ``n``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from graphplan.models import Tokenizer

try:  # tokenizers >= 0.21
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # the server serves token ids without it
    RustTokenizer = DecodeStream = None  # type: ignore[assignment,misc]

from ..requests import Request, Sampled
from .openai_responses import PromptTokensDetails, Usage
from .stop_strings import StopMatcher

WINDOW = 6
"""Tokens decoded before the new ones, so a tokenizer that joins words (spaces, byte fallback)
decodes the new ones in context."""


class Detokenizer:
    """Incremental decoding. With a fast tokenizer (a ``tokenizers.Tokenizer`` behind it), its
    ``DecodeStream`` (Rust) decodes each new token once, as vLLM's fast incremental detokenizer
    does; otherwise vLLM's prefix/read offsets: decode ``ids[prefix:]`` and emit what it adds to
    ``ids[prefix:read]``, O(window) per token, not O(length). Either way a token whose bytes do not
    yet form whole characters waits for the next, and ``flush`` gives what is still held."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = self._read = 0
        self._emitted = 0  # characters emitted (the stream's flush compares the whole text)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = (
            (backend, DecodeStream(skip_special_tokens=True))
            if DecodeStream is not None and isinstance(backend, RustTokenizer)
            else None
        )

    def add(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.append(token)
        if self._stream is not None:
            backend, stream = self._stream
            delta = stream.step(backend, token) or ""
        else:
            prefix_text = self._decode(self.ids[self._prefix : self._read])
            text = self._decode(self.ids[self._prefix :])
            if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
                return ""
            delta = text[len(prefix_text) :]
            self._prefix = max(0, len(self.ids) - WINDOW)
        if delta:
            self._read = len(self.ids)
            self._emitted += len(delta)
        return delta

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the end), as decoded."""
        if self.tokenizer is None or self._read == len(self.ids):
            return ""
        if self._stream is not None:
            text = self._decode(self.ids)
            self._read = len(self.ids)
            return text[self._emitted :]
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._read = len(self.ids)
        return text[len(prefix_text) :] if text.startswith(prefix_text) else ""

    def _decode(self, ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


def token_text(tokenizer: Tokenizer | None, token: int) -> str:
    """A token as logprobs show it (``token_id:N`` without a tokenizer, as vLLM does)."""
    if tokenizer is None:
        return f"token_id:{token}"
    return tokenizer.decode([token], skip_special_tokens=False)


@dataclass(slots=True)
class Delta:
    """What one choice adds in one step."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Sampled] = field(default_factory=list)
    finish_reason: str | None = None


class Choice:
    """One request's output as the client sees it. ``prompt_only`` (echo with max_tokens 0): the
    request runs for one token that is dropped, so the choice is its prompt's logprobs alone."""

    def __init__(
        self,
        index: int,
        request: Request,
        tokenizer: Tokenizer | None,
        stops,
        prompt_only: bool = False,
    ):
        self.index, self.request = index, request
        self.prompt_only = prompt_only
        self.detok = Detokenizer(tokenizer)
        self.matcher = StopMatcher(stops)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[Sampled] = []
        self.prompt_logprobs: list[Sampled] = [Sampled(request.prompt[0])]
        """Prompt position i's entry (position 0: no logprob), as the engine sends them."""
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def prompt(self, entries: list[Sampled]) -> None:
        """The logprobs of the next prompt positions (server/core/prompt_logprobs.py)."""
        self.prompt_logprobs += entries

    def token(self, s: Sampled) -> Delta:
        """A new token (ignored once the choice is done: a stop string ended it mid-step)."""
        if self.done:
            return Delta()
        if self.prompt_only:
            self.finish_reason = "length"
            return Delta(finish_reason="length")
        self.token_ids.append(s.token)
        d = Delta(token_ids=[s.token], logprobs=[s] if s.logprob is not None else [])
        self.logprobs += d.logprobs
        d.text = self.matcher.feed(self.detok.add(s.token))
        if self.matcher.matched is not None:
            _, d.finish_reason = self.matcher.finish()
            self.finish_reason = d.finish_reason
        self.text += d.text
        return d

    def end(self, reason: str) -> Delta:
        """The engine finished the request ("stop": a stop token; "length")."""
        if self.done:
            return Delta()
        rest = self.matcher.feed(self.detok.flush())
        held, self.finish_reason = self.matcher.finish(stop_token=reason == "stop")
        text = rest + held if self.matcher.matched is None else rest
        self.text += text
        return Delta(text=text, finish_reason=self.finish_reason)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def usage(prompts: Sequence[Sequence[int]], choices: Sequence[Choice]) -> Usage:
    prompt = sum(len(p) for p in prompts)
    gen = sum(c.completion_tokens for c in choices)
    n = max(1, len(choices) // max(1, len(prompts)))  # choices per prompt, prompt-major
    cached = [0] * len(prompts)
    for c in choices:  # a prompt's tokens count once: its choice that found the most cached
        cached[c.index // n] = max(cached[c.index // n], c.request.cached_tokens)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=gen,
        total_tokens=prompt + gen,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached)),
    )
