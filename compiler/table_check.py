"""Structural checks of a loaded table.json, in plain Python (the runtime has no jsonschema).

``schemas/table.schema.json`` documents the same contract; a test validates emitted tables
against it, and another feeds broken tables here.
"""

from __future__ import annotations

from graphplan.compiler.errors import TableError
from graphplan.compiler.table import FORMAT, FORMAT_VERSION, ROUTINES

_TOP = {"format": str, "format_version": int, "compiler_version": str, "fingerprint": str,
        "checksum": str, "plan": dict, "resolved": dict, "graphs": list, "routes": dict,
        "diagnostics": list}
_RESOLVED = {"mode": str, "requested_mode": str, "decode_mode": str, "mixed_mode": str,
             "separate_routines": bool, "attention_support": str, "decode_query_len": int,
             "max_num_seqs": int, "max_num_batched_tokens": int, "capture_sizes": list,
             "lora_enabled": bool, "lora_cases": list, "lora_case_of_count": list, "ubatch": dict,
             "data_parallel_size": int, "dp_backend": str, "sync_timeout_s": (int, float)}
_UBATCH = {"enabled": bool, "num_ubatches": int, "decode_token_threshold": int,
           "prefill_token_threshold": int, "plain_twins": bool}
_GRAPH = {"id": int, "mode": str, "routine": str, "num_tokens": int, "num_reqs": (int, type(None)),
          "uniform": bool, "has_lora": bool, "num_active_loras": int, "num_ubatches": int}
_RUNTIME_MODES = ("NONE", "PIECEWISE", "FULL")


def _fields(obj: dict, spec: dict, where: str, source: str) -> None:
    """Exactly the keys of ``spec``, each of its type (table.schema.json: additionalProperties
    false, every property required)."""
    extra = sorted(map(str, set(obj) - set(spec)))
    if extra:
        raise TableError(f"{source}: {where}: unknown key '{extra[0]}' (a table from another "
                         "graphplan? recompile with `plan compile`)")
    for key, typ in spec.items():
        if key not in obj:
            raise TableError(f"{source}: {where}: missing '{key}' (recompile with `plan compile`)")
        val = obj[key]
        if not isinstance(val, typ) or (isinstance(val, bool) and typ is not bool):
            want = " or ".join(t.__name__ for t in typ) if isinstance(typ, tuple) else typ.__name__
            raise TableError(f"{source}: {where}.{key}: expected {want}, got "
                             f"{type(val).__name__}")


def check_table_json(data, source: str) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TableError(f"{source}: not a graphplan table (no \"format\": \"{FORMAT}\"); "
                         "compile one with `plan compile PLAN -o table.json`")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise TableError(f"{source}: table format version {version!r}, this graphplan reads "
                         f"version {FORMAT_VERSION}: recompile the plan with this graphplan's "
                         "`plan compile`")
    _fields(data, _TOP, "table", source)
    res = data["resolved"]
    _fields(res, _RESOLVED, "resolved", source)
    _fields(res["ubatch"], _UBATCH, "resolved.ubatch", source)
    if res["decode_mode"] not in _RUNTIME_MODES or res["mixed_mode"] not in _RUNTIME_MODES:
        raise TableError(f"{source}: resolved.decode_mode / mixed_mode must be one of "
                         f"{', '.join(_RUNTIME_MODES)}")
    for key in ("decode_query_len", "max_num_seqs", "max_num_batched_tokens"):
        if res[key] < 1:
            raise TableError(f"{source}: resolved.{key} must be >= 1")
    sizes = res["capture_sizes"]
    if any(not isinstance(s, int) or s < 1 for s in sizes) or sizes != sorted(set(sizes)):
        raise TableError(f"{source}: resolved.capture_sizes must be sorted distinct positive ints")
    if sizes and sizes[-1] > res["max_num_batched_tokens"]:
        raise TableError(f"{source}: resolved.capture_sizes exceed max_num_batched_tokens")
    cases, of_count = len(res["lora_cases"]), res["lora_case_of_count"]
    if cases < 1 or not of_count or any(not isinstance(c, int) or isinstance(c, bool)
                                        or not 0 <= c < cases for c in of_count):
        raise TableError(f"{source}: resolved.lora_case_of_count must index resolved.lora_cases")
    n_graphs = len(data["graphs"])
    for i, g in enumerate(data["graphs"]):
        if not isinstance(g, dict):
            raise TableError(f"{source}: graphs[{i}]: expected an object")
        _fields(g, _GRAPH, f"graphs[{i}]", source)
        if g["id"] != i or g["mode"] not in ("PIECEWISE", "FULL") or g["routine"] not in ROUTINES:
            raise TableError(f"{source}: graphs[{i}]: bad id, mode or routine")
    if sorted(data["routes"]) != sorted(ROUTINES):
        raise TableError(f"{source}: routes must have exactly {', '.join(ROUTINES)}")
    for name, m in data["routes"].items():
        ok = (isinstance(m, list) and len(m) == cases
              and all(isinstance(row, list) and len(row) == len(sizes) for row in m)
              and all(isinstance(g, int) and -1 <= g < n_graphs for row in m for g in row))
        if not ok:
            raise TableError(f"{source}: routes.{name}: expected a [{cases} lora cases x "
                             f"{len(sizes)} sizes] matrix of graph ids in -1..{n_graphs - 1}")
