"""Read a pasted vLLM log: the ``non-default args: {...}`` line (EngineArgs fields that differ from
their defaults, a Python dict repr) and the engine-config line ``Initializing a V1 LLM engine
(vX.Y.Z) with config: model=..., ..., compilation_config={...}``. Both are parsed by ``pyrepr``
(a hand parser over a fixed grammar; nothing is evaluated). Any other line is ignored.
"""

from __future__ import annotations

import re

from . import flags as F
from . import pyrepr

NON_DEFAULT = "non-default args:"
ENGINE_CONFIG = "with config:"
_VERSION = re.compile(r"engine \(v(\d+\.\d+)")
# EngineArgs fields the plan reads (same keys as the flags in vllm.FLAGS)
FIELDS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "speculative_config",
    "enable_lora",
    "max_loras",
    "specialize_active_lora",
    "data_parallel_size",
    "enable_dbo",
    "dbo_decode_token_threshold",
    "dbo_prefill_token_threshold",
    "enforce_eager",
    "compilation_config",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
    "cuda_graph_sizes",
)


def _parse(text: str, start: int, file: str, lineno: int, line: str, what: str, kwargs=False):
    try:
        if kwargs:
            return pyrepr.parse_kwargs(text, start)
        value, end = pyrepr.parse_value(text, start)
    except pyrepr.ReprError as e:
        raise F.input_error(
            file,
            "malformed-log-line",
            f"{what}: {e}",
            "paste the whole line; "
            "a line cut short (e.g. by a terminal or an issue excerpt) cannot be "
            "read",
            lineno,
            e.pos + 1,
        ) from None
    rest = text[end:].strip()
    if rest:
        raise F.input_error(
            file,
            "malformed-log-line",
            f"{what}: unexpected text after the value: {rest[:40]!r}",
            "",
            lineno,
            end + 1,
        )
    return value


def read_log(text: str, file: str = "<log>") -> tuple[dict, str | None, list]:
    """(settings, vLLM version seen in the log or None, notes)."""
    settings: dict = {}
    version, seen = None, []
    for lineno, line in enumerate(text.splitlines(), 1):
        if NON_DEFAULT in line:
            start = line.index(NON_DEFAULT) + len(NON_DEFAULT)
            args = _parse(line, start, file, lineno, line, "non-default args")
            if not isinstance(args, dict):
                raise F.input_error(
                    file,
                    "malformed-log-line",
                    "non-default args: expected a dict",
                    "",
                    lineno,
                    start + 1,
                )
            seen.append(NON_DEFAULT)
            for key in FIELDS:
                if key in args:
                    settings[key] = F.Setting(
                        _value(key, args[key]), f"{file}:{lineno} non-default args {key}"
                    )
        elif "compilation_config=" in line:
            m = _VERSION.search(line)
            version = version or (m.group(1) if m else None)
            if ENGINE_CONFIG in line:
                start = line.index(ENGINE_CONFIG) + len(ENGINE_CONFIG)
                cfg = _parse(line, start, file, lineno, line, "engine config", kwargs=True)
            else:  # the line's head is missing (a quoted excerpt): read its last setting only
                start = line.rindex("compilation_config=") + len("compilation_config=")
                cfg = {
                    "compilation_config": _parse(
                        line, start, file, lineno, line, "compilation_config"
                    )
                }
            seen.append(ENGINE_CONFIG)
            for key in (
                "data_parallel_size",
                "enforce_eager",
                "speculative_config",
                "compilation_config",
            ):
                if key in cfg and cfg[key] is not None and key not in settings:
                    settings[key] = F.Setting(
                        _value(key, cfg[key]), f"{file}:{lineno} engine config {key}"
                    )
    if not seen:
        raise F.input_error(
            file,
            "no-config-line",
            "no 'non-default args: {...}' line and no "
            "engine-config line ending in compilation_config={...}",
            "paste the lines vLLM prints at start-up",
            1,
            1,
        )
    return settings, version, []


def _value(key: str, value):
    """Log values -> the plain values the flags would give (enums by name, SpeculativeConfig(...)
    reprs by their fields)."""
    v = pyrepr.plain(value)
    if key == "speculative_config" and isinstance(v, dict):
        v = {k: x for k, x in v.items() if k != "__call__"}
    if key == "compilation_config" and isinstance(v, dict):
        mode = v.get("cudagraph_mode")
        if isinstance(mode, list):  # a JSON log may print the (decode, mixed) tuple
            mode = {(2, 0): "FULL_DECODE_ONLY", (2, 1): "FULL_AND_PIECEWISE"}.get(tuple(mode))
        elif isinstance(mode, int):
            mode = ("NONE", "PIECEWISE", "FULL")[mode]
        if mode is not None:
            v["cudagraph_mode"] = mode
        if v.get("max_capture_size") is not None and "max_cudagraph_capture_size" not in v:
            v["max_cudagraph_capture_size"] = v["max_capture_size"]  # vLLM <= 0.10 spelling
    return v
