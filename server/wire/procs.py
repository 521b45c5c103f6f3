"""Starting the server's processes and ending them with it: the socket addresses of one server,
the engine process, the extra front ends of ``--api-server-count``, and the parent-death signal
that ends a child when the server process dies, however it dies (even SIGKILL)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import tempfile
from dataclasses import dataclass
from typing import Any

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent ends (elsewhere: the engine checks its parent's
    pid while idle)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True, slots=True)
class Addresses:
    """IPC endpoints of one server, in a private directory: each engine's inbox and one PULL
    socket per front end."""

    directory: str
    frontends: int
    engines: int = 1
    """Data parallelism: one engine process per DP rank, each with its inbox."""

    @classmethod
    def new(cls, frontends: int, engines: int = 1) -> Addresses:
        return cls(tempfile.mkdtemp(prefix="graphplan-"), frontends, engines)

    @property
    def engine(self) -> str:
        return f"ipc://{self.directory}/engine"

    def engine_at(self, d: int) -> str:
        """Engine ``d``'s inbox (engine 0's is ``engine``)."""
        return self.engine if d == 0 else f"ipc://{self.directory}/engine-{d}"

    def frontend(self, i: int) -> str:
        return f"ipc://{self.directory}/frontend-{i}"

    def remove(self) -> None:
        for name in os.listdir(self.directory):
            try:
                os.unlink(os.path.join(self.directory, name))
            except OSError:
                pass
        try:
            os.rmdir(self.directory)
        except OSError:
            pass


def spawn(target, *args, name: str) -> Any:
    """A child process by spawn (a fresh interpreter: no CUDA state or threads inherited)."""
    p = mp.get_context("spawn").Process(target=target, args=args, name=name, daemon=False)
    p.start()
    return p


def end(p: Any, timeout: float) -> None:
    """Wait for ``p`` to exit, then SIGTERM it, then SIGKILL it: no child outlives the server."""
    p.join(timeout)
    if p.is_alive():
        p.terminate()
        p.join(2)
    if p.is_alive():
        p.kill()
        p.join(2)
