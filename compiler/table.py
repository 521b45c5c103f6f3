"""The dispatch table: the one seam between the compiler and the runtime.

Plain data with load/save and O(1) routing, nothing else. This module imports only the standard
library and numpy, so the runtime (torch, no YAML stack) and the compiler (no torch) share it.

Layout of ``table.json`` (``schemas/table.schema.json`` is its contract):
``format``/``format_version``, ``compiler_version``, ``fingerprint`` (sha256 of the canonical
plan + resolved plan + compiler version: what DP ranks compare), ``checksum`` (sha256 of every
other byte of content: what catches a corrupted file), ``plan`` (as written, defaults filled),
``resolved`` (modes, capture sizes, LoRA cases, ubatching), ``graphs`` in capture order,
``routes`` (graph ids, one int32 matrix ``[lora case, capture size]`` per routine) and
``diagnostics``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphplan.compiler.errors import BatchError, OutputError, TableError

FORMAT = "graphplan.table"
FORMAT_VERSION = 1
COMPILER_VERSION = "0.1.0"
ROUTINES = ("full_decode", "full_decode_ubatched", "full_mixed", "piecewise")


class RuntimeMode(enum.IntEnum):
    """What one step runs; the values are what DP ranks all-reduce (min wins)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchDescriptor:
    """The key of one captured graph."""

    num_tokens: int
    """Padded token count the graph was captured at."""
    num_reqs: int | None
    """Padded request count baked into a FULL graph; None for PIECEWISE (relaxed key)."""
    uniform: bool
    """True for uniform-decode graphs (every request has exactly q tokens)."""
    has_lora: bool
    """Whether LoRA kernels are in the graph."""
    num_active_loras: int
    """Captured LoRA count: batches with fewer active adapters round up to it."""
    num_ubatches: int = 1
    """Micro-batches the graph runs (1 = plain; 2 for DBO)."""

    def to_json(self) -> dict:
        return {"num_tokens": self.num_tokens, "num_reqs": self.num_reqs, "uniform": self.uniform,
                "has_lora": self.has_lora, "num_active_loras": self.num_active_loras,
                "num_ubatches": self.num_ubatches}


@dataclass(frozen=True, kw_only=True, slots=True)
class Graph:
    """One graph to capture: its id (= position in capture order), mode and key."""

    id: int
    mode: RuntimeMode
    key: BatchDescriptor
    routine: str
    """Which route matrix refers to it (one of ROUTINES)."""

    def to_json(self) -> dict:
        return {"id": self.id, "mode": self.mode.name, "routine": self.routine, **self.key.to_json()}


# Why a route ended where it did; Route.reasons renders these into sentences.
(WHY_FULL_DECODE, WHY_FULL_MIXED, WHY_FULL_UBATCHED, WHY_PIECEWISE, WHY_NO_GRAPHS, WHY_TOO_BIG,
 WHY_MIXED_NONE, WHY_NOT_ALLOWED, WHY_NO_TWIN, WHY_UBATCH_MIXED, WHY_NO_UBATCH_GRAPH) = range(11)


class Route:
    """Where one batch goes. ``reasons`` is computed on demand, so routing allocates one object."""

    __slots__ = ("mode", "graph_id", "padded_tokens", "padded_reqs", "wants_ubatch", "why", "_ctx")

    def __init__(self, mode, graph_id, padded_tokens, padded_reqs, wants_ubatch, why, ctx):
        self.mode: str = mode
        """'NONE' | 'PIECEWISE' | 'FULL'."""
        self.graph_id: int = graph_id
        """Index into ``table.graphs`` (capture order), -1 when eager."""
        self.padded_tokens: int = padded_tokens
        self.padded_reqs: int | None = padded_reqs
        self.wants_ubatch: bool = wants_ubatch
        self.why: int = why
        self._ctx = ctx  # (table, num_tokens, num_reqs, max_query_len, loras, uniform, case, pad_to)

    @property
    def graph(self) -> BatchDescriptor | None:
        return self._ctx[0].graphs[self.graph_id].key if self.graph_id >= 0 else None

    @property
    def reasons(self) -> tuple[str, ...]:
        from graphplan.compiler.explain_route import route_reasons  # plain Python, no dependencies
        return route_reasons(self)

    def to_json(self) -> dict:
        g = self.graph
        return {"mode": self.mode, "graph_id": self.graph_id, "graph": g.to_json() if g else None,
                "padded_tokens": self.padded_tokens, "padded_reqs": self.padded_reqs,
                "wants_ubatch": self.wants_ubatch, "reasons": list(self.reasons)}

    def __repr__(self) -> str:
        return (f"Route(mode={self.mode!r}, graph_id={self.graph_id}, padded_tokens="
                f"{self.padded_tokens}, padded_reqs={self.padded_reqs}, "
                f"wants_ubatch={self.wants_ubatch})")


# allow= -> row offset in DispatchTable._outcomes (RuntimeMode members hash as their ints)
_ALLOW = {RuntimeMode.NONE: 4, RuntimeMode.PIECEWISE: 8, RuntimeMode.FULL: 12,
          "NONE": 4, "PIECEWISE": 8, "FULL": 12}


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _sha256(obj) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(obj)).hexdigest()


def compute_fingerprint(plan: dict, resolved: dict, compiler_version: str = COMPILER_VERSION) -> str:
    return _sha256({"compiler_version": compiler_version, "plan": plan, "resolved": resolved})


class DispatchTable:
    """Compiled routes: batch descriptors -> graphs, with every fallback explained."""

    def __init__(self, *, plan: dict, resolved: dict, graphs: tuple[Graph, ...],
                 routes: dict[str, np.ndarray], diagnostics: tuple[dict, ...],
                 compiler_version: str = COMPILER_VERSION, fingerprint: str | None = None):
        self.plan = plan
        self.resolved = resolved
        self.graphs = tuple(graphs)
        self.routes = {k: np.asarray(v, dtype=np.int32) for k, v in routes.items()}
        self.diagnostics = tuple(diagnostics)
        self.compiler_version = compiler_version
        self.fingerprint = fingerprint or compute_fingerprint(plan, resolved, compiler_version)
        self._prepare()

    # -- lookups ----------------------------------------------------------------------------
    def _prepare(self) -> None:
        r = self.resolved
        self.q = r["decode_query_len"]
        self.max_num_seqs = r["max_num_seqs"]
        self.max_tokens = r["max_num_batched_tokens"]
        self.capture_sizes = tuple(r["capture_sizes"])
        sizes = np.asarray(self.capture_sizes, dtype=np.int64)
        idx = np.searchsorted(sizes, np.arange(self.max_tokens + 1), side="left")
        idx[idx >= len(sizes)] = -1
        # [max_tokens + 1] -> index of the smallest capture size >= n, or -1
        self._size_index: list[int] = idx.tolist()
        self._sizes: list[int] = sizes.tolist()
        self._case_of_count: list[int] = list(r["lora_case_of_count"])
        ub = r["ubatch"]
        # ubatch threshold by uniform (False, True); unreachable when ubatching is off
        self._thr = (ub["prefill_token_threshold"], ub["decode_token_threshold"]) \
            if ub["enabled"] else (1 << 62, 1 << 62)
        self._m = {k: v.tolist() for k, v in self.routes.items()}
        self._decode_reqs = [min(s // self.q, self.max_num_seqs) for s in self._sizes]
        self._mixed_reqs = [min(s, self.max_num_seqs) for s in self._sizes]
        self._mixed_mode = RuntimeMode[r["mixed_mode"]]
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

    def _outcome(self, allow: RuntimeMode | None, ubatched: bool, uniform: bool, c: int,
                 i: int) -> tuple:
        """(mode, graph id, padded tokens, padded reqs, why) for lora case c and size index i;
        padded tokens / reqs None mean the looked-up token count / the caller's num_reqs."""
        if i < 0:
            return ("NONE", -1, None, None,
                    WHY_NO_GRAPHS if not self._sizes or not self.graphs else WHY_TOO_BIG)
        m, s = self._m, self._sizes[i]
        if allow is None or allow is RuntimeMode.FULL:
            if ubatched:
                g = m["full_decode_ubatched"][c][i] if uniform else -1
                if g >= 0:
                    return ("FULL", g, s, self._decode_reqs[i], WHY_FULL_UBATCHED)
                return ("NONE", -1, None, None, WHY_NO_UBATCH_GRAPH if uniform else WHY_UBATCH_MIXED)
            if uniform:
                g = m["full_decode"][c][i]
                if g >= 0:
                    return ("FULL", g, s, self._decode_reqs[i], WHY_FULL_DECODE)
            g = m["full_mixed"][c][i]
            if g >= 0:
                return ("FULL", g, s, self._mixed_reqs[i], WHY_FULL_MIXED)
        if allow is None or allow is RuntimeMode.PIECEWISE:
            g = m["piecewise"][c][i] if not ubatched else -1
            if g >= 0:
                return ("PIECEWISE", g, s, None, WHY_PIECEWISE)
        if ubatched and not (uniform and m["full_decode_ubatched"][c][i] >= 0):
            why = WHY_NO_UBATCH_GRAPH if uniform else WHY_UBATCH_MIXED
        elif allow is not None and allow is not RuntimeMode.NONE:
            why = WHY_NOT_ALLOWED
        elif uniform and m["full_decode_ubatched"][c][i] >= 0 and m["full_decode"][c][i] < 0:
            why = WHY_NO_TWIN
        elif self._mixed_mode is RuntimeMode.NONE or not self.graphs:
            why = WHY_MIXED_NONE if self.graphs else WHY_NO_GRAPHS
        else:
            why = WHY_NOT_ALLOWED
        return ("NONE", -1, None, None, why)

    def _build_outcomes(self, k: int) -> list:
        allow = (None, RuntimeMode.NONE, RuntimeMode.PIECEWISE, RuntimeMode.FULL)[k >> 2]
        ubatched, uniform = bool(k & 2), bool(k & 1)
        idx = list(range(len(self._sizes))) + [-1]
        rows = [[self._outcome(allow, ubatched, uniform, c, i) for i in idx]
                for c in range(len(self.resolved["lora_cases"]))]
        self._outcomes[k] = rows
        return rows

    def route(self, num_tokens: int, num_reqs: int | None = None, max_query_len: int | None = None,
              num_active_loras: int = 0, *, allow: RuntimeMode | str | None = None,
              pad_to: int | None = None, ubatched: bool = False) -> Route:
        """Route one batch.

        Uniform decode is ``max_query_len == q and num_tokens == q * num_reqs`` (both given).
        ``allow`` restricts the runtime mode (DP re-dispatch uses the synced mode: a RuntimeMode,
        its name or its int), ``pad_to`` looks up at an agreed token count instead of
        ``num_tokens``, ``ubatched`` asks for the ubatched graph. Raises BatchError for inputs
        outside the plan's limits.
        """
        return self._route(num_tokens, num_reqs, max_query_len, num_active_loras, allow=allow,
                           pad_to=pad_to, ubatched=ubatched)

    def _make_route(self):
        """``route`` as a closure over the lookup lists: locals instead of attribute loads.
        ``_prepare`` installs it on the instance, so ``table.route(...)`` calls it directly."""
        max_tokens, max_seqs, q = self.max_tokens, self.max_num_seqs, self.q
        size_index, coc, thr = self._size_index, self._case_of_count, self._thr
        outcomes, build, n_counts = self._outcomes, self._build_outcomes, len(self._case_of_count)
        table, new_route = self, object.__new__

        def route(num_tokens, num_reqs=None, max_query_len=None, num_active_loras=0, *,
                  allow=None, pad_to=None, ubatched=False):
            n, r, mql = num_tokens, num_reqs, max_query_len
            if not 0 < n <= max_tokens:
                raise BatchError(f"num_tokens={n!r} is outside 1..{max_tokens} "
                                 "(scheduler.max_num_batched_tokens)")
            uniform = False
            if r is not None:
                if not 0 < r <= n or r > max_seqs:
                    raise BatchError(f"num_reqs={r!r} must be in 1..min(num_tokens={n}, "
                                     f"scheduler.max_num_seqs={max_seqs})")
                if mql is not None:
                    if not 0 < mql <= n - r + 1 or mql * r < n:
                        raise BatchError(f"max_query_len={mql!r} is impossible for {n} tokens in "
                                         f"{r} requests")
                    uniform = mql == q and n == mql * r
            elif mql is not None and not 0 < mql <= n:
                raise BatchError(f"max_query_len={mql!r} is impossible for {n} tokens")
            if not 0 <= num_active_loras < n_counts:
                raise BatchError(f"num_active_loras={num_active_loras!r} is outside 0.."
                                 f"{n_counts - 1} (lora.enabled / lora.max_loras + 1)")
            c = coc[num_active_loras]
            k = uniform
            if allow is not None:
                try:
                    k += _ALLOW[allow]
                except (KeyError, TypeError):
                    raise BatchError(f"allow={allow!r} is not a runtime mode (NONE, PIECEWISE, "
                                     "FULL)") from None
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
            rt._ctx = (table, n, r, mql, num_active_loras, uniform, c, pad_to)
            return rt

        return route

    def lora_case(self, num_active_loras: int) -> int:
        """Captured LoRA count that a batch with this many active adapters uses."""
        return self.resolved["lora_cases"][self._case_of_count[num_active_loras]]

    # -- persistence ------------------------------------------------------------------------
    def to_json(self) -> dict:
        body = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "compiler_version": self.compiler_version,
            "fingerprint": self.fingerprint,
            "plan": self.plan,
            "resolved": self.resolved,
            "graphs": [g.to_json() for g in self.graphs],
            "routes": {k: v.tolist() for k, v in sorted(self.routes.items())},
            "diagnostics": list(self.diagnostics),
        }
        body["checksum"] = _sha256(body)
        return body

    def dumps(self) -> bytes:
        return canonical_json(self.to_json()) + b"\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a temp file in the same folder, then rename. Never a partial file."""
        write_atomic(path, self.dumps())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DispatchTable":
        data = read_json(path, TableError, "table", "compile one with `plan compile PLAN -o "
                         "table.json`")
        return cls.from_json(data, source=str(path))

    @classmethod
    def from_json(cls, data, source: str = "<table>") -> "DispatchTable":
        from graphplan.compiler.table_check import check_table_json  # structure checks, no dependencies
        check_table_json(data, source)
        body = {k: v for k, v in data.items() if k != "checksum"}
        if _sha256(body) != data["checksum"]:
            raise TableError(f"{source}: corrupted table: checksum mismatch (the file was edited or "
                             "truncated); recompile it with `plan compile`")
        fp = compute_fingerprint(data["plan"], data["resolved"], data["compiler_version"])
        if fp != data["fingerprint"]:
            raise TableError(f"{source}: corrupted table: fingerprint mismatch; recompile it with "
                             "`plan compile`")
        graphs = tuple(
            Graph(id=g["id"], mode=RuntimeMode[g["mode"]], routine=g["routine"],
                  key=BatchDescriptor(**{k: g[k] for k in BatchDescriptor.__slots__}))
            for g in data["graphs"])
        return cls(plan=data["plan"], resolved=data["resolved"], graphs=graphs,
                   routes=data["routes"], diagnostics=tuple(data["diagnostics"]),
                   compiler_version=data["compiler_version"], fingerprint=data["fingerprint"])


def read_json(path: str | os.PathLike, error: type[Exception], what: str, hint: str):
    """Parse a JSON file; every failure is ``error`` naming the file, the problem and ``hint``."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except IsADirectoryError:
        raise error(f"{p}: is a directory, not a {what} (give the .json file)") from None
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror or e}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{p}: not a graphplan {what}: not JSON ({e}); {hint}") from None


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{p}: is a directory; give a file name such as {p / 'table.json'}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    except OSError as e:
        raise OutputError(f"{p}: cannot write here ({e.strerror or e}); choose a writable "
                          "directory with -o") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a written file gets the usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise OutputError(f"{p}: cannot write ({e.strerror or e})") from None
        raise
