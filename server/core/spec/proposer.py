"""What a proposer is: the engine asks it for drafts once per step, for every decoding request that
speculates. ``NgramProposer`` (server/core/spec/ngram.py) is the one built. A draft model, EAGLE or an
MTP head would implement the same call (their drafts would come with the draft's probabilities
for ``verify.rejection_sample``); docs/speculative.md says they are not built."""

from __future__ import annotations

from typing import Protocol, Sequence

from .config import SpeculativeConfig
from .ngram import NgramProposer


class Proposer(Protocol):
    k: int

    def propose(self, seqs: Sequence[Sequence[int]], ks: Sequence[int]) -> list[list[int]]:
        """For each sequence (prompt + output so far, ending with the token the step feeds), up to
        ``ks[i]`` draft tokens (fewer, or none, where it has no guess)."""
        ...


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.k, config.prompt_lookup_max, config.prompt_lookup_min)
    raise ValueError(f"speculative method {config.method!r} is not built")
