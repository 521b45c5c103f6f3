"""Capture on demand: which graphs a runner captures at start, and the queue of the rest.

With ``cudagraph.on_demand`` (or ``GraphRunner(on_demand=True)``) capture takes the *start set*:
the largest graph of each routine (table order puts it first, so the shared pool and the static
outputs are sized by it and later graphs fit in what it left) and every graph whose size is in
``settings.start_sizes``. A step routed to a graph not captured yet runs eager (metrics reason
``not_captured_yet``) and queues the graph; the runner captures at most one queued graph before
the next step, into the same pool. A graph whose capture failed stays eager for good
(``capture_failed``), with its reason logged; nothing else is released.
"""

from __future__ import annotations

from collections import deque

NOT_CAPTURED_YET = "not_captured_yet"
CAPTURE_FAILED = "capture_failed"


def start_graph_ids(table) -> set[int]:
    """The graphs captured at start: the first (largest) of each routine, and those of
    ``settings.start_sizes``."""
    sizes = set(table.settings.start_sizes)
    first: dict[str, int] = {}
    for g in table.graphs:
        first.setdefault(g.routine, g.id)
    return set(first.values()) | {g.id for g in table.graphs if g.key.num_tokens in sizes}


class OnDemandQueue:
    """Graphs waiting for capture (first use order) and graphs that stay eager, with counts."""

    def __init__(self, start: set[int], wanted: list[int]):
        self.later = set(wanted) - start
        """Graphs this runner captures on first use (the captured modes, not the start set)."""
        self.waiting: deque[int] = deque()
        self._queued: set[int] = set()
        self.failed: dict[int, str] = {}
        self.at_start = len(start)
        self.on_demand = 0
        self.seconds = 0.0
        self.uncaptured = len(self.later)

    def missing(self, gid: int) -> str | None:
        """A step needed graph ``gid``, which is not captured: queue it; the eager reason (None
        for a graph this runner does not capture at all, e.g. of a mode left out, or -1)."""
        if gid not in self.later:
            return None
        if gid in self.failed:
            return CAPTURE_FAILED
        if gid not in self._queued:
            self._queued.add(gid)
            self.waiting.append(gid)
        return NOT_CAPTURED_YET

    def next(self) -> int:
        gid = self.waiting.popleft()
        self._queued.discard(gid)
        return gid

    def captured(self, seconds: float) -> None:
        self.on_demand += 1
        self.uncaptured -= 1
        self.seconds += seconds

    def gave_up(self, gid: int, reason: str) -> None:
        self.failed[gid] = reason
        self.uncaptured -= 1

    def as_dict(self) -> dict:
        return {
            "captured_at_start": self.at_start,
            "captured_on_demand": self.on_demand,
            "pending": len(self.waiting),
            "not_captured": self.uncaptured,
            "on_demand_seconds": self.seconds,
            "eager_forever": {str(g): r for g, r in sorted(self.failed.items())},
        }
