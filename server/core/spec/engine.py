"""How the engine (server/core/engine.py) takes speculative decoding on: its batcher and step, and
the check that a reloaded plan still routes the config's uniform decode steps."""

from __future__ import annotations

from typing import Any

from ...errors import RequestError
from .batcher import SpecBatcher
from .config import SpeculativeConfig, SpeculativeConfigError, check_plan
from .step import SpecStep


def speculates(request: Any) -> bool:
    """Whether a request carries drafts: not when it is penalised (a penalty at draft position j
    would need the drafts before j in its history; it decodes one token a step instead)."""
    params = getattr(request, "params", None)
    return params is None or not params.penalised


def spec_batcher(engine: Any, batcher_kw: dict) -> tuple[SpecBatcher, SpecStep]:
    config: SpeculativeConfig = engine.speculative
    batcher = SpecBatcher(proposer=engine.proposer, speculates=speculates, **batcher_kw)
    return batcher, SpecStep(engine, config.k)


def check_reload(config: SpeculativeConfig, table: Any, metrics: Any) -> None:
    """A reload to a plan whose decode_query_len is not 1 + k is refused (422)."""
    try:
        check_plan(config, table.q, f"plan {table.settings.name!r}")
    except SpeculativeConfigError as e:
        metrics.reload("rejected")
        raise RequestError(422, f"plan rejected: {e}") from None
