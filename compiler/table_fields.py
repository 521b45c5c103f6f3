"""``table.json`` back into records, field by field: the keys, types, bounds and shapes a table
must have (``table_format.decode`` runs these checks, then the checksum, the fingerprints and the
fresh compile). Every failure is a TableError naming the field and saying to recompile."""

from __future__ import annotations

import math
import re

import numpy as np

from .errors import MAX_LINE, TableError
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

MAX_TOKENS = 1 << 20
"""Largest token count a plan may name (plan.schema.json's maximum); bounds every table array."""

RECOMPILE = "recompile it with `plan compile PLAN -o table.json`"
"""How every TableError about a table's content ends."""


TOP_FIELDS = {
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
"""The document's keys and their types."""
SETTINGS_FIELDS = {
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
    "tensor_parallel_size": int,
    "dp_backend": str,
    "sync_timeout_s": (int, float),
    "on_demand": bool,
    "start_sizes": list,
}
"""``settings``' keys and types (TableSettings' fields)."""
OPTIONAL_SETTINGS = {"tensor_parallel_size": 1}
"""``settings``' keys that tables compiled before them lack, and the value they mean then."""
UBATCH_FIELDS = {
    "enabled": bool,
    "num_ubatches": int,
    "decode_token_threshold": int,
    "prefill_token_threshold": int,
    "plain_twins": bool,
}
"""``settings.ubatch``' keys and types."""
GRAPH_FIELDS = {
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
"""A graph's keys and types (Graph's, its key's fields inline)."""
# settings ints and their inclusive bounds (the plan schema's)
_BOUNDS = {
    "decode_query_len": 64,
    "max_num_seqs": 65536,
    "max_num_batched_tokens": MAX_TOKENS,
    "data_parallel_size": 1024,
    "tensor_parallel_size": 64,
}


def check_fields(obj: dict, spec: dict, where: str, source: str) -> None:
    """Exactly the keys of ``spec``, each of its type (bool is not an int here)."""
    extra = sorted(map(str, set(obj) - set(spec)))
    if extra:
        raise TableError(
            f"{source}: {where}: unknown key '{extra[0]}' (a table from another "
            f"graphplan?); {RECOMPILE}"
        )
    for key, typ in spec.items():
        if key not in obj:
            raise TableError(f"{source}: {where}: missing '{key}'; {RECOMPILE}")
        val = obj[key]
        if not isinstance(val, typ) or (isinstance(val, bool) and typ is not bool):
            want = " or ".join(t.__name__ for t in typ) if isinstance(typ, tuple) else typ.__name__
            raise TableError(
                f"{source}: {where}.{key}: expected {want}, got {type(val).__name__}; {RECOMPILE}"
            )


def _int_list(val, where: str, source: str, lo: int, hi: int, ascending: bool = False) -> tuple:
    if not all(type(v) is int and lo <= v <= hi for v in val):
        raise TableError(f"{source}: {where}: expected integers in {lo}..{hi}; {RECOMPILE}")
    if ascending and any(a >= b for a, b in zip(val, val[1:])):
        raise TableError(f"{source}: {where}: expected sorted distinct values; {RECOMPILE}")
    return tuple(val)


def _enum(enum_cls, name: str, where: str, source: str):
    try:
        return enum_cls[name]
    except KeyError:
        raise TableError(
            f"{source}: {where}: {name!r} is not one of "
            f"{', '.join(enum_cls.__members__)}; {RECOMPILE}"
        ) from None


def settings_from_json(d: dict, source: str, where: str = "settings") -> TableSettings:
    d = {**OPTIONAL_SETTINGS, **d}
    check_fields(d, SETTINGS_FIELDS, where, source)
    check_fields(d["ubatch"], UBATCH_FIELDS, f"{where}.ubatch", source)
    for key, hi in _BOUNDS.items():
        if not 1 <= d[key] <= hi:
            raise TableError(f"{source}: {where}.{key}: {d[key]} is outside 1..{hi}; {RECOMPILE}")
    t = d["sync_timeout_s"]
    if not (math.isfinite(t) and 0 < t <= 86400):
        raise TableError(
            f"{source}: {where}.sync_timeout_s: {t!r} is not a number of seconds in "
            f"(0, 86400]; {RECOMPILE}"
        )
    ub = d["ubatch"]
    for key in ("num_ubatches", "decode_token_threshold", "prefill_token_threshold"):
        if not 1 <= ub[key] <= MAX_TOKENS:
            raise TableError(
                f"{source}: {where}.ubatch.{key}: {ub[key]} is out of range; {RECOMPILE}"
            )
    if not all(isinstance(op, str) for op in d["splitting_ops"]):
        raise TableError(f"{source}: {where}.splitting_ops: expected strings; {RECOMPILE}")
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
        raise TableError(f"{source}: {where}.lora_cases: empty; {RECOMPILE}")
    of_count = _int_list(
        d["lora_case_of_count"], f"{where}.lora_case_of_count", source, 0, len(cases) - 1
    )
    if not 1 <= len(of_count) <= 1026:
        raise TableError(
            f"{source}: {where}.lora_case_of_count: expected 1..1026 entries; {RECOMPILE}"
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
        tensor_parallel_size=d["tensor_parallel_size"],
        dp_backend=d["dp_backend"],
        sync_timeout_s=float(t),
        on_demand=d["on_demand"],
        start_sizes=start,
    )


def graph_from_json(g, i: int, source: str) -> Graph:
    where = f"graphs[{i}]"
    if not isinstance(g, dict):
        raise TableError(f"{source}: {where}: expected an object; {RECOMPILE}")
    check_fields(g, GRAPH_FIELDS, where, source)
    if g["id"] != i:
        raise TableError(
            f"{source}: {where}.id: {g['id']} (ids are positions in capture order); {RECOMPILE}"
        )
    if g["routine"] not in ROUTINES:
        raise TableError(
            f"{source}: {where}.routine: {g['routine']!r} is not one of "
            f"{', '.join(ROUTINES)}; {RECOMPILE}"
        )
    mode = _enum(RuntimeMode, g["mode"], f"{where}.mode", source)
    if mode is RuntimeMode.NONE:
        raise TableError(
            f"{source}: {where}.mode: 'NONE' is not one of PIECEWISE, FULL (a graph "
            f"is never eager); {RECOMPILE}"
        )
    return Graph(
        id=i,
        mode=mode,
        routine=g["routine"],
        key=BatchDescriptor(**{k: g[k] for k in BatchDescriptor.__slots__}),
    )


def routes_from_json(routes: dict, cases: int, sizes: int, n_graphs: int, source: str) -> dict:
    if sorted(routes) != sorted(ROUTINES):
        raise TableError(f"{source}: routes: expected exactly {', '.join(ROUTINES)}; {RECOMPILE}")
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
                f"sizes] matrix of graph ids in -1..{n_graphs - 1}; {RECOMPILE}"
            )
        out[name] = np.asarray(m, dtype=np.int32).reshape(cases, sizes)
    return out


DIAGNOSTIC_FIELDS = {"code": str, "severity": str, "path": str, "message": str, "hint": str}
_CODE = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
MAX_DIAGNOSTICS = 100_000
"""More diagnostics than this is not a compiler's output (a warning per size at most, or so)."""


def check_diagnostics(diags: list, source: str) -> None:
    """What ``plan report`` and ``plan validate`` print: objects of the five string fields of
    table.schema.json, a kebab-case code, severity warning or error, each text plan-sized."""
    if len(diags) > MAX_DIAGNOSTICS:
        raise TableError(
            f"{source}: diagnostics: {len(diags)} entries, more than a compile gives; {RECOMPILE}"
        )
    for i, d in enumerate(diags):
        where = f"diagnostics[{i}]"
        if not isinstance(d, dict):
            raise TableError(
                f"{source}: {where}: expected an object, got {type(d).__name__}; {RECOMPILE}"
            )
        check_fields(d, DIAGNOSTIC_FIELDS, where, source)
        if not _CODE.fullmatch(d["code"]):
            raise TableError(
                f"{source}: {where}.code: {d['code']!r} is not a kebab-case code; {RECOMPILE}"
            )
        if d["severity"] not in ("warning", "error"):
            raise TableError(
                f"{source}: {where}.severity: {d['severity']!r} is not warning or error; "
                f"{RECOMPILE}"
            )
        long = next((k for k in DIAGNOSTIC_FIELDS if len(d[k]) > MAX_LINE), None)
        if long:
            raise TableError(
                f"{source}: {where}.{long}: {len(d[long])} characters, more than a "
                f"diagnostic has ({MAX_LINE}); {RECOMPILE}"
            )
