"""LoRA adapters on the OpenAI API (vLLM's spelling): a request's ``model`` names the base model or
an adapter, ``/v1/models`` lists the adapters (``parent``: the base model), and
``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` with ``{"lora_name": ...,
"lora_path": ...}`` load and unload them at run time, behind the admin token (``security.py``:
``ADMIN_PATHS``). The engine holds the adapters (server/core/lora_serving.py); this front end keeps
the names it knows (started with, or loaded through it) for routing and listing."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from typing_extensions import Annotated

from ..errors import APIError
from .http_io import read_body
from .openai_protocol import Body, parse

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
Name = Annotated[str, Field(min_length=1, max_length=256, strict=True)]


class LoadBody(Body):
    lora_name: Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096, strict=True)]


class UnloadBody(Body):
    lora_name: Name
    lora_int_id: int | None = None  # vLLM's, unused


class LoraRoutes:
    """The adapter names one front end serves, and the two admin routes."""

    def __init__(self, api: Any, modules):
        self.api = api
        self.names: dict[str, None] = dict.fromkeys(n for n, _ in modules)  # in load order

    def add_routes(self, r: APIRouter) -> None:
        r.add_api_route(LOAD, self.load, methods=["POST"])
        r.add_api_route(UNLOAD, self.unload, methods=["POST"])

    def lora_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); APIError 404 for a
        name this server does not serve."""
        if model == self.api.model_name:
            return None
        if model in self.names:
            return model
        served = ", ".join(repr(n) for n in (self.api.model_name, *self.names))
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {served}",
            "model",
            "model_not_found",
        )

    async def load(self, request: HTTPRequest) -> Response:
        body = parse(LoadBody, await self._body(request))
        if body.lora_name == self.api.model_name:
            raise APIError(400, "lora_name is the base model's name; choose another", "lora_name")
        await run_in_threadpool(self.api.engine.load_lora, body.lora_name, body.lora_path)
        self.names[body.lora_name] = None
        return _text(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, request: HTTPRequest) -> Response:
        body = parse(UnloadBody, await self._body(request))
        await run_in_threadpool(self.api.engine.unload_lora, body.lora_name)
        self.names.pop(body.lora_name, None)
        return _text(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _body(self, request: HTTPRequest) -> bytes:
        s = self.api.server
        return await read_body(request, s.max_body_bytes, s.idle_timeout)


def _text(message: str) -> Response:
    return Response(message, 200, media_type="text/plain")
