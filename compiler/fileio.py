"""File I/O shared by the compiler and the runtime: bounded JSON reading, canonical JSON, and
atomic writes (a temp file in the same folder, then rename: never a partial file)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from .errors import OutputError
from .limits import MAX_DEPTH, read_regular_file

MAX_JSON_BYTES = 64 << 20
"""Largest table or profile read (64 MiB; the 64K-token, LoRA-8, DP-8 plan's table is ~1 MiB)."""


def canonical_json(obj) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range (not a finite float)")
    return value


def _check_depth(obj) -> None:
    """Nesting at most ``MAX_DEPTH`` (a table nests 5 levels), walked without recursion, so
    nothing that later walks the value (checksums, reports) meets a RecursionError."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def read_json(
    path: str | os.PathLike,
    error: type[Exception],
    what: str,
    hint: str,
    limit: int = MAX_JSON_BYTES,
):
    """Parse a JSON file; every failure is ``error`` naming the file, the problem and ``hint``.
    Only regular files are read, their size checked before reading; NaN/Infinity and numbers out
    of float range (``1e999``), integers of more than 4300 digits and nesting deeper than
    ``MAX_DEPTH`` are refused."""
    p = Path(path)
    raw = read_regular_file(p, limit, what, hint, error=error)
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
        if isinstance(data, (dict, list)):
            _check_depth(data)
        return data
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{p}: not a graphplan {what}: not JSON ({e}); {hint}") from None
    except RecursionError:
        raise error(
            f"{p}: not a graphplan {what}: nested more than {MAX_DEPTH} levels; {hint}"
        ) from None
    except ValueError as e:
        raise error(
            f"{p}: not a graphplan {what}: {str(e).splitlines()[0] if str(e) else 'nested too deeply'}"
            f"; {hint}"
        ) from None


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{p}: is a directory; give a file name such as {p / 'table.json'}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    except OSError as e:
        raise OutputError(
            f"{p}: cannot write here ({e.strerror or e}); choose a writable directory with -o"
        ) from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a written file gets the usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise OutputError(f"{p}: cannot write ({e.strerror or e})") from None
        raise
