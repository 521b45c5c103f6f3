"""Bounds on what a plan may be, wherever it came from: the file, ``--set`` values, a rendered
template, an API dict. One set of numbers, so no door is wider than the others.

- size: ``MAX_PLAN_BYTES`` (the file, each ``--set`` value, the rendered template);
- nesting depth ``MAX_DEPTH`` and values ``MAX_NODES`` (aliases expanded);
- integers below ``2**MAX_INT_BITS`` and finite numbers only;
- files: regular files only, their size checked before reading;
- compiled result: at most ``limits.max_graphs`` graphs (a plan field, default 4096 in the
  schema; resolve.check_graph_count) and ``sizes.MAX_SIZES`` capture sizes from any form.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

from .errors import Diagnostic, PlanError

MAX_PLAN_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 32
"""Nesting deeper than this is not a plan (plans nest 5 levels)."""
MAX_NODES = 100_000
"""YAML nodes after expanding aliases; more is not a plan (and would stall validation)."""
MAX_INT_BITS = 1000
"""Integers of more bits are refused before anything parses or prints them (Python refuses to
turn a 5000-digit number into text); the schema's maximums then bound the rest."""


def fail(
    file: str, code: str, message: str, hint: str = "", line: int = 0, col: int = 0, path: str = ""
):
    raise PlanError(
        [
            Diagnostic(
                code=code,
                message=message,
                hint=hint,
                severity="error",
                file=file,
                line=line,
                col=col,
                path=path,
            )
        ]
    )


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_regular_file(
    path: Path,
    limit: int = MAX_PLAN_BYTES,
    what: str = "plan",
    hint: str = "give a plan file, e.g. plans/llama3-8b-h100.yaml",
    error: type[Exception] | None = None,
) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes: FIFOs, devices and sockets are
    refused before they are opened for reading, the size is checked before reading, and at most
    ``limit + 1`` bytes are ever read. Failures are PlanErrors naming the file (or ``error``
    with the same words, for other kinds of input)."""
    if error is None:
        return _read_regular(Path(path), limit, what, hint)
    try:
        return _read_regular(Path(path), limit, what, hint)
    except PlanError as e:
        d = e.diagnostics[0]
        raise error(
            f"{d.file}: cannot read {what}: {d.message}" + (f" ({d.hint})" if d.hint else "")
        ) from None


def _read_regular(path: Path, limit: int, what: str, hint: str) -> bytes:
    f = str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        fail(
            f,
            "not-found",
            "no such file",
            "check the path; shipped plans are in plans/" if what == "plan" else hint,
        )
    except OSError as e:
        fail(f, "unreadable", f"cannot read: {e.strerror or e}")
    if stat.S_ISDIR(st.st_mode):
        fail(f, "not-a-file", "is a directory", hint)
    if not stat.S_ISREG(st.st_mode):
        fail(f, "not-a-file", f"is {_kind(st.st_mode)}; graphplan reads only regular files", hint)
    if st.st_size > limit:
        fail(f, "too-large", f"{st.st_size} bytes; a {what} is at most {limit} bytes")
    try:  # O_NONBLOCK: if the path became a FIFO since the stat, opening it does not block
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        fail(f, "unreadable", f"cannot read: {e.strerror or e}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            fail(
                f, "not-a-file", f"is {_kind(st.st_mode)}; graphplan reads only regular files", hint
            )
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        fail(f, "unreadable", f"cannot read: {e.strerror or e}")
    finally:
        os.close(fd)
    if size > limit:
        fail(f, "too-large", f"more than {limit} bytes; a {what} is at most {limit} bytes")
    return b"".join(chunks)


def check_value(value, file: str, path: str = "") -> None:
    """Bounds for a value that did not come through the YAML reader (``--set`` values, API and
    server dicts): depth, count, string size, integer size, finiteness. Walked without
    recursion, so a 100k-deep list is an error, not a RecursionError."""
    stack = [(value, path, 0)]
    nodes = chars = 0
    while stack:
        v, where, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            fail(file, "too-large", f"more than {MAX_NODES} values", "plans are small", path=path)
        if isinstance(v, (dict, list, tuple)):
            if depth >= MAX_DEPTH:
                fail(
                    file,
                    "too-deep",
                    f"nested more than {MAX_DEPTH} levels",
                    "plans nest a few levels",
                    path=path,
                )
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, child in items:
                if isinstance(k, str):
                    chars += len(k)
                sub = f"{where}.{k}" if isinstance(v, dict) else f"{where}[{k}]"
                stack.append((child, sub.lstrip("."), depth + 1))
        elif isinstance(v, str):
            chars += len(v)
        elif isinstance(v, bool) or v is None:
            pass
        elif isinstance(v, int):
            if v.bit_length() > MAX_INT_BITS:
                fail(
                    file,
                    "out-of-range",
                    f"an integer of {v.bit_length()} bits; plan integers "
                    f"are far below 2**{MAX_INT_BITS}",
                    "use a plan-sized number",
                    path=where,
                )
        elif isinstance(v, float):
            if not math.isfinite(v):
                fail(
                    file, "not-finite", f"{v} is not a finite number", "write a number", path=where
                )
        if chars > MAX_PLAN_BYTES:
            fail(
                file,
                "too-large",
                f"more than {MAX_PLAN_BYTES} characters of text",
                "plans are small",
                path=path,
            )
