"""The engine's steps without HTTP, for bench/serve_overhead.py's ``+engine`` variants: an
``Engine`` (the server's engine thread: scheduler, batch build, runner, sampler, pipeline) in this
process over the same model, plan and requests as the served variants, its tokens read from a
``QueueSink`` on the main thread, each stamped when it arrives. The gap between a served variant
and its ``+engine`` twin is what HTTP and the event loop add (formatting, sockets, the GIL).

Run as a child process (the parent keeps the GPU free for its replay model afterwards):

    echo '{"shape": "8b", "device": "cuda", "clients": 64, ...}' | python bench/engine_steps.py

prints one JSON line: ``{"startup": s, "results": [{"token_times": [...], "error": ""}, ...],
"async_steps": n}`` (steps launched before the previous one's read).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from graphplan.server import Engine
from graphplan.server.core.hf_model import HFSpec
from graphplan.server.core.model import load_table, parse_sets
from graphplan.server.requests import QueueSink, Request
from graphplan.server.sampling_params import SamplingParams

import load_test


@dataclass
class Timed:
    """What serve_overhead.steady_gaps reads of a client's result."""

    token_times: list[float] = field(default_factory=list)
    error: str = ""


def params(body: dict) -> SamplingParams:
    """The request body's sampling (load_test.request_body: greedy, or T 0.8, top_p 0.95, seeded)."""
    keys = ("temperature", "top_p", "seed")
    return SamplingParams(**{k: body[k] for k in keys if k in body}, max_tokens=body["max_tokens"])


def run(cfg: dict) -> dict:
    """Start the engine, send every body of ``cfg["bodies"]`` at once, stamp each token."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = load_test.write_model(Path(tmp) / "m", cfg["shape"], cfg["max_model_len"])
        sets = load_test.PLAN_SETS[cfg["shape"]] + cfg["set"]
        table = load_table(cfg["plan"], parse_sets(sets))
        spec = HFSpec(model=str(model_dir), max_model_len=cfg["max_model_len"], random_weights=True)
        t0 = time.monotonic()
        engine = Engine(
            table,
            cfg["plan"],
            spec=spec,
            device=cfg["device"],
            progress=False,
            async_scheduling=cfg["async_scheduling"],
            fused_sampler=cfg["fused_sampler"],
        )
        engine.start()
        if not engine.wait_ready(cfg["startup_timeout"]):
            raise SystemExit(f"engine_steps: the engine did not start: {engine.error}")
        startup = time.monotonic() - t0
        sink = QueueSink()
        bodies = cfg["bodies"]
        out = [Timed() for _ in bodies]
        reqs = [
            Request(list(b["prompt"]), b["max_tokens"], sink, params(b), tag=i)
            for i, b in enumerate(bodies)
        ]
        engine.enqueue(reqs)
        left = len(reqs)
        try:
            while left:
                tag, kind, value = sink.get(120)
                if kind == "token":
                    out[tag].token_times.append(time.perf_counter())
                elif kind == "error":
                    out[tag].error = str(value)
                    left -= 1
                elif kind == "done":
                    left -= 1
            async_steps = engine.pipeline.speculated
        finally:
            engine.stop(5)
    return {"startup": startup, "results": [vars(t) for t in out], "async_steps": async_steps}


if __name__ == "__main__":
    # the config comes on stdin: 64 bodies of 1024 tokens are too long for an argument
    print(json.dumps(run(json.loads(sys.stdin.read()))))
