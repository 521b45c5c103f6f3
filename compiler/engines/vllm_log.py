"""Read a pasted vLLM log, in the formats vLLM has printed since 0.8:

- ``non-default args: {...}``: the EngineArgs/serve fields that differ from their defaults, a
  Python dict repr (object reprs such as ``LoRAModulePath(name=..., path=...)`` or
  ``<class 'x.Y'>`` are kept as data);
- ``Initializing a V1 LLM engine (vX.Y.Z) with config: model='...', speculative_config=None, ...,
  compilation_config={...}``: ``name=value`` pairs whose values are whatever vLLM prints, quoted
  or not (``served_model_name=org/model``, ``tokenizer_mode=auto``, ``dtype=torch.bfloat16``,
  ``DecodingConfig(...)``), ending in the compilation config (JSON before 0.11, a dict repr with
  enum reprs like ``<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>`` since);
- a line whose beginning is missing (a quoted excerpt) is read from its first ``name=``.

Values are parsed by ``pyrepr`` (a bounded hand parser; nothing is evaluated). The fields that
shape graphs are taken; every other field is listed in one note as ignored, never an error. A
graph field that cannot be read (a line cut short) is a located error. Any other line is ignored.
"""

from __future__ import annotations

import re

from ..errors import Diagnostic
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
    "tensor_parallel_size",
    "enable_dbo",
    "dbo_decode_token_threshold",
    "dbo_prefill_token_threshold",
    "enforce_eager",
    "compilation_config",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
    "cuda_graph_sizes",
    "optimization_level",
    "performance_mode",
)
# the engine-config line's fields that shape graphs
ENGINE_FIELDS = (
    "data_parallel_size",
    "tensor_parallel_size",
    "enforce_eager",
    "speculative_config",
    "compilation_config",
)
SHOWN = 12  # ignored names listed in a note before "and N more"


def read_log(text: str, file: str = "<log>") -> tuple[dict, str | None, list]:
    """(settings, vLLM version seen in the log or None, notes)."""
    settings: dict = {}
    version: str | None = None
    seen: list[str] = []
    notes: list[Diagnostic] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if NON_DEFAULT in line:
            start = line.index(NON_DEFAULT) + len(NON_DEFAULT)
            args = _whole_value(line, start, file, lineno)
            seen.append(NON_DEFAULT)
            for key in FIELDS:
                if key in args:
                    settings[key] = F.Setting(
                        _value(key, args[key]), f"{file}:{lineno} non-default args {key}"
                    )
            rest = [str(k) for k in args if k not in FIELDS]
            _note_ignored(notes, file, lineno, "non-default args", rest)
        elif ENGINE_CONFIG in line or "compilation_config=" in line:
            m = _VERSION.search(line)
            version = version or (m.group(1) if m else None)
            start = line.index(ENGINE_CONFIG) + len(ENGINE_CONFIG) if ENGINE_CONFIG in line else 0
            try:
                pairs, head = pyrepr.split_kwargs(line, start)
            except pyrepr.ReprError as e:
                raise _malformed(file, lineno, e.pos, f"engine config: {e}") from None
            if head and ENGINE_CONFIG not in line:
                notes.append(
                    F.note(
                        "",
                        f"{file}:{lineno}: the line's beginning is missing; read from "
                        f"{pairs[0][0] if pairs else 'nothing'}=",
                    )
                )
            seen.append(ENGINE_CONFIG)
            rest = []
            for key, value_text, pos in pairs:
                if key not in ENGINE_FIELDS:
                    rest.append(key)
                    continue
                value = _graph_value(line, pos, value_text, file, lineno, key)
                if value is not None and key not in settings:
                    settings[key] = F.Setting(
                        _value(key, value), f"{file}:{lineno} engine config {key}"
                    )
            _note_ignored(notes, file, lineno, "engine config", rest)
    if not seen:
        raise F.input_error(
            file,
            "no-config-line",
            "no 'non-default args: {...}' line and no engine-config line "
            "('Initializing a V1 LLM engine (...) with config: ...')",
            "paste the lines vLLM prints at start-up",
            1,
            1,
        )
    return settings, version, notes


def _whole_value(line: str, start: int, file: str, lineno: int) -> dict:
    """The dict after ``non-default args:``: all of the rest of the line, nothing else."""
    try:
        value, end = pyrepr.parse_value(line, start)
    except pyrepr.ReprError as e:
        raise _malformed(file, lineno, e.pos, f"non-default args: {e}") from None
    rest = line[end:].strip()
    if rest:
        raise _malformed(
            file, lineno, end, f"non-default args: unexpected text after the value: {rest[:40]!r}"
        )
    if not isinstance(value, dict):
        raise _malformed(file, lineno, start, "non-default args: expected a dict")
    return value


def _graph_value(line: str, pos: int, text: str, file: str, lineno: int, key: str):
    """A graph field's value: it must read whole (a cut-off compilation_config is an error)."""
    at = line.index(text, pos) if text else pos  # where the value's text starts in the line
    try:
        value, end = pyrepr.parse_value(text)
    except pyrepr.ReprError as e:
        raise _malformed(file, lineno, at + e.pos, f"{key}: {e}") from None
    if text[end:].strip():
        raise _malformed(
            file, lineno, at + end, f"{key}: unexpected text after the value: {text[end:][:40]!r}"
        )
    return value


def _malformed(file: str, lineno: int, pos: int, message: str):
    return F.input_error(
        file,
        "malformed-log-line",
        message,
        "paste the whole line; a line cut short (e.g. by a terminal or an issue excerpt) "
        "cannot be read",
        lineno,
        pos + 1,
    )


def _note_ignored(notes: list, file: str, lineno: int, what: str, names: list[str]) -> None:
    if not names:
        return
    shown = ", ".join(names[:SHOWN]) + (
        f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    )
    notes.append(
        F.note(
            "",
            f"{file}:{lineno}: {what}: {len(names)} field(s) that do not shape CUDA graphs, "
            f"ignored: {shown}",
        )
    )


def _value(key: str, value):
    """Log values -> the plain values the flags would give (enums by name, SpeculativeConfig(...)
    reprs by their fields)."""
    v = pyrepr.plain(value)
    if key in ("speculative_config", "compilation_config") and isinstance(v, dict):
        v = {k: x for k, x in v.items() if k != "__call__"}
    if key == "compilation_config" and isinstance(v, dict):
        mode = v.get("cudagraph_mode")
        if isinstance(mode, list):  # a JSON log may print the (decode, mixed) tuple
            mode = {(2, 0): "FULL_DECODE_ONLY", (2, 1): "FULL_AND_PIECEWISE"}.get(tuple(mode))
        elif isinstance(mode, str) and mode.startswith("CUDAGraphMode."):  # an unbracketed enum
            mode = mode.rpartition(".")[2]
        elif isinstance(mode, int):
            mode = ("NONE", "PIECEWISE", "FULL")[mode] if 0 <= mode <= 2 else str(mode)
        if mode is not None:
            v["cudagraph_mode"] = mode
        if v.get("max_capture_size") is not None and "max_cudagraph_capture_size" not in v:
            v["max_cudagraph_capture_size"] = v["max_capture_size"]  # vLLM <= 0.10 spelling
    return v
