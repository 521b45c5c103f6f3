"""``--speculative-config``: vLLM's JSON spelling, parsed as untrusted input.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 3}

Every error names the field and the fix (a ``SpeculativeConfigError``: the CLI prints it and exits
2). ``check_plan`` ties the config to the plan: a speculative step scores 1 + k tokens a request, so
the plan's ``scheduler.decode_query_len`` must be 1 + k (its FULL graphs for uniform decode are
sized in those multiples)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from graphplan.compiler.errors import GraphplanError

METHODS = ("ngram", "draft_model")
"""Methods built; ``eagle``, ``eagle3``, ``mtp`` and ``medusa`` are named in the error as not built
(docs/speculative.md)."""
NOT_BUILT = ("eagle", "eagle3", "mtp", "medusa", "suffix")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")


class SpeculativeConfigError(GraphplanError):
    exit_code = 2


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    """``draft_model``: the draft's checkpoint directory (checked like ``--model``)."""

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def query_len(self) -> int:
        """Tokens a decoding request puts in a speculative step: its last token and k drafts."""
        return 1 + self.num_speculative_tokens


def parse_speculative_config(text: str, where: str = "--speculative-config") -> SpeculativeConfig:
    """``text``: a JSON object in vLLM's spelling. Raises SpeculativeConfigError naming the field."""
    if len(text) > 4096:
        raise SpeculativeConfigError(f"{where}: {len(text)} characters; a config is a small object")
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise SpeculativeConfigError(
            f"{where}: not JSON ({e}); give an object such as "
            '\'{"method": "ngram", "num_speculative_tokens": 3}\''
        ) from None
    if not isinstance(raw, dict):
        raise SpeculativeConfigError(f"{where}: must be a JSON object, not {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise SpeculativeConfigError(
            f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(_KEYS)}"
        )
    method = raw.get("method")
    if method in NOT_BUILT:
        raise SpeculativeConfigError(
            f"{where}.method: {method!r} is not built in graphplan (docs/speculative.md); "
            f"use one of {', '.join(METHODS)}"
        )
    if method not in METHODS:
        raise SpeculativeConfigError(
            f"{where}.method: {method!r} is not a method; use one of {', '.join(METHODS)}"
        )
    k = _int(raw, "num_speculative_tokens", where, None, 1, MAX_SPECULATIVE_TOKENS)
    hi = _int(raw, "prompt_lookup_max", where, 4, 1, 64)
    lo = _int(raw, "prompt_lookup_min", where, min(hi, 1), 1, 64)
    if lo > hi:
        raise SpeculativeConfigError(
            f"{where}: prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}; make min <= max"
        )
    model = raw.get("model")
    if method == "draft_model":
        if not isinstance(model, str) or not 0 < len(model) <= 4096:
            raise SpeculativeConfigError(
                f"{where}.model: {method!r} needs the draft's checkpoint directory as a string"
            )
    elif model is not None:
        raise SpeculativeConfigError(f"{where}.model applies to method 'draft_model' only")
    return SpeculativeConfig(method, k, hi, lo, model)


def _int(raw: dict[str, Any], key: str, where: str, default, lo: int, hi: int) -> int:
    v = raw.get(key, default)
    if v is None:
        raise SpeculativeConfigError(f"{where}: {key} is required (an integer {lo}..{hi})")
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise SpeculativeConfigError(f"{where}.{key}: {v!r} must be an integer in {lo}..{hi}")
    return v


def check_plan(config: SpeculativeConfig, decode_query_len: int, plan: str = "the plan") -> None:
    """The plan must route uniform decode steps of 1 + k tokens a request."""
    if decode_query_len != config.query_len:
        raise SpeculativeConfigError(
            f"--speculative-config has num_speculative_tokens {config.k}, so a decode step scores "
            f"1 + {config.k} = {config.query_len} tokens a request, but {plan} has "
            f"scheduler.decode_query_len {decode_query_len}: set scheduler.decode_query_len: "
            f"{config.query_len} in the plan (or --set scheduler.decode_query_len={config.query_len}), "
            f"or num_speculative_tokens {decode_query_len - 1}"
        )
