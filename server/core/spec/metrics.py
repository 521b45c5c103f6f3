"""Speculative decoding's counters, vLLM's ``spec_decode_*`` spelled ``graphplan_spec_decode_*``:

    graphplan_spec_decode_num_drafts_total              requests that carried drafts, per step
    graphplan_spec_decode_num_draft_tokens_total        draft tokens scored
    graphplan_spec_decode_num_accepted_tokens_total     draft tokens accepted
    graphplan_spec_decode_num_accepted_tokens_per_pos_total{position}   accepted at position 0..k-1

The acceptance rate is accepted / draft tokens; mean accepted length 1 + accepted / drafts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

PREFIX = "graphplan_spec_decode_"


class SpecMetrics:
    def __init__(self, registry: CollectorRegistry, k: int):
        self.drafts = Counter(
            PREFIX + "num_drafts", "Drafts scored (one per request per step).", registry=registry
        )
        self.draft_tokens = Counter(
            PREFIX + "num_draft_tokens", "Draft tokens scored.", registry=registry
        )
        self.accepted_tokens = Counter(
            PREFIX + "num_accepted_tokens", "Draft tokens accepted.", registry=registry
        )
        self.per_pos = Counter(
            PREFIX + "num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first).",
            ["position"],
            registry=registry,
        )
        for p in range(k):  # every position's series from the start (0 until one is accepted)
            self.per_pos.labels(str(p))

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        self.drafts.inc()
        self.draft_tokens.inc(num_drafts)
        self.accepted_tokens.inc(num_accepted)
        for p in range(num_accepted):
            self.per_pos.labels(str(p)).inc()
