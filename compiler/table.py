"""The dispatch table: batch descriptors -> graphs, with every fallback explained.

Routing only: O(1) lookups over plain lists, built once. The records are ``records``, the file format
and its verification ``table_format``, the reason sentences ``explain``. Imports only the
standard library and numpy, so the runtime (torch, no YAML stack) and the compiler share it.
"""

from __future__ import annotations

import os

import numpy as np

from . import table_format
from .errors import BatchError, TableError
from .fileio import canonical_json, read_json, write_atomic
from .records import ROUTINES, BatchDescriptor, Graph, RuntimeMode, TableSettings, Why
from .table_format import COMPILER_VERSION

__all__ = [
    "DispatchTable",
    "Route",
    "RouteContext",
    "RuntimeMode",
    "BatchDescriptor",
    "Graph",
    "TableSettings",
    "Why",
    "ROUTINES",
    "COMPILER_VERSION",
]


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

    def __init__(self, mode, graph_id, padded_tokens, padded_reqs, wants_ubatch, why, context):
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


# allow= -> row offset in DispatchTable._outcomes (RuntimeMode members hash as their ints)
_ALLOW = {
    RuntimeMode.NONE: 4,
    RuntimeMode.PIECEWISE: 8,
    RuntimeMode.FULL: 12,
    "NONE": 4,
    "PIECEWISE": 8,
    "FULL": 12,
}


class DispatchTable:
    """Compiled routes: batch descriptors -> graphs, with every fallback explained."""

    def __init__(
        self,
        *,
        plan: dict,
        settings: TableSettings,
        graphs: tuple[Graph, ...],
        routes: dict[str, np.ndarray],
        diagnostics: tuple[dict, ...],
        compiler_version: str = COMPILER_VERSION,
    ):
        self.plan = plan
        """The plan as written, defaults filled (shown by report/diff; never read for rules)."""
        self.settings = settings
        """The resolved plan (typed): what routing and the runtime read."""
        self.graphs = tuple(graphs)
        self.routes = {k: np.asarray(v, dtype=np.int32) for k, v in routes.items()}
        self.diagnostics = tuple(diagnostics)
        self.compiler_version = compiler_version
        doc = self.to_json()
        self.fingerprint: str = doc["fingerprint"]
        """sha256 of plan + settings + compiler version."""
        self.content_fingerprint: str = doc["content_fingerprint"]
        """sha256 of settings + graphs + routes + compiler version: what runners and DP ranks
        compare (docs/semantics.md §7.6)."""
        self._prepare()

    # -- lookups ----------------------------------------------------------------------------
    def _prepare(self) -> None:
        r = self.settings
        self.q = r.decode_query_len
        self.max_num_seqs = r.max_num_seqs
        self.max_tokens = r.max_num_batched_tokens
        self.capture_sizes = r.capture_sizes
        sizes = np.asarray(self.capture_sizes, dtype=np.int64)
        idx = np.searchsorted(sizes, np.arange(self.max_tokens + 1), side="left")
        idx[idx >= len(sizes)] = -1
        # [max_tokens + 1] -> index of the smallest capture size >= n, or -1
        self._size_index: list[int] = idx.tolist()
        self._sizes: list[int] = sizes.tolist()
        self._case_of_count: list[int] = list(r.lora_case_of_count)
        ub = r.ubatch
        # ubatch threshold by uniform (False, True); unreachable when ubatching is off
        self._thr = (
            (ub.prefill_token_threshold, ub.decode_token_threshold)
            if ub.enabled
            else (1 << 62, 1 << 62)
        )
        self._m = {k: v.tolist() for k, v in self.routes.items()}
        self._decode_reqs = [min(s // self.q, self.max_num_seqs) for s in self._sizes]
        self._mixed_reqs = [min(s, self.max_num_seqs) for s in self._sizes]
        self._mixed_mode = r.mixed_mode
        # outcome rows, built on first use: [allow * 4 + ubatched * 2 + uniform][lora case]
        # -> [len(sizes) + 1] outcomes, the last one for "above the largest size" (index -1)
        self._outcomes: list = [None] * 16
        self._route = self.route = self._make_route()

    def __getstate__(self) -> dict:  # pickle / copy: the closure and caches are rebuilt
        return {k: v for k, v in self.__dict__.items() if k not in ("route", "_route", "_outcomes")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._outcomes = [None] * 16
        self._route = self.route = self._make_route()

    def _outcome(
        self, allow: RuntimeMode | None, ubatched: bool, uniform: bool, c: int, i: int
    ) -> tuple:
        """(mode, graph id, padded tokens, padded reqs, why) for lora case c and size index i;
        padded tokens / reqs None mean the looked-up token count / the caller's num_reqs."""
        if i < 0:
            return (
                RuntimeMode.NONE,
                -1,
                None,
                None,
                Why.NO_GRAPHS if not self._sizes or not self.graphs else Why.TOO_BIG,
            )
        m, s = self._m, self._sizes[i]
        if allow is None or allow is RuntimeMode.FULL:
            if ubatched:
                g = m["full_decode_ubatched"][c][i] if uniform else -1
                if g >= 0:
                    return (RuntimeMode.FULL, g, s, self._decode_reqs[i], Why.FULL_UBATCHED)
                return (
                    RuntimeMode.NONE,
                    -1,
                    None,
                    None,
                    Why.NO_UBATCH_GRAPH if uniform else Why.UBATCH_MIXED,
                )
            if uniform:
                g = m["full_decode"][c][i]
                if g >= 0:
                    return (RuntimeMode.FULL, g, s, self._decode_reqs[i], Why.FULL_DECODE)
            g = m["full_mixed"][c][i]
            if g >= 0:
                return (RuntimeMode.FULL, g, s, self._mixed_reqs[i], Why.FULL_MIXED)
        if allow is None or allow is RuntimeMode.PIECEWISE:
            g = m["piecewise"][c][i] if not ubatched else -1
            if g >= 0:
                return (RuntimeMode.PIECEWISE, g, s, None, Why.PIECEWISE)
        if ubatched and not (uniform and m["full_decode_ubatched"][c][i] >= 0):
            why = Why.NO_UBATCH_GRAPH if uniform else Why.UBATCH_MIXED
        elif allow is not None and allow is not RuntimeMode.NONE:
            why = Why.NOT_ALLOWED
        elif uniform and m["full_decode_ubatched"][c][i] >= 0 and m["full_decode"][c][i] < 0:
            why = Why.NO_TWIN
        elif self._mixed_mode is RuntimeMode.NONE or not self.graphs:
            why = Why.MIXED_NONE if self.graphs else Why.NO_GRAPHS
        else:
            why = Why.NOT_ALLOWED
        return (RuntimeMode.NONE, -1, None, None, why)

    def _build_outcomes(self, k: int) -> list:
        allow = (None, RuntimeMode.NONE, RuntimeMode.PIECEWISE, RuntimeMode.FULL)[k >> 2]
        ubatched, uniform = bool(k & 2), bool(k & 1)
        idx = list(range(len(self._sizes))) + [-1]
        rows = [
            [self._outcome(allow, ubatched, uniform, c, i) for i in idx]
            for c in range(len(self.settings.lora_cases))
        ]
        self._outcomes[k] = rows
        return rows

    def route(
        self,
        num_tokens: int,
        num_reqs: int | None = None,
        max_query_len: int | None = None,
        num_active_loras: int = 0,
        *,
        allow: RuntimeMode | str | None = None,
        pad_to: int | None = None,
        ubatched: bool = False,
    ) -> Route:
        """Route one batch.

        Uniform decode is ``max_query_len == q and num_tokens == q * num_reqs`` (both given).
        ``allow`` restricts the runtime mode (DP re-dispatch uses the synced mode: a RuntimeMode,
        its name or its int), ``pad_to`` looks up at an agreed token count instead of
        ``num_tokens``, ``ubatched`` asks for the ubatched graph. Raises BatchError for inputs
        outside the plan's limits.
        """
        return self._route(
            num_tokens,
            num_reqs,
            max_query_len,
            num_active_loras,
            allow=allow,
            pad_to=pad_to,
            ubatched=ubatched,
        )

    def _make_route(self):
        """``route`` as a closure over the lookup lists: locals instead of attribute loads.
        ``_prepare`` installs it on the instance, so ``table.route(...)`` calls it directly."""
        max_tokens, max_seqs, q = self.max_tokens, self.max_num_seqs, self.q
        size_index, coc, thr = self._size_index, self._case_of_count, self._thr
        outcomes, build, n_counts = self._outcomes, self._build_outcomes, len(self._case_of_count)
        table, new_route = self, object.__new__

        def route(
            num_tokens,
            num_reqs=None,
            max_query_len=None,
            num_active_loras=0,
            *,
            allow=None,
            pad_to=None,
            ubatched=False,
        ):
            n, r, mql = num_tokens, num_reqs, max_query_len
            if not 0 < n <= max_tokens:
                raise BatchError(
                    f"num_tokens={n!r} is outside 1..{max_tokens} "
                    "(scheduler.max_num_batched_tokens)"
                )
            uniform = False
            if r is not None:
                if not 0 < r <= n or r > max_seqs:
                    raise BatchError(
                        f"num_reqs={r!r} must be in 1..min(num_tokens={n}, "
                        f"scheduler.max_num_seqs={max_seqs})"
                    )
                if mql is not None:
                    if not 0 < mql <= n - r + 1 or mql * r < n:
                        raise BatchError(
                            f"max_query_len={mql!r} is impossible for {n} tokens in {r} requests"
                        )
                    uniform = mql == q and n == mql * r
            elif mql is not None and not 0 < mql <= n:
                raise BatchError(f"max_query_len={mql!r} is impossible for {n} tokens")
            if not 0 <= num_active_loras < n_counts:
                raise BatchError(
                    f"num_active_loras={num_active_loras!r} is outside 0.."
                    f"{n_counts - 1} (lora.enabled / lora.max_loras + 1)"
                )
            c = coc[num_active_loras]
            k = uniform
            if allow is not None:
                try:
                    k += _ALLOW[allow]
                except (KeyError, TypeError):
                    raise BatchError(
                        f"allow={allow!r} is not a runtime mode (NONE, PIECEWISE, FULL)"
                    ) from None
            if ubatched:
                k += 2
            target = n
            if pad_to is not None:
                if not n <= pad_to <= max_tokens:
                    raise BatchError(f"pad_to={pad_to!r} must be in num_tokens={n}..{max_tokens}")
                target = pad_to
            mode, g, pt, pr, why = (outcomes[k] or build(k))[c][size_index[target]]
            rt = new_route(Route)  # no __init__ frame: slot stores are cheaper than a call
            rt.mode, rt.graph_id, rt.why = mode, g, why
            rt.padded_tokens = target if pt is None else pt
            rt.padded_reqs = r if pr is None else pr
            rt.wants_ubatch = n >= thr[uniform]
            rt.context = (table, n, r, mql, num_active_loras, uniform, c, pad_to)
            return rt

        return route

    def lora_case(self, num_active_loras: int) -> int:
        """Captured LoRA count that a batch with this many active adapters uses."""
        return self.settings.lora_cases[self._case_of_count[num_active_loras]]

    # -- persistence (table_format owns the layout) -----------------------------------------------
    def to_json(self) -> dict:
        return table_format.encode(
            plan=self.plan,
            settings=self.settings,
            graphs=self.graphs,
            routes=self.routes,
            diagnostics=self.diagnostics,
            compiler_version=self.compiler_version,
        )

    def dumps(self) -> bytes:
        return canonical_json(self.to_json()) + b"\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a temp file in the same folder, then rename. Never a partial file."""
        write_atomic(path, self.dumps())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DispatchTable":
        """Read and verify a table.json (table_format.decode); any problem is a TableError."""
        data = read_json(
            path, TableError, "table", "compile one with `plan compile PLAN -o table.json`"
        )
        return cls.from_json(data, source=str(path))

    @classmethod
    def from_json(cls, data, source: str = "<table>") -> "DispatchTable":
        return cls(**table_format.decode(data, source))
