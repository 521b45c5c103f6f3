"""Read a plan as written (for rewriting) and write the plan ``plan optimize`` tunes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

from ..errors import GraphplanError
from ..plan_or_table import is_table_path
from ..table import DispatchTable

HEADER_MARK = "# Tuned by `plan optimize`"


def raw_plan(path: str, overrides: dict) -> tuple[dict, list[str]]:
    """The plan as its author wrote it (rendered, overrides applied, no defaults filled) and its
    leading comment lines. A compiled ``table.json`` gives its plan with defaults filled."""
    if is_table_path(path):
        return copy.deepcopy(DispatchTable.load(path).plan), []
    from ..load import read_plan

    text, data, _ = read_plan(Path(path), overrides)
    assert isinstance(data, dict)  # the caller compiled this plan first (cli.inputs.load_any)
    comments = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comments.append(line)
    return data, comments


def tuned_plan_text(
    data: dict, sizes, header: list[str], comments: list[str], start_sizes=None
) -> str:
    """``data`` with ``cudagraph.capture_sizes`` set to ``sizes``, every other field as written;
    with ``start_sizes``, on-demand capture turned on with those sizes captured at start."""
    out = copy.deepcopy(data)
    cg = out.get("cudagraph")
    out["cudagraph"] = dict(cg) if isinstance(cg, dict) else {}
    out["cudagraph"]["capture_sizes"] = [int(s) for s in sizes]
    if start_sizes is not None:
        out["cudagraph"]["on_demand"] = {
            "enabled": True,
            "start_sizes": [int(s) for s in start_sizes],
        }
    body = yaml.safe_dump(
        out, sort_keys=False, default_flow_style=None, width=100, allow_unicode=True
    )
    kept, in_old_header = [], False  # drop the header of an earlier run, keep the author's lines
    for c in comments:
        in_old_header = c.startswith(HEADER_MARK) or in_old_header and c.startswith("#   ")
        if not in_old_header:
            kept.append(c)
    return "\n".join(header + kept) + "\n" + body


def check_tuned(text: str, sizes) -> None:
    """The written plan must compile to exactly the chosen sizes, or nothing is written."""
    from .. import compile_plan

    table = compile_plan(yaml.safe_load(text))
    if list(table.capture_sizes) != [int(s) for s in sizes]:
        raise GraphplanError(
            f"internal: the tuned plan resolves to {list(table.capture_sizes)}, "
            f"not the chosen sizes {list(sizes)}; please report this"
        )


PREDICTION_MARK = "#   prediction: "
"""A header line of the tuned plan holding, as JSON, what ``plan optimize`` predicted and for
which engine: ``plan export`` reads it back (and picks the engine when --engine is not given)."""
MAX_PREDICTION_CHARS = 4096


def prediction_line(data: dict) -> str:
    return PREDICTION_MARK + json.dumps(data, sort_keys=True, separators=(", ", ": "))


def read_prediction(text: str) -> dict | None:
    """The prediction of a tuned plan's header (its leading comment lines), checked; None when
    the plan has none or it is not one this graphplan wrote."""
    for line in text.splitlines():
        if not line.startswith("#"):
            return None
        if line.startswith(PREDICTION_MARK) and len(line) <= MAX_PREDICTION_CHARS:
            try:
                data = json.loads(line[len(PREDICTION_MARK) :])
            except (json.JSONDecodeError, RecursionError):
                return None
            ok = (
                isinstance(data, dict)
                and data.get("engine") in (None, "vllm", "sglang", "graphplan")
                and all(
                    isinstance(data.get(k), (int, float)) and not isinstance(data.get(k), bool)
                    for k in ("per_step_before", "per_step_after", "reduction_pct")
                )
                and isinstance(data.get("sizes"), list)
                and all(isinstance(s, int) and not isinstance(s, bool) for s in data["sizes"])
            )
            return data if ok else None
    return None


def prediction_text(data: dict) -> str:
    """One sentence: the saving ``plan optimize`` predicted."""
    return (
        f"predicted by plan optimize on {str(data.get('workload', 'its workload'))[:200]}: "
        f"padding {data['per_step_before']:.3f} -> {data['per_step_after']:.3f} tokens per step "
        f"({0.0 - data['reduction_pct']:+.1f} % padded tokens)"
    )
