"""The memory-profile file: what the runtime's calibration (``runtime/calibrate.py``) writes and
the compiler's memory model (``tools/memory.py``) reads. With the table's modules (``records``,
``table``, ``table_format``, ``errors``) it is the seam between the two halves: the runtime imports
nothing else of the compiler. Standard library only.

    {"format": "graphplan.memory_profile", "version": 1, "model_fingerprint": str,
     "device": str, "per_graph_bytes": float, "per_token_bytes": float,
     "base_bytes": float (optional, default 0), "piecewise_per_token_bytes": float (optional),
     "per_graph_capture_seconds": float (optional), "base_capture_seconds": float (optional),
     "samples": [[num_tokens, bytes], ...]}
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .errors import GraphplanError
from .fileio import write_atomic

FORMAT = "graphplan.memory_profile"
VERSION = 1
MAX_PROFILE_BYTES = 1 << 20
"""A profile is a few hundred bytes; a larger file is not one."""


class ProfileError(GraphplanError):
    """A memory profile cannot be read or used (bad JSON, wrong format, bad numbers)."""


def _number(value, where: str, source: str, minimum: float = 0.0) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < minimum
    ):
        raise ProfileError(
            f"{source}: {where}: expected a finite number >= {minimum:g}, got "
            f"{value!r} (recalibrate with the runtime or fix the file)"
        )
    return float(value)


def _samples(samples, source: str) -> list[list[float]]:
    if not isinstance(samples, (list, tuple)):
        raise ProfileError(f"{source}: samples: expected a list of [num_tokens, bytes] pairs")
    out = []
    for i, pair in enumerate(samples):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ProfileError(
                f"{source}: samples[{i}]: expected [num_tokens, bytes], got {pair!r}"
            )
        n = pair[0]
        if (
            isinstance(n, bool)
            or not isinstance(n, (int, float))
            or not math.isfinite(n)
            or n != int(n)
            or n < 1
        ):
            raise ProfileError(
                f"{source}: samples[{i}][0] (num_tokens): expected an integer >= 1, got {n!r}"
            )
        out.append([int(n), _number(pair[1], f"samples[{i}][1] (bytes)", source, 0.0)])
    return out


def check_profile(data, source: str = "<profile>") -> dict:
    """Validate a profile dict; returns a clean copy. Raises ProfileError naming the field."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(
            f'{source}: not a graphplan memory profile (no "format": "{FORMAT}"); '
            "calibrate one with the runtime"
        )
    if data.get("version") != VERSION:
        raise ProfileError(
            f"{source}: profile version {data.get('version')!r}; this graphplan "
            f"reads version {VERSION}: recalibrate with this graphplan's runtime"
        )
    for key in ("model_fingerprint", "device"):
        if not isinstance(data.get(key), str):
            raise ProfileError(f"{source}: {key}: expected a string, got {data.get(key)!r}")
    out = {
        "format": FORMAT,
        "version": VERSION,
        "model_fingerprint": data["model_fingerprint"],
        "device": data["device"],
        "per_graph_bytes": _number(data.get("per_graph_bytes"), "per_graph_bytes", source),
        "per_token_bytes": _number(data.get("per_token_bytes"), "per_token_bytes", source),
        "base_bytes": _number(data.get("base_bytes", 0.0), "base_bytes", source),
        "samples": _samples(data.get("samples", []), source),
    }
    for key in ("piecewise_per_token_bytes", "per_graph_capture_seconds", "base_capture_seconds"):
        if key in data:  # optional: measured by calibrations that know them
            out[key] = _number(data[key], key, source)
    return out


def load_profile(path: str | os.PathLike) -> dict:
    from .limits import read_regular_file  # regular files only, size first

    p = Path(path)
    hint = "calibrate one with examples/calibrate_memory.py (runtime/calibrate.py)"
    raw = read_regular_file(p, MAX_PROFILE_BYTES, "memory profile", hint, error=ProfileError)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ProfileError(f"{p}: not a graphplan memory profile: not JSON ({e}); {hint}") from None
    out = check_profile(data, str(p))
    out["source"] = str(p)
    return out


def save_profile(path: str | os.PathLike, profile: dict) -> None:
    """Validate, then write atomically (never a partial file)."""
    clean = check_profile(profile, str(path))
    write_atomic(path, (json.dumps(clean, indent=1, sort_keys=True) + "\n").encode())
