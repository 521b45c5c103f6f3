"""Serving LoRA adapters (issue 39): the plan's ``lora`` block against the command line
(``--lora-modules``, ``--max-loras``, ``--max-lora-rank``), adapters loaded at start and at run time
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, behind the admin token), and each request's
adapter checked when it is queued (a name the engine does not hold: 404, as for an unknown model).

The engine holds the adapters (``PagedCausalLM.lora``, models/hf/lora_slots.py); a request carries
its adapter's name (``Request.lora``, set from its ``model``), the batcher admits at most
``max_loras`` distinct adapters among running requests, and every step binds its seats to their
adapters' slots (``pipeline.lora_step``). An adapter is unloaded only while no queued or running
request uses it (409 otherwise: nothing is lost, the client retries once they finish).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from graphplan.compiler.errors import GraphplanError

from ..errors import RequestError, not_serving

DEFAULT_MAX_RANK = 16
"""vLLM's default --max-lora-rank."""
_lock = threading.Lock()  # one load or unload at a time


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The slots a served model gets: from the plan's ``lora`` block and the command line."""

    max_loras: int
    max_rank: int


def plan_max_loras(table) -> int | None:
    """The plan's ``lora.max_loras`` (None: LoRA off): the table's cases cover counts
    ``0..max_loras + 1``."""
    s = table.settings
    return len(s.lora_case_of_count) - 2 if s.lora_enabled else None


def settings(table, modules, max_loras: int | None, max_rank: int | None) -> LoraSettings | None:
    """LoRA slots for ``table``'s plan, or None when it has LoRA off; a GraphplanError naming
    the flag and the plan field when they disagree."""
    top = plan_max_loras(table)
    if top is None:
        if modules or max_loras:
            flag = "--lora-modules" if modules else "--max-loras"
            raise GraphplanError(
                f"{flag}: the plan {table.settings.name!r} has lora.enabled false, so its graphs "
                "carry no LoRA kernels; set lora.enabled: true in the plan (or --set "
                "lora.enabled=true), or drop the flag"
            )
        return None
    if max_loras is not None and max_loras > top:
        raise GraphplanError(
            f"--max-loras {max_loras} is above the plan's lora.max_loras {top}: its graphs route "
            f"batches of at most {top} adapters; raise lora.max_loras in the plan (or --set "
            f"lora.max_loras={max_loras}), or lower --max-loras"
        )
    if len({n for n, _ in modules}) != len(modules):
        raise GraphplanError("--lora-modules: a name is given twice")
    return LoraSettings(max_loras or top, max_rank or DEFAULT_MAX_RANK)


def parse_module(text: str) -> tuple[str, str]:
    """``name=path`` (vLLM's ``--lora-modules`` spelling) -> (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"{text!r}: expected name=path (a PEFT adapter directory)")
    return name, path


class LoraMethods:
    """The engine's adapter calls (``Engine`` inherits them; its thread and lock are its own)."""

    def load_lora(self, name: str, path: str) -> dict:
        """/v1/load_lora_adapter."""
        if self.state != "ready":  # type: ignore[attr-defined]
            raise not_serving(self.state)  # type: ignore[attr-defined]
        return load(self.model, name, path)  # type: ignore[attr-defined]

    def unload_lora(self, name: str) -> dict:
        """/v1/unload_lora_adapter: 409 while a queued or running request uses the adapter."""
        with self._cond:  # type: ignore[attr-defined]  # enqueue holds it: none joins meanwhile
            if self.state != "ready":  # type: ignore[attr-defined]
                raise not_serving(self.state)  # type: ignore[attr-defined]
            live = (*self._waiting, *self._live)  # type: ignore[attr-defined]
            users = sum(r.lora == name for r in live if not r.finished)
            return unload(self.model, name, users)  # type: ignore[attr-defined]


def max_loras(model) -> int:
    """The batcher's limit of distinct running adapters: the model's slots (0: no LoRA)."""
    lora = getattr(model, "lora", None)
    return 0 if lora is None else lora.slots.max_loras


def check_requests(model, reqs) -> None:
    """RequestError 404 for a request whose adapter the engine does not hold."""
    names = {r.lora for r in reqs if r.lora is not None}
    if not names:
        return
    held = getattr(getattr(model, "lora", None), "adapters", {})
    missing = sorted(n for n in names if n not in held)
    if missing:
        raise RequestError(
            404,
            f"model {missing[0]!r} does not exist (no LoRA adapter of that name is loaded)",
            "model",
            "model_not_found",
        )


def load(model, name: str, path: str) -> dict:
    """Read the PEFT directory ``path`` as adapter ``name`` (RequestError 400 naming the file
    and the fix when it is refused; 409 when the name is taken)."""
    from graphplan.models.hf.lora import read_adapter

    lora = _lora(model)
    with _lock:
        if name in lora.adapters:
            raise RequestError(
                409, f"LoRA adapter {name!r} is already loaded; unload it first", "lora_name"
            )
        try:
            adapter = read_adapter(
                name,
                path,
                model.hf.config,
                max_rank=lora.slots.max_rank,
                dtype=model.fused.embed.dtype,
            )
        except GraphplanError as e:
            raise RequestError(400, str(e), "lora_path") from None
        with lora.lock:
            lora.add(adapter)
    return {"lora_name": name, "rank": adapter.rank, "modules": list(adapter.modules)}


def unload(model, name: str, users: int) -> dict:
    """Forget adapter ``name``; ``users``: queued and running requests of it (409 unless 0)."""
    lora = _lora(model)
    with _lock:
        if name not in lora.adapters:
            raise RequestError(404, f"LoRA adapter {name!r} is not loaded", "lora_name")
        if users:
            raise RequestError(
                409,
                f"LoRA adapter {name!r} is in use by {users} queued or running request(s); "
                "unload it once they finish",
                "lora_name",
            )
        with lora.lock:
            lora.remove(name)
    return {"lora_name": name}


def _lora(model):
    lora = getattr(model, "lora", None)
    if lora is None:
        raise RequestError(
            400,
            "LoRA is off on this server: serve a plan with lora.enabled true and --model",
        )
    return lora
