"""What one request asks of the sampler, checked once when it is built (OpenAI's and vLLM's ranges).

Every bad value is an ``APIError`` (400) naming the field, its allowed range and the value sent, so
an HTTP layer can hand it to the client as is. Pure Python: no torch.

    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1, stop=["\\n\\n"], max_tokens=64)
    new_tokens = params.max_new_tokens(len(prompt), vocab_size=v, max_model_len=4096)
    for i in range(params.n): choice = params.for_choice(i)  # n=1, seed+i: one sampler row each
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import APIError

GREEDY_BELOW = 1e-5
"""A temperature under this samples greedily (vLLM's epsilon): dividing by it would overflow."""
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
SEED_RANGE = (-(2**63), 2**64)
"""Seeds torch.Generator.manual_seed takes; the sampler uses a seed modulo 2**64."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    """0 (or under 1e-5) = greedy: the argmax of the penalised logits; 0..2."""
    top_p: float = 1.0
    """Sample from the smallest set of likeliest tokens whose probability reaches top_p; (0, 1]."""
    top_k: int = 0
    """Sample from the k likeliest tokens (ties at the k-th kept); 0 or -1 = off."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the likeliest one; 0..1, 0 = off."""
    seed: int | None = None
    """Same seed, prompt and params: the same tokens, whatever else shares the batch."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token generated so far; -2..2."""
    frequency_penalty: float = 0.0
    """Times the number of times a token was generated so far, subtracted from its logit; -2..2."""
    repetition_penalty: float = 1.0
    """A logit of a token in the prompt or generated so far is divided by it when positive,
    multiplied by it when not (> 0; 1 = off)."""
    n: int = 1
    """Choices per prompt: ``for_choice(i)`` gives each its own row (seed + i)."""
    logprobs: int | None = None
    """Return the chosen token's logprob and this many top logprobs per step; 0..20."""
    stop: tuple[str, ...] = ()
    """Strings that end the text (not included in it); a str or a list of them is accepted."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the text (the token itself is generated, as EOS is)."""
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """New tokens at most; None = up to the model's context length."""

    def __post_init__(self) -> None:
        _number(self, "temperature", 0.0, MAX_TEMPERATURE)
        _number(self, "top_p", 0.0, 1.0, low_open=True)
        _integer(self, "top_k", -1, None)
        _number(self, "min_p", 0.0, 1.0)
        if self.seed is not None:
            _integer(self, "seed", SEED_RANGE[0], SEED_RANGE[1] - 1)
        _number(self, "presence_penalty", -MAX_PENALTY, MAX_PENALTY)
        _number(self, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY)
        _number(self, "repetition_penalty", 0.0, math.inf, low_open=True)
        _integer(self, "n", 1, MAX_N)
        if self.logprobs is not None:
            _integer(self, "logprobs", 0, MAX_LOGPROBS)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            _fail("stop", f"must be a string or a list of strings, not {_shown(self.stop)}")
        if len(stop) > MAX_STOPS:
            _fail("stop", f"has {len(stop)} strings; the limit is {MAX_STOPS}")
        for i, s in enumerate(stop):
            if not 0 < len(s) <= MAX_STOP_CHARS:
                _fail(
                    "stop",
                    f"strings must have 1..{MAX_STOP_CHARS} characters; string {i} has {len(s)}",
                )
        object.__setattr__(self, "stop", tuple(dict.fromkeys(stop)))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            _fail("stop_token_ids", f"must be a list of token ids (>= 0), not {_shown(ids)}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", f"has {len(ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}")
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(ids)))
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", f"must be true or false, not {_shown(self.ignore_eos)}")
        if self.max_tokens is not None:
            _integer(self, "max_tokens", 1, None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def truncates(self) -> bool:
        """A sampled request that keeps fewer than all tokens (top_k, top_p or min_p on): the
        sampler then finds each row's threshold (a sort over the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def penalised(self) -> bool:
        """Any penalty away from its neutral value (the sampler then reads the row's history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def for_choice(self, index: int) -> SamplingParams:
        """Choice ``index`` of ``n`` as a request of its own: n=1 and, when seeded, seed + index
        (vLLM's rule), so that the n choices differ and each is reproducible."""
        if not 0 <= index < self.n:
            raise ValueError(f"choice {index} is outside 0..{self.n - 1}")
        seed = None if self.seed is None else (self.seed + index) % 2**64
        return replace(self, n=1, seed=seed)

    def max_new_tokens(self, prompt_len: int, *, vocab_size: int, max_model_len: int) -> int:
        """The request's token budget against the model: ``max_tokens`` (None: the rest of the
        context); stop token ids must be in the vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            _fail("stop_token_ids", f"{bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
        room = max_model_len - prompt_len
        wanted = room if self.max_tokens is None else self.max_tokens
        if room < 1 or wanted > room:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens and max_tokens is "
                f"{self.max_tokens if self.max_tokens is not None else 'unset'}: the model's "
                f"context is {max_model_len} tokens; shorten the prompt or lower max_tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        return wanted


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _fail(field: str, what: str):
    raise APIError(400, f"'{field}' {what}", field)


def _number(p: SamplingParams, field: str, low: float, high: float, low_open=False) -> None:
    v = getattr(p, field)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        _fail(field, f"must be a number, not {_shown(v)}")
    too_low = v <= low if low_open else v < low
    if not math.isfinite(v) or too_low or v > high:
        bound = "above" if low_open else "at least"
        top = "" if math.isinf(high) else f" and at most {high:g}"
        _fail(field, f"must be {bound} {low:g}{top}, not {_shown(v)}")
    object.__setattr__(p, field, float(v))


def _integer(p: SamplingParams, field: str, low: int, high: int | None) -> None:
    v = getattr(p, field)
    if not _is_int(v):
        _fail(field, f"must be an integer, not {_shown(v)}")
    if v < low or (high is not None and v > high):
        top = "" if high is None else f" and at most {high}"
        _fail(field, f"must be at least {low}{top}, not {_shown(v)}")
