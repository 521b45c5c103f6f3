"""The dispatch table: batch descriptors -> graphs, with every fallback explained.

Routing only: O(1) lookups over plain lists, built once. The records are ``records``, the answer
``route``, the file format and its verification ``table_format``, the reason sentences
``explain``. Imports only the standard library and numpy, so the runtime (torch, no YAML stack)
and the compiler share it.
"""

from __future__ import annotations

import os

import numpy as np

from . import table_format
from .errors import BatchError, TableError
from .fileio import canonical_json, read_json, write_atomic
from .records import (
    ROUTINES,
    BatchDescriptor,
    Graph,
    RuntimeMode,
    TableSettings,
    Why,
    padded_num_reqs,
)
from .route import Route, RouteContext
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


# allow= -> the first of its four outcome rows (DispatchTable._build_row numbers them). The keys
# are the modes and their names; an int finds its mode too, as RuntimeMode members hash as ints.
_ALLOW_ROW = {
    RuntimeMode.NONE: 4,
    RuntimeMode.PIECEWISE: 8,
    RuntimeMode.FULL: 12,
    "NONE": 4,
    "PIECEWISE": 8,
    "FULL": 12,
}
_ALLOW_OF_ROW = (None, RuntimeMode.NONE, RuntimeMode.PIECEWISE, RuntimeMode.FULL)  # row // 4 ->
_NEVER = 1 << 62  # a token count no batch reaches


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
        """The lookup lists routing reads (plain lists: indexing one is cheaper than numpy's)."""
        s = self.settings
        self.q = s.decode_query_len
        self.max_num_seqs = s.max_num_seqs
        self.max_tokens = s.max_num_batched_tokens
        self.capture_sizes = s.capture_sizes
        self._sizes: list[int] = list(s.capture_sizes)
        # [max_tokens + 1] -> index of the smallest capture size >= n, or -1 above the largest
        sizes = np.asarray(self._sizes, dtype=np.int64)
        index = np.searchsorted(sizes, np.arange(self.max_tokens + 1), side="left")
        index[index >= len(sizes)] = -1
        self._size_index: list[int] = index.tolist()
        self._case_of_count: list[int] = list(s.lora_case_of_count)
        self._route_ids = {k: v.tolist() for k, v in self.routes.items()}  # [case][size] -> id
        # [size index] -> the request count of a FULL decode / FULL mixed graph at that size
        self._decode_reqs = [padded_num_reqs(n, self.max_num_seqs, self.q) for n in self._sizes]
        self._mixed_reqs = [padded_num_reqs(n, self.max_num_seqs) for n in self._sizes]
        ub = s.ubatch
        # [uniform] -> tokens from which a batch wants to micro-batch (never, with ubatching off)
        self._ubatch_from = (
            (ub.prefill_token_threshold, ub.decode_token_threshold)
            if ub.enabled
            else (_NEVER, _NEVER)
        )
        # [row][lora case][size index] -> outcome: every answer routing can give, each row built
        # on its first use (_build_row); the size index -1 is "above the largest size"
        self._outcomes: list = [None] * 16
        self.__dict__["route"] = self._make_route()  # the closure shadows the method ``route``

    def __getstate__(self) -> dict:  # pickle / copy: the closure and the rows are rebuilt
        return {k: v for k, v in self.__dict__.items() if k not in ("route", "_outcomes")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._outcomes = [None] * 16
        self.__dict__["route"] = self._make_route()

    def _build_row(self, row: int) -> list:
        """The outcomes of row ``row`` = allow * 4 + ubatched * 2 + uniform (allow: 0 for None,
        1-3 for NONE, PIECEWISE, FULL), for every LoRA case and size index (-1 last)."""
        allow, ubatched, uniform = _ALLOW_OF_ROW[row // 4], bool(row & 2), bool(row & 1)
        cases, indexes = range(len(self.settings.lora_cases)), [*range(len(self._sizes)), -1]
        built = [[self._outcome(allow, ubatched, uniform, c, i) for i in indexes] for c in cases]
        self._outcomes[row] = built
        return built

    def _outcome(
        self, allow: RuntimeMode | None, ubatched: bool, uniform: bool, c: int, i: int
    ) -> tuple:
        """(mode, graph id, padded tokens, padded reqs, why) for LoRA case ``c`` at size index
        ``i``; padded tokens / reqs None mean the looked-up token count / the batch's num_reqs.

        The order of preference: a ubatched FULL graph when micro-batching (uniform decode only),
        else a FULL decode graph (uniform), a FULL mixed graph, a PIECEWISE graph; else eager,
        with the reason (docs/semantics.md §5)."""
        if i < 0:
            why = Why.NO_GRAPHS if not self._sizes or not self.graphs else Why.TOO_BIG
            return (RuntimeMode.NONE, -1, None, None, why)
        ids, tokens = self._route_ids, self._sizes[i]
        ubatched_id = ids["full_decode_ubatched"][c][i] if uniform else -1
        if allow is None or allow is RuntimeMode.FULL:
            if ubatched:
                if ubatched_id >= 0:
                    reqs = self._decode_reqs[i]
                    return (RuntimeMode.FULL, ubatched_id, tokens, reqs, Why.FULL_UBATCHED)
                why = Why.NO_UBATCH_GRAPH if uniform else Why.UBATCH_MIXED
                return (RuntimeMode.NONE, -1, None, None, why)
            g = ids["full_decode"][c][i] if uniform else -1
            if g >= 0:
                return (RuntimeMode.FULL, g, tokens, self._decode_reqs[i], Why.FULL_DECODE)
            g = ids["full_mixed"][c][i]
            if g >= 0:
                return (RuntimeMode.FULL, g, tokens, self._mixed_reqs[i], Why.FULL_MIXED)
        if (allow is None or allow is RuntimeMode.PIECEWISE) and not ubatched:
            g = ids["piecewise"][c][i]
            if g >= 0:
                return (RuntimeMode.PIECEWISE, g, tokens, None, Why.PIECEWISE)
        if ubatched and ubatched_id < 0:
            why = Why.NO_UBATCH_GRAPH if uniform else Why.UBATCH_MIXED
        elif allow is not None and allow is not RuntimeMode.NONE:
            why = Why.NOT_ALLOWED
        elif ubatched_id >= 0 and ids["full_decode"][c][i] < 0:
            why = Why.NO_TWIN
        elif not self.graphs:
            why = Why.NO_GRAPHS
        elif self.settings.mixed_mode is RuntimeMode.NONE:
            why = Why.MIXED_NONE
        else:
            why = Why.NOT_ALLOWED
        return (RuntimeMode.NONE, -1, None, None, why)

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

        Uniform decode is ``max_query_len == q and num_tokens == q * num_reqs`` (both given;
        records.is_uniform_decode). ``allow`` restricts the runtime mode (DP re-dispatch uses the
        synced mode: a RuntimeMode, its name or its int), ``pad_to`` looks up at an agreed token
        count instead of ``num_tokens``, ``ubatched`` asks for the ubatched graph. Raises
        BatchError for inputs outside the plan's limits.

        ``table.route(...)`` calls the closure ``_make_route`` builds, which ``_prepare`` stores
        as the instance attribute ``route``; this method documents it (and serves a call through
        the class, ``DispatchTable.route(table, ...)``).
        """
        return self.__dict__["route"](
            num_tokens,
            num_reqs,
            max_query_len,
            num_active_loras,
            allow=allow,
            pad_to=pad_to,
            ubatched=ubatched,
        )

    def _make_route(self):
        """``route``, the hot path (a step routes once, a DP step twice), as a closure.

        What keeps it fast, so that it costs a few plain calls (bench/compile_bench.py
        --route-only): every answer is precomputed (``_outcomes``), so a route is a few checks
        and one lookup; the tables and limits it reads are the closure's variables (a closure
        read is cheaper than an attribute read on ``self``); it is the instance attribute
        ``route`` (no bound method is made per call); and the Route is made without a call to
        ``__init__``."""
        max_tokens, max_seqs, q = self.max_tokens, self.max_num_seqs, self.q
        size_index, case_of_count = self._size_index, self._case_of_count
        num_counts = len(case_of_count)
        ubatch_from, outcomes, build_row = self._ubatch_from, self._outcomes, self._build_row
        allow_row, table, new_route = _ALLOW_ROW, self, object.__new__

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
            # 1. a batch the plan cannot have is an error naming the limit
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
                    # the longest request has at least n / r tokens and at most what the other
                    # r - 1 requests (one token each, at least) leave
                    if not 0 < mql <= n - r + 1 or mql * r < n:
                        raise BatchError(
                            f"max_query_len={mql!r} is impossible for {n} tokens in {r} requests"
                        )
                    # records.is_uniform_decode, written out: a call would cost ~9% of a route;
                    # test_properties checks that the two agree
                    uniform = mql == q and n == q * r
            elif mql is not None and not 0 < mql <= n:
                raise BatchError(f"max_query_len={mql!r} is impossible for {n} tokens")
            if not 0 <= num_active_loras < num_counts:
                raise BatchError(
                    f"num_active_loras={num_active_loras!r} is outside 0..{num_counts - 1} "
                    "(lora.enabled / lora.max_loras + 1)"
                )
            # 2. the outcome row of the question: allow * 4 + ubatched * 2 + uniform (a bool
            # adds as 0 or 1)
            row = uniform
            if allow is not None:
                try:
                    row += allow_row[allow]
                except (KeyError, TypeError):  # TypeError: unhashable
                    raise BatchError(
                        f"allow={allow!r} is not a runtime mode (NONE, PIECEWISE, FULL)"
                    ) from None
            if ubatched:
                row += 2
            # 3. the token count looked up: the batch's own, or the one the DP ranks agreed on
            target = n
            if pad_to is not None:
                if not n <= pad_to <= max_tokens:
                    raise BatchError(f"pad_to={pad_to!r} must be in num_tokens={n}..{max_tokens}")
                target = pad_to
            # 4. one lookup: [row][LoRA case][size index]
            case = case_of_count[num_active_loras]
            by_case = outcomes[row] or build_row(row)
            mode, graph_id, padded_tokens, padded_reqs, why = by_case[case][size_index[target]]
            # 5. the answer; object.__new__ and slot stores skip the __init__ call
            rt = new_route(Route)
            rt.mode, rt.graph_id, rt.why = mode, graph_id, why
            rt.padded_tokens = target if padded_tokens is None else padded_tokens
            rt.padded_reqs = r if padded_reqs is None else padded_reqs
            rt.wants_ubatch = n >= ubatch_from[uniform]
            rt.context = (table, n, r, mql, num_active_loras, uniform, case, pad_to)
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
