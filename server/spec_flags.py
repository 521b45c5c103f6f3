"""graphplan-serve's speculative decoding flag, vLLM's ``--speculative-config`` JSON
(server/core/spec/config.py parses and checks it; docs/speculative.md)."""

from __future__ import annotations

import argparse
from typing import Any


def add_spec_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s spelling: \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(the plan's scheduler.decode_query_len must be 1 + num_speculative_tokens; steps run "
        "synchronously: docs/speculative.md)",
    )


def speculative_config(a: argparse.Namespace) -> Any:
    """The parsed ``--speculative-config`` (None without it); a draft model's checkpoint is
    checked as ``--model``'s is, before anything loads."""
    if a.speculative_config is None:
        return None
    from .core.hf_model import HFSpec
    from .core.spec.config import parse_speculative_config

    speculative = parse_speculative_config(a.speculative_config)
    if speculative.model is not None:
        HFSpec(model=speculative.model, random_weights=a.random_weights).check()
    return speculative
