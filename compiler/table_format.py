"""``table.json``: the one place records become JSON and JSON becomes records, verified on load.

Layout (``schemas/table.schema.json`` documents it): ``format``/``format_version``,
``compiler_version``, ``fingerprint`` (sha256 of plan + settings + compiler version),
``content_fingerprint`` (sha256 of settings + graphs + routes + compiler version: what the runtime's
``expected_fingerprint`` and the DP start-up check compare), ``checksum`` (sha256 of every other
byte: catches a corrupted file), ``plan`` (as written, defaults filled), ``settings`` (the resolved
plan), ``graphs`` in capture order, ``routes`` (graph ids, one ``[lora case, capture size]`` matrix
per routine) and ``diagnostics``.

Loading verifies the table against itself before anything uses it: shape and types, every number
finite and within the plan's limits, the checksum and both fingerprints, and then the embedded plan
is resolved again with this graphplan's rules and its settings, graphs and routes must equal the
file's. A table whose routes were edited, even with its checksums recomputed, is refused. Every
failure is a TableError naming the field and saying to recompile.
"""

from __future__ import annotations

import hashlib
import math
import re

import numpy as np

from .errors import MAX_LINE, GraphplanError, TableError
from .fileio import canonical_json
from .records import (
    ROUTINES,
    AttentionSupport,
    BatchDescriptor,
    CudagraphMode,
    Graph,
    RuntimeMode,
    TableSettings,
    UbatchSettings,
)
from .resolve import resolve_plan_dict
from .schema import load_schema
from .schema_lite import first_error

FORMAT = "graphplan.table"
FORMAT_VERSION = 2
COMPILER_VERSION = "0.2.0"
MAX_TOKENS = 1 << 20
"""Largest token count a plan may name (plan.schema.json's maximum); bounds every table array."""

_RECOMPILE = "recompile it with `plan compile PLAN -o table.json`"


def _sha256(obj) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(obj)).hexdigest()


# -- records -> JSON ---------------------------------------------------------------------------
def settings_json(s: TableSettings) -> dict:
    return {
        "name": s.name,
        "mode": s.mode.name,
        "requested_mode": s.requested_mode.name,
        "attention_support": s.attention_support.name,
        "splitting_ops": list(s.splitting_ops),
        "decode_query_len": s.decode_query_len,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "capture_sizes": list(s.capture_sizes),
        "lora_enabled": s.lora_enabled,
        "lora_cases": list(s.lora_cases),
        "lora_case_of_count": list(s.lora_case_of_count),
        "ubatch": {
            "enabled": s.ubatch.enabled,
            "num_ubatches": s.ubatch.num_ubatches,
            "decode_token_threshold": s.ubatch.decode_token_threshold,
            "prefill_token_threshold": s.ubatch.prefill_token_threshold,
            "plain_twins": s.ubatch.plain_twins,
        },
        "data_parallel_size": s.data_parallel_size,
        "dp_backend": s.dp_backend,
        "sync_timeout_s": s.sync_timeout_s,
        "on_demand": s.on_demand,
        "start_sizes": list(s.start_sizes),
    }


def key_json(k: BatchDescriptor) -> dict:
    return {
        "num_tokens": k.num_tokens,
        "num_reqs": k.num_reqs,
        "uniform": k.uniform,
        "has_lora": k.has_lora,
        "num_active_loras": k.num_active_loras,
        "num_ubatches": k.num_ubatches,
    }


def graph_json(g: Graph) -> dict:
    return {"id": g.id, "mode": g.mode.name, "routine": g.routine, **key_json(g.key)}


def routes_json(routes: dict[str, np.ndarray]) -> dict:
    return {k: np.asarray(v).tolist() for k, v in sorted(routes.items())}


def plan_fingerprint(plan: dict, settings: dict, compiler_version: str) -> str:
    return _sha256({"compiler_version": compiler_version, "plan": plan, "settings": settings})


def content_fingerprint(settings: dict, graphs: list, routes: dict, compiler_version: str) -> str:
    return _sha256(
        {
            "compiler_version": compiler_version,
            "settings": settings,
            "graphs": graphs,
            "routes": routes,
        }
    )


def encode(
    *, plan: dict, settings: TableSettings, graphs, routes, diagnostics, compiler_version: str
) -> dict:
    """The JSON document of a table, fingerprints and checksum included."""
    s, g, r = settings_json(settings), [graph_json(x) for x in graphs], routes_json(routes)
    body = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "compiler_version": compiler_version,
        "fingerprint": plan_fingerprint(plan, s, compiler_version),
        "content_fingerprint": content_fingerprint(s, g, r, compiler_version),
        "plan": plan,
        "settings": s,
        "graphs": g,
        "routes": r,
        "diagnostics": list(diagnostics),
    }
    body["checksum"] = _sha256(body)
    return body


# -- JSON -> records, checked -------------------------------------------------------------------
_TOP = {
    "format": str,
    "format_version": int,
    "compiler_version": str,
    "fingerprint": str,
    "content_fingerprint": str,
    "checksum": str,
    "plan": dict,
    "settings": dict,
    "graphs": list,
    "routes": dict,
    "diagnostics": list,
}
_SETTINGS = {
    "name": str,
    "mode": str,
    "requested_mode": str,
    "attention_support": str,
    "splitting_ops": list,
    "decode_query_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "capture_sizes": list,
    "lora_enabled": bool,
    "lora_cases": list,
    "lora_case_of_count": list,
    "ubatch": dict,
    "data_parallel_size": int,
    "dp_backend": str,
    "sync_timeout_s": (int, float),
    "on_demand": bool,
    "start_sizes": list,
}
_UBATCH = {
    "enabled": bool,
    "num_ubatches": int,
    "decode_token_threshold": int,
    "prefill_token_threshold": int,
    "plain_twins": bool,
}
_GRAPH = {
    "id": int,
    "mode": str,
    "routine": str,
    "num_tokens": int,
    "num_reqs": (int, type(None)),
    "uniform": bool,
    "has_lora": bool,
    "num_active_loras": int,
    "num_ubatches": int,
}
# settings ints and their inclusive bounds (the plan schema's)
_BOUNDS = {
    "decode_query_len": 64,
    "max_num_seqs": 65536,
    "max_num_batched_tokens": MAX_TOKENS,
    "data_parallel_size": 1024,
}


def _fields(obj: dict, spec: dict, where: str, source: str) -> None:
    """Exactly the keys of ``spec``, each of its type (bool is not an int here)."""
    extra = sorted(map(str, set(obj) - set(spec)))
    if extra:
        raise TableError(
            f"{source}: {where}: unknown key '{extra[0]}' (a table from another "
            f"graphplan?); {_RECOMPILE}"
        )
    for key, typ in spec.items():
        if key not in obj:
            raise TableError(f"{source}: {where}: missing '{key}'; {_RECOMPILE}")
        val = obj[key]
        if not isinstance(val, typ) or (isinstance(val, bool) and typ is not bool):
            want = " or ".join(t.__name__ for t in typ) if isinstance(typ, tuple) else typ.__name__
            raise TableError(
                f"{source}: {where}.{key}: expected {want}, got {type(val).__name__}; {_RECOMPILE}"
            )


def _int_list(val, where: str, source: str, lo: int, hi: int, ascending: bool = False) -> tuple:
    if not all(type(v) is int and lo <= v <= hi for v in val):
        raise TableError(f"{source}: {where}: expected integers in {lo}..{hi}; {_RECOMPILE}")
    if ascending and any(a >= b for a, b in zip(val, val[1:])):
        raise TableError(f"{source}: {where}: expected sorted distinct values; {_RECOMPILE}")
    return tuple(val)


def _enum(enum_cls, name: str, where: str, source: str):
    try:
        return enum_cls[name]
    except KeyError:
        raise TableError(
            f"{source}: {where}: {name!r} is not one of "
            f"{', '.join(enum_cls.__members__)}; {_RECOMPILE}"
        ) from None


_DIAGNOSTIC = {"code": str, "severity": str, "path": str, "message": str, "hint": str}
_CODE = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
MAX_DIAGNOSTICS = 100_000
"""More diagnostics than this is not a compiler's output (a warning per size at most, or so)."""


def _check_diagnostics(diags: list, source: str) -> None:
    """What ``plan report`` and ``plan validate`` print: objects of the five string fields of
    table.schema.json, a kebab-case code, severity warning or error, each text plan-sized."""
    if len(diags) > MAX_DIAGNOSTICS:
        raise TableError(
            f"{source}: diagnostics: {len(diags)} entries, more than a compile gives; {_RECOMPILE}"
        )
    for i, d in enumerate(diags):
        where = f"diagnostics[{i}]"
        if not isinstance(d, dict):
            raise TableError(
                f"{source}: {where}: expected an object, got {type(d).__name__}; {_RECOMPILE}"
            )
        _fields(d, _DIAGNOSTIC, where, source)
        if not _CODE.fullmatch(d["code"]):
            raise TableError(
                f"{source}: {where}.code: {d['code']!r} is not a kebab-case code; {_RECOMPILE}"
            )
        if d["severity"] not in ("warning", "error"):
            raise TableError(
                f"{source}: {where}.severity: {d['severity']!r} is not warning or error; "
                f"{_RECOMPILE}"
            )
        long = next((k for k in _DIAGNOSTIC if len(d[k]) > MAX_LINE), None)
        if long:
            raise TableError(
                f"{source}: {where}.{long}: {len(d[long])} characters, more than a "
                f"diagnostic has ({MAX_LINE}); {_RECOMPILE}"
            )


def settings_from_json(d: dict, source: str, where: str = "settings") -> TableSettings:
    _fields(d, _SETTINGS, where, source)
    _fields(d["ubatch"], _UBATCH, f"{where}.ubatch", source)
    for key, hi in _BOUNDS.items():
        if not 1 <= d[key] <= hi:
            raise TableError(f"{source}: {where}.{key}: {d[key]} is outside 1..{hi}; {_RECOMPILE}")
    t = d["sync_timeout_s"]
    if not (math.isfinite(t) and 0 < t <= 86400):
        raise TableError(
            f"{source}: {where}.sync_timeout_s: {t!r} is not a number of seconds in "
            f"(0, 86400]; {_RECOMPILE}"
        )
    ub = d["ubatch"]
    for key in ("num_ubatches", "decode_token_threshold", "prefill_token_threshold"):
        if not 1 <= ub[key] <= MAX_TOKENS:
            raise TableError(
                f"{source}: {where}.ubatch.{key}: {ub[key]} is out of range; {_RECOMPILE}"
            )
    if not all(isinstance(op, str) for op in d["splitting_ops"]):
        raise TableError(f"{source}: {where}.splitting_ops: expected strings; {_RECOMPILE}")
    sizes = _int_list(
        d["capture_sizes"],
        f"{where}.capture_sizes",
        source,
        1,
        d["max_num_batched_tokens"],
        ascending=True,
    )
    start = _int_list(
        d["start_sizes"],
        f"{where}.start_sizes",
        source,
        1,
        d["max_num_batched_tokens"],
        ascending=True,
    )
    cases = _int_list(d["lora_cases"], f"{where}.lora_cases", source, 0, 1025, ascending=True)
    if not cases:
        raise TableError(f"{source}: {where}.lora_cases: empty; {_RECOMPILE}")
    of_count = _int_list(
        d["lora_case_of_count"], f"{where}.lora_case_of_count", source, 0, len(cases) - 1
    )
    if not 1 <= len(of_count) <= 1026:
        raise TableError(
            f"{source}: {where}.lora_case_of_count: expected 1..1026 entries; {_RECOMPILE}"
        )
    return TableSettings(
        name=d["name"],
        mode=_enum(CudagraphMode, d["mode"], f"{where}.mode", source),
        requested_mode=_enum(CudagraphMode, d["requested_mode"], f"{where}.requested_mode", source),
        attention_support=_enum(
            AttentionSupport, d["attention_support"], f"{where}.attention_support", source
        ),
        splitting_ops=tuple(d["splitting_ops"]),
        decode_query_len=d["decode_query_len"],
        max_num_seqs=d["max_num_seqs"],
        max_num_batched_tokens=d["max_num_batched_tokens"],
        capture_sizes=sizes,
        lora_enabled=d["lora_enabled"],
        lora_cases=cases,
        lora_case_of_count=of_count,
        ubatch=UbatchSettings(**ub),
        data_parallel_size=d["data_parallel_size"],
        dp_backend=d["dp_backend"],
        sync_timeout_s=float(t),
        on_demand=d["on_demand"],
        start_sizes=start,
    )


def _graph_from_json(g, i: int, source: str) -> Graph:
    where = f"graphs[{i}]"
    if not isinstance(g, dict):
        raise TableError(f"{source}: {where}: expected an object; {_RECOMPILE}")
    _fields(g, _GRAPH, where, source)
    if g["id"] != i:
        raise TableError(
            f"{source}: {where}.id: {g['id']} (ids are positions in capture order); {_RECOMPILE}"
        )
    if g["routine"] not in ROUTINES:
        raise TableError(
            f"{source}: {where}.routine: {g['routine']!r} is not one of "
            f"{', '.join(ROUTINES)}; {_RECOMPILE}"
        )
    mode = _enum(RuntimeMode, g["mode"], f"{where}.mode", source)
    if mode is RuntimeMode.NONE:
        raise TableError(
            f"{source}: {where}.mode: 'NONE' is not one of PIECEWISE, FULL (a graph "
            f"is never eager); {_RECOMPILE}"
        )
    return Graph(
        id=i,
        mode=mode,
        routine=g["routine"],
        key=BatchDescriptor(**{k: g[k] for k in BatchDescriptor.__slots__}),
    )


def _routes_from_json(routes: dict, cases: int, sizes: int, n_graphs: int, source: str) -> dict:
    if sorted(routes) != sorted(ROUTINES):
        raise TableError(f"{source}: routes: expected exactly {', '.join(ROUTINES)}; {_RECOMPILE}")
    out = {}
    for name in ROUTINES:
        m = routes[name]
        ok = (
            isinstance(m, list)
            and len(m) == cases
            and all(isinstance(row, list) and len(row) == sizes for row in m)
            and all(type(g) is int and -1 <= g < n_graphs for row in m for g in row)
        )
        if not ok:
            raise TableError(
                f"{source}: routes.{name}: expected a [{cases} lora cases x {sizes} "
                f"sizes] matrix of graph ids in -1..{n_graphs - 1}; {_RECOMPILE}"
            )
        out[name] = np.asarray(m, dtype=np.int32).reshape(cases, sizes)
    return out


def decode(data, source: str = "<table>") -> dict:
    """Check a parsed table.json; returns DispatchTable's constructor arguments."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TableError(
            f'{source}: not a graphplan table (no "format": "{FORMAT}"); '
            "compile one with `plan compile PLAN -o table.json`"
        )
    if data.get("format_version") != FORMAT_VERSION:
        raise TableError(
            f"{source}: table format version {data.get('format_version')!r}, this "
            f"graphplan reads version {FORMAT_VERSION}: recompile the plan with "
            "this graphplan's `plan compile PLAN -o table.json`"
        )
    _fields(data, _TOP, "table", source)
    body = {k: v for k, v in data.items() if k != "checksum"}
    if _sha256(body) != data["checksum"]:
        raise TableError(
            f"{source}: corrupted table: checksum mismatch (the file was edited or "
            f"truncated); {_RECOMPILE}"
        )
    settings = settings_from_json(data["settings"], source)
    graphs = tuple(_graph_from_json(g, i, source) for i, g in enumerate(data["graphs"]))
    routes = _routes_from_json(
        data["routes"], len(settings.lora_cases), len(settings.capture_sizes), len(graphs), source
    )
    version = data["compiler_version"]
    if plan_fingerprint(data["plan"], data["settings"], version) != data["fingerprint"]:
        raise TableError(f"{source}: corrupted table: fingerprint mismatch; {_RECOMPILE}")
    if (
        content_fingerprint(data["settings"], data["graphs"], data["routes"], version)
        != data["content_fingerprint"]
    ):
        raise TableError(f"{source}: corrupted table: content_fingerprint mismatch; {_RECOMPILE}")
    _check_diagnostics(data["diagnostics"], source)
    parts = dict(
        plan=data["plan"],
        settings=settings,
        graphs=graphs,
        routes=routes,
        diagnostics=tuple(data["diagnostics"]),
        compiler_version=version,
    )
    verify_against_plan(parts, source)
    return parts


def verify_against_plan(parts: dict, source: str) -> None:
    """Resolve the embedded plan again; settings, graphs and routes must be what it gives. The
    plan is checked against plan.schema.json first (strictly: no 64.0 for 64), so nothing
    unbounded is resolved."""
    problem = first_error(parts["plan"], load_schema())
    if problem:
        raise TableError(
            f"{source}: plan.{problem[0]}: {problem[1]} (the embedded plan is not a "
            f"valid plan); {_RECOMPILE}"
        )
    try:
        fresh = resolve_plan_dict(parts["plan"])
    except GraphplanError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TableError(
            f"{source}: plan: the embedded plan does not compile ({first}); {_RECOMPILE}"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        raise TableError(
            f"{source}: plan: the embedded plan is malformed ({type(e).__name__}: "
            f"{e}); {_RECOMPILE}"
        ) from None
    again = "; the file's settings, graphs and routes must be what its plan compiles to"
    newer = (
        f" (it was compiled by graphplan {parts['compiler_version']}, this is {COMPILER_VERSION})"
        if parts["compiler_version"] != COMPILER_VERSION
        else ""
    )
    if fresh["settings"] != parts["settings"]:
        field = next(
            f
            for f in TableSettings.__slots__
            if getattr(fresh["settings"], f) != getattr(parts["settings"], f)
        )
        raise TableError(
            f"{source}: settings.{field} differs from a fresh compile of the "
            f"embedded plan{newer}{again}; {_RECOMPILE}"
        )
    if fresh["graphs"] != parts["graphs"]:
        i = next(
            (i for i, (a, b) in enumerate(zip(fresh["graphs"], parts["graphs"])) if a != b),
            min(len(fresh["graphs"]), len(parts["graphs"])),
        )
        raise TableError(
            f"{source}: graphs[{i}] differs from a fresh compile of the embedded "
            f"plan{newer}{again}; {_RECOMPILE}"
        )
    for name in ROUTINES:
        a, b = fresh["routes"][name], parts["routes"][name]
        if a.shape != b.shape or not np.array_equal(a, b):
            at = np.argwhere(a != b)[0].tolist() if a.shape == b.shape else []
            raise TableError(
                f"{source}: routes.{name}{at or ''} differs from a fresh compile of "
                f"the embedded plan{newer}{again}; {_RECOMPILE}"
            )
