"""A plan swap (``/admin/reload``, SIGHUP): the new table is loaded and checked on the caller's
thread, captured on the engine thread between steps, and switched in once the running requests fit
its seats (server/core/engine.py). The old table keeps serving whenever anything fails."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from graphplan.compiler.errors import GraphplanError
from graphplan.runtime import GraphRunner

from ..errors import RequestError
from .model import check_fits, load_table

log = logging.getLogger("graphplan.server")


@dataclass(eq=False, slots=True)
class Swap:
    table: Any
    source: str
    overrides: dict | None
    done: threading.Event = field(default_factory=threading.Event)
    runner: GraphRunner | None = None  # captured, waiting for the running requests to fit
    result: dict | None = None
    error: BaseException | None = None


def checked_table(source: str, overrides: dict | None, model: Any, serving: str, metrics: Any):
    """The new table, or RequestError 422 naming what is wrong (the plan's or table's fault)."""
    try:
        table = load_table(source, overrides)
        check_fits(table, model)
    except (GraphplanError, RecursionError, ValueError) as e:
        metrics.reload("rejected")
        raise RequestError(422, f"plan rejected, still serving {serving[:19]}: {e}") from None
    return table


def wait_for_swap(
    swap: Swap, engine_thread: threading.Thread, timeout: float, serving: str, metrics: Any
) -> dict:
    """Wait for the engine thread to capture and switch; the reload's answer or RequestError."""
    deadline = time.monotonic() + timeout
    while not swap.done.wait(0.05):
        if not engine_thread.is_alive():
            raise RequestError(503, "server is shutting down; the reload was dropped")
        if time.monotonic() > deadline:
            raise RequestError(504, f"the reload did not finish in {timeout} s")
    if swap.error is not None:
        metrics.reload("failed")
        e = swap.error
        status = 422 if isinstance(e, GraphplanError) else 500
        raise RequestError(
            status, f"capture failed, still serving {serving[:19]}: {type(e).__name__}: {e}"
        )
    metrics.reload("ok")
    assert swap.result is not None
    return swap.result


def swap_result(swap: Swap, previous: str) -> dict:
    assert swap.runner is not None
    cap = swap.runner.stats()["capture"]
    return {
        "fingerprint": swap.table.fingerprint,
        "previous": previous,
        "plan": swap.table.settings.name,
        "unchanged": False,
        "capture": {
            "graphs": cap.get("graphs", 0),
            "seconds": round(cap.get("seconds", 0.0), 4),
        },
    }


def capture_runner(model, table, device, progress: bool, compiled, on_demand) -> GraphRunner:
    """A runner of ``table`` over the model, its graphs captured (the start-up plan's, or a
    swap's, on the engine thread)."""
    runner = GraphRunner(
        model,
        table,
        model.static_inputs(),
        device=device,
        progress=progress,
        compile=compiled,
        on_demand=on_demand,
    )
    log.info(
        "capturing %d graphs%s of plan %r (fingerprint %s) on %s",
        len(table.graphs),
        " on demand (the start set now, the rest on first use)" if runner.on_demand else "",
        table.settings.name,
        table.fingerprint[:19],
        device,
    )
    runner.capture()
    return runner
