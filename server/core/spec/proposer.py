"""What a proposer is: the engine asks it for drafts once per step, for every decoding request that
speculates. Built: ``NgramProposer`` (server/core/spec/ngram.py) and ``DraftModelProposer``
(server/core/spec/draft.py, greedy drafts). EAGLE or an MTP head would implement the same call
(sampled drafts would come with their probabilities for ``verify.rejection_sample``);
docs/speculative.md says they are not built."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from .config import SpeculativeConfig
from .ngram import NgramProposer


class Proposer(Protocol):
    k: int

    def propose(
        self, seqs: Sequence[Sequence[int]], ks: Sequence[int], rows: Sequence[int] = ()
    ) -> list[list[int]]:
        """For each sequence (prompt + output so far, ending with the token the step feeds), up to
        ``ks[i]`` draft tokens (fewer, or none, where it has no guess). ``rows``: each request's
        cache row (a draft model keeps its own KV per row). Called once per step, for every
        request that speculates in it."""
        ...


def build_proposer(config: SpeculativeConfig, engine: Any = None) -> Proposer:
    """``engine``: the target's (a draft model is built beside it, on its device)."""
    if config.method == "ngram":
        return NgramProposer(config.k, config.prompt_lookup_max, config.prompt_lookup_min)
    if config.method == "draft_model":
        from .draft import build_draft_proposer

        return build_draft_proposer(config, engine)
    raise ValueError(f"speculative method {config.method!r} is not built")
