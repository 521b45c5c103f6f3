"""A graphplan server over a checkpoint saved with save_pretrained, for the tests that drive the
OpenAI API with the official client (each module starts its own, with its own plan)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai

from graphplan.server import Server
from graphplan.server.core.hf_model import HFSpec


def with_chat_template(path: Path, template: str) -> Path:
    """Put ``template`` in the checkpoint's tokenizer_config.json (its ``chat_template``)."""
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def start_server(tmp_path_factory, model_dir: Path, plan: str, max_model_len: int, **kw) -> Server:
    """The server of ``model_dir`` under the plan text ``plan``, started and ready (``kw``: more
    ``Server`` arguments); the caller stops it."""
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    path.write_text(plan)
    spec = HFSpec(model=str(model_dir), max_model_len=max_model_len)
    s = Server(path, spec=spec, progress=False, **kw).start()
    assert s.wait_ready(60), s.engine.error
    return s


def openai_client(server: Server, kind=openai.OpenAI):
    """The official client (``kind``: ``openai.OpenAI`` or ``openai.AsyncOpenAI``) of ``server``,
    without retries."""
    return kind(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
