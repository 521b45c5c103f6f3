"""What routing answers: a ``Route`` (where one batch goes) and its ``RouteContext`` (what was
asked). ``DispatchTable.route`` (table.py) makes them; ``explain`` turns them into sentences."""

from __future__ import annotations

from . import table_format
from .records import BatchDescriptor, RuntimeMode, Why

__all__ = ["Route", "RouteContext"]


class RouteContext(tuple):
    """What a route was asked: (table, num_tokens, num_reqs, max_query_len, num_active_loras,
    uniform, lora case index, pad_to). Kept as a plain tuple: routing builds one per call."""

    __slots__ = ()
    table = property(lambda self: self[0])
    num_tokens = property(lambda self: self[1])
    num_reqs = property(lambda self: self[2])
    max_query_len = property(lambda self: self[3])
    num_active_loras = property(lambda self: self[4])
    uniform = property(lambda self: self[5])
    lora_case = property(lambda self: self[6])
    pad_to = property(lambda self: self[7])


class Route:
    """Where one batch goes. ``reasons`` is computed on demand, so routing allocates one object."""

    __slots__ = (
        "mode",
        "graph_id",
        "padded_tokens",
        "padded_reqs",
        "wants_ubatch",
        "why",
        "context",
    )

    def __init__(
        self,
        mode: RuntimeMode,
        graph_id: int,
        padded_tokens: int,
        padded_reqs: int | None,
        wants_ubatch: bool,
        why: Why,
        context: tuple,
    ) -> None:
        self.mode: RuntimeMode = mode
        self.graph_id: int = graph_id
        """Index into ``table.graphs`` (capture order), -1 when eager."""
        self.padded_tokens: int = padded_tokens
        self.padded_reqs: int | None = padded_reqs
        self.wants_ubatch: bool = wants_ubatch
        self.why: Why = why
        self.context: tuple = context
        """The question asked (a RouteContext's fields, as a plain tuple)."""

    @property
    def graph(self) -> BatchDescriptor | None:
        return self.context[0].graphs[self.graph_id].key if self.graph_id >= 0 else None

    @property
    def reasons(self) -> tuple[str, ...]:
        from .explain import route_reasons  # only when asked: explain, logs

        return route_reasons(self, RouteContext(self.context))

    def to_json(self) -> dict:
        g = self.graph
        return {
            "mode": self.mode.name,
            "graph_id": self.graph_id,
            "graph": table_format.key_json(g) if g else None,
            "padded_tokens": self.padded_tokens,
            "padded_reqs": self.padded_reqs,
            "wants_ubatch": self.wants_ubatch,
            "reasons": list(self.reasons),
        }

    def __repr__(self) -> str:
        return (
            f"Route(mode={self.mode.name!r}, graph_id={self.graph_id}, padded_tokens="
            f"{self.padded_tokens}, padded_reqs={self.padded_reqs}, "
            f"wants_ubatch={self.wants_ubatch})"
        )
