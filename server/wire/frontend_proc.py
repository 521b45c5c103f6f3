"""An extra front end process (``graphplan-serve --api-server-count N``, N > 1): the same HTTP app
as the first front end, accepting on the same listening socket (inherited), talking to the one
engine process through its own ``EngineClient``. It follows the engine: it ends once the engine
says it stopped or failed (the supervisor says so when the engine process dies), and with the
server process (parent-death signal). Signals are the supervisor's to handle."""

from __future__ import annotations

import logging
import os
import signal
import socket
from dataclasses import dataclass
from typing import Any

from .procs import Addresses, die_with_parent


@dataclass(frozen=True, kw_only=True, slots=True)
class FrontendConfig:
    server: dict
    """Server(...)'s keyword arguments for the HTTP side (source, spec, limits, admin token)."""
    index: int
    addresses: Addresses
    server_class: Any
    """frontend/app.py's Server, passed by the first front end (pickled by reference) rather than
    imported here: the front end starts this module's processes."""


def frontend_main(config: FrontendConfig, sock: socket.socket) -> None:
    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    kw = dict(config.server)
    logging.basicConfig(
        level=kw["log_level"],
        format=f"%(asctime)s %(levelname)s %(name)s[api-{config.index}]: %(message)s",
    )
    server = config.server_class(frontend=(config.index, config.addresses, sock), **kw)
    server.start()
    client = server.engine
    client.stopped.wait()
    server.stop()
    client.close()
    logging.shutdown()
    os._exit(0 if client.state == "stopped" else 1)
