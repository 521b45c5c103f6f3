"""The plan that ``plan import`` fills: every plan path gets a value and the reason for it (where
it came from, or which default was assumed), written out as YAML with one comment per value.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import Diagnostic, did_you_mean
from .flags import NOTE, input_error

ORDER = (
    "version",
    "name",
    "scheduler.max_num_seqs",
    "scheduler.max_num_batched_tokens",
    "scheduler.decode_query_len",
    "cudagraph.mode",
    "cudagraph.attention_support",
    "cudagraph.splitting_ops",
    "cudagraph.capture_sizes",
    "cudagraph.strict",
    "lora.enabled",
    "lora.max_loras",
    "lora.specialize_count",
    "lora.separate_base",
    "parallel.data_parallel_size",
    "parallel.tensor_parallel_size",
    "parallel.ubatch.enabled",
    "parallel.ubatch.num_ubatches",
    "parallel.ubatch.decode_token_threshold",
    "parallel.ubatch.prefill_token_threshold",
    "parallel.ubatch.plain_twins",
)


class Draft:
    """A plan being imported: every path in ORDER gets a value and the reason for it."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}
        self.why: dict[str, str] = {}
        self.notes: list[Diagnostic] = []
        self.pending: Any = None
        """Engine inputs a value still waits on (e.g. sizes need the final scheduler values);
        each adapter reads back what it stored."""
        self.put("version", 1, "graphplan plan format")

    def put(self, path: str, value, why: str) -> None:
        self.values[path], self.why[path] = value, why

    def count(self, path: str) -> int:
        """The value at ``path`` as a whole number >= 1 (a scheduler limit that capture sizes are
        derived from); a ``--set`` of anything else is refused here, before any arithmetic."""
        value = self.values[path]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise input_error(
                "<plan>",
                "bad-value",
                f"{path}: expected an integer >= 1, got {value!r} (from {self.why[path]})",
                f"give --set {path}=N with a whole number N >= 1",
            )
        return value

    def assume(self, path: str, value, why: str) -> None:
        if path not in self.values:
            self.put(path, value, "assumed: " + why)

    def note(self, message: str, hint: str = "") -> None:
        self.notes.append(Diagnostic(code=NOTE, message=message, hint=hint))

    def apply_sets(self, sets: dict) -> None:
        for key, value in sets.items():
            if key not in ORDER:
                hint = (
                    did_you_mean(key, ORDER)
                    or "keys are dotted plan paths, e.g. scheduler.max_num_seqs"
                )
                raise input_error("--set", "unknown-key", f"{key!r} is not a plan setting", hint)
            self.put(key, value, f"--set {key}")

    def fill_defaults(self) -> None:
        """Paths the engine has no setting for take graphplan's schema defaults."""
        from ..schema import fill_defaults

        plan = fill_defaults({"version": 1, "name": "imported"})
        for path in ORDER:
            node = plan
            for part in path.split("."):
                node = node[part]
            why = (
                "unused while LoRA is off"
                if path.startswith("lora.") and not self.values.get("lora.enabled")
                else (
                    "unused while micro-batching is off"
                    if path.startswith("parallel.ubatch.")
                    and not self.values.get("parallel.ubatch.enabled")
                    else "graphplan's default (no engine setting)"
                )
            )
            self.assume(path, node, why)

    def as_dict(self) -> dict:
        out: dict = {}
        for path in ORDER:
            node, parts = out, path.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = self.values[path]
        return out

    def yaml(self, header: list[str]) -> str:
        lines = [f"# {h}" if h else "#" for h in header]
        lines.append(
            "# yaml-language-server: $schema=https://graphplan.dev/schemas/plan.schema.json"
        )
        open_sections: list[str] = []
        for path in ORDER:
            parts = path.split(".")
            for depth, part in enumerate(parts[:-1]):
                if open_sections[: depth + 1] != parts[: depth + 1]:
                    lines.append("  " * depth + f"{part}:")
                    open_sections = parts[: depth + 1]
            key = "  " * (len(parts) - 1) + f"{parts[-1]}: {_scalar(self.values[path])}"
            lines.append(f"{key:<43}  # {self.why[path]}")
        return "\n".join(lines) + "\n"


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_scalar(x)}" for k, x in v.items()) + "}"
    if isinstance(v, str):
        return json.dumps(v) if not v.replace("_", "").replace("-", "").isalnum() else v
    return str(v)
