"""Where ``-o`` may write: never onto an input of the same command, never onto anything but a
regular file (or a new name). The write itself is atomic (``table.write_atomic``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import OutputError


def check_output(output: str | os.PathLike | None, inputs) -> None:
    """Raise OutputError if writing ``output`` would replace one of ``inputs`` (compared after
    resolving ``..`` and symlinks, and by inode) or a file that is not a regular file (a device,
    a FIFO, a socket, or a symlink to one)."""
    if output is None:
        return
    out = Path(output)
    target = out.resolve()
    try:
        st = os.stat(out)  # follows symlinks: what the name points at
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{out}: cannot write ({e.strerror or e})") from None
    for given in inputs:
        if given is None:
            continue
        src = Path(given)
        same = src.resolve() == target
        if not same and st is not None:
            try:
                same = os.path.samefile(src, out)
            except OSError:
                same = False
        if same:
            raise OutputError(
                f"{out}: is an input of this command ({given}); writing there would "
                "destroy it: choose another -o name"
            )
    if st is not None and not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        raise OutputError(
            f"{out}: is not a regular file (a device, FIFO or socket, or a symlink "
            "to one); -o writes regular files only: choose another -o name"
        )
