"""A request as the continuous batcher (server/core/batching.py) keeps it: its prompt, what it
has generated, its seat and how many of its tokens are in the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

PLACEHOLDER = -1
"""A speculated token not read yet (``ContinuousBatcher.speculate``); never a real token id."""


@dataclass(kw_only=True, slots=True, eq=False)  # one per request, compared by identity
class _Request:
    id: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop: frozenset[int]
    row: int = -1
    computed: int = 0  # tokens whose K/V is in the cache
    output: list[int] = field(default_factory=list)
    root: bytes = b""  # prefix caching (prefix_blocks.py): its chain's start,
    keys: list[bytes] = field(default_factory=list)  # the keys of its full blocks,
    registered: int = 0  # how many of them the pool knows,
    cached: int = -1  # its tokens found cached at its first admission,
    lookup: bool = True  # whether it may start with cached blocks

    @property
    def ending(self) -> bool:
        """Its last token is already in ``output`` (a speculated placeholder, not read yet): it
        ends at that step, so the next step leaves it out. A request with its last real token is
        retired at once, so outside speculation this is never true of a running request."""
        return len(self.output) >= self.max_new_tokens

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache: 1 for a decode (the last generated token), more for a
        prompt, or for prompt + output again after a preemption."""
        return len(self.prompt) + len(self.output) - self.computed

    def chunk(self, n: int) -> tuple[int, ...]:
        """The next ``n`` tokens to put in the cache."""
        if self.computed < len(self.prompt):
            head = self.prompt[self.computed : self.computed + n]
            return head + tuple(self.output[: n - len(head)])
        start = self.computed - len(self.prompt)
        return tuple(self.output[start : start + n])
