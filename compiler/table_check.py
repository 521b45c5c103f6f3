"""Structural checks of a loaded table.json, in plain Python (the runtime has no jsonschema).

``schemas/table.schema.json`` documents the same contract; a test validates emitted tables
against it, and another feeds broken tables here.
"""

from __future__ import annotations

from compiler.errors import TableError
from compiler.table import FORMAT, FORMAT_VERSION, ROUTINES

_TOP = {"format": str, "format_version": int, "compiler_version": str, "fingerprint": str,
        "checksum": str, "plan": dict, "resolved": dict, "graphs": list, "routes": dict,
        "diagnostics": list}
_RESOLVED = {"mode": str, "decode_mode": str, "mixed_mode": str, "separate_routines": bool,
             "decode_query_len": int, "max_num_seqs": int, "max_num_batched_tokens": int,
             "capture_sizes": list, "lora_enabled": bool, "lora_cases": list,
             "lora_case_of_count": list, "ubatch": dict, "data_parallel_size": int}
_GRAPH = {"id": int, "mode": str, "routine": str, "num_tokens": int, "uniform": bool,
          "has_lora": bool, "num_active_loras": int, "num_ubatches": int}


def _fields(obj: dict, spec: dict, where: str, source: str) -> None:
    for key, typ in spec.items():
        if key not in obj:
            raise TableError(f"{source}: {where}: missing '{key}' (recompile with `plan compile`)")
        val = obj[key]
        if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
            raise TableError(f"{source}: {where}.{key}: expected {typ.__name__}, got "
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
    sizes = res["capture_sizes"]
    if any(not isinstance(s, int) or s < 1 for s in sizes) or sizes != sorted(set(sizes)):
        raise TableError(f"{source}: resolved.capture_sizes must be sorted distinct positive ints")
    if sizes and sizes[-1] > res["max_num_batched_tokens"]:
        raise TableError(f"{source}: resolved.capture_sizes exceed max_num_batched_tokens")
    cases = len(res["lora_cases"])
    if cases < 1 or any(not isinstance(c, int) or not -1 <= c < cases
                        for c in res["lora_case_of_count"]):
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
