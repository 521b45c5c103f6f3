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
failure is a TableError naming the field and saying to recompile. The checks of each field's key,
type, bounds and shape are ``table_fields``; the order of the checks and the fresh compile, here.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .errors import GraphplanError, TableError
from .fileio import canonical_json
from .records import ROUTINES, BatchDescriptor, Graph, TableSettings
from .resolve import resolve_plan_dict
from .schema import load_schema
from .schema_lite import first_error
from .table_fields import (
    MAX_TOKENS,
    RECOMPILE,
    TOP_FIELDS,
    check_diagnostics,
    check_fields,
    graph_from_json,
    routes_from_json,
    settings_from_json,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "COMPILER_VERSION",
    "MAX_TOKENS",
    "encode",
    "decode",
    "verify_against_plan",
    "settings_json",
    "key_json",
    "graph_json",
    "routes_json",
    "plan_fingerprint",
    "content_fingerprint",
]

FORMAT = "graphplan.table"
FORMAT_VERSION = 2
COMPILER_VERSION = "0.2.0"


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
        "tensor_parallel_size": s.tensor_parallel_size,
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


# -- JSON -> records, checked (field by field: table_fields) ------------------------------------
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
    check_fields(data, TOP_FIELDS, "table", source)
    body = {k: v for k, v in data.items() if k != "checksum"}
    if _sha256(body) != data["checksum"]:
        raise TableError(
            f"{source}: corrupted table: checksum mismatch (the file was edited or "
            f"truncated); {RECOMPILE}"
        )
    settings = settings_from_json(data["settings"], source)
    graphs = tuple(graph_from_json(g, i, source) for i, g in enumerate(data["graphs"]))
    routes = routes_from_json(
        data["routes"], len(settings.lora_cases), len(settings.capture_sizes), len(graphs), source
    )
    version = data["compiler_version"]
    if plan_fingerprint(data["plan"], data["settings"], version) != data["fingerprint"]:
        raise TableError(f"{source}: corrupted table: fingerprint mismatch; {RECOMPILE}")
    if (
        content_fingerprint(data["settings"], data["graphs"], data["routes"], version)
        != data["content_fingerprint"]
    ):
        raise TableError(f"{source}: corrupted table: content_fingerprint mismatch; {RECOMPILE}")
    check_diagnostics(data["diagnostics"], source)
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
            f"valid plan); {RECOMPILE}"
        )
    try:
        fresh = resolve_plan_dict(parts["plan"])
    except GraphplanError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TableError(
            f"{source}: plan: the embedded plan does not compile ({first}); {RECOMPILE}"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        raise TableError(
            f"{source}: plan: the embedded plan is malformed ({type(e).__name__}: {e}); {RECOMPILE}"
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
            f"embedded plan{newer}{again}; {RECOMPILE}"
        )
    if fresh["graphs"] != parts["graphs"]:
        i = next(
            (i for i, (a, b) in enumerate(zip(fresh["graphs"], parts["graphs"])) if a != b),
            min(len(fresh["graphs"]), len(parts["graphs"])),
        )
        raise TableError(
            f"{source}: graphs[{i}] differs from a fresh compile of the embedded "
            f"plan{newer}{again}; {RECOMPILE}"
        )
    for name in ROUTINES:
        a, b = fresh["routes"][name], parts["routes"][name]
        if a.shape != b.shape or not np.array_equal(a, b):
            at = np.argwhere(a != b)[0].tolist() if a.shape == b.shape else []
            raise TableError(
                f"{source}: routes.{name}{at or ''} differs from a fresh compile of "
                f"the embedded plan{newer}{again}; {RECOMPILE}"
            )
