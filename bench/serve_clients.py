"""bench/serve_bench.py's client processes: one Python client saturates before the server does, so
the requests are spread over several processes, each an asyncio loop streaming its share of
``/v1/completions`` with raw httpx or the official ``openai`` client.

A child reads one JSON line on stdin (``url``, ``model``, ``client``, its ``requests``: index,
send offset in seconds, body), builds its client, prints ``ready``, then reads the start time (a
``time.monotonic()`` value: one clock for every process of the host) and sends each request at
start + offset. For each request it records the send time, each chunk's arrival time and token
count (``token_ids``: a chunk may carry several), the finish reason, whether the stream ended
(``data: [DONE]``), the HTTP status and any error; and for itself the CPU seconds (user + system,
``os.times``) and wall seconds from the start to its last answer. It prints them as one JSON line.

    python bench/serve_clients.py < config.json   # (the parent, ``run``, writes the config)
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TIMEOUT_S = 3600.0  # one request of a long run waits for its seat; a stuck server still ends


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def new_record(index: int) -> dict:
    return {"i": index, "sent": 0.0, "chunks": [], "finish": None, "done": False,
            "status": 0, "error": ""}  # fmt: skip


def note_chunk(rec: dict, obj: dict, now: float) -> None:
    """One streamed completion object: its tokens (with their arrival time) or its error."""
    if "error" in obj:
        rec["error"] = str(obj["error"].get("message", obj["error"]))
        return
    for choice in obj.get("choices") or []:
        k = len(choice.get("token_ids") or [])
        if k:
            rec["chunks"].append([now, k])
        rec["finish"] = choice.get("finish_reason") or rec["finish"]


async def stream_httpx(client, url: str, body: dict, rec: dict) -> None:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        rec["status"] = r.status_code
        if r.status_code != 200:
            rec["error"] = (await r.aread()).decode(errors="replace")[:500]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                rec["done"] = True
            else:
                note_chunk(rec, json.loads(payload), time.monotonic())


async def stream_openai(client, url: str, body: dict, rec: dict) -> None:
    import openai

    extra = {k: body[k] for k in ("ignore_eos",)}
    try:
        stream = await client.completions.create(
            model=body["model"],
            prompt=body["prompt"],
            max_tokens=body["max_tokens"],
            temperature=body["temperature"],
            stream=True,
            extra_body=extra,
        )
        rec["status"] = 200
        async for chunk in stream:
            note_chunk(rec, chunk.model_dump(), time.monotonic())
        rec["done"] = True  # the SDK ends the iteration at data: [DONE]
    except openai.APIStatusError as e:
        rec["status"], rec["error"] = e.status_code, str(e)[:500]


def make_client(kind: str, url: str):
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(TIMEOUT_S))
    if kind == "httpx":
        return http
    import openai

    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S, http_client=http
    )


async def one(client, stream, cfg: dict, req: dict, start: float) -> dict:
    rec = new_record(req["i"])
    await asyncio.sleep(max(0.0, start + req["offset"] - time.monotonic()))
    rec["sent"] = time.monotonic()
    try:
        await stream(client, cfg["url"], req["body"], rec)
    except Exception as e:  # a broken connection is the request's failure, not the run's
        rec["error"] = rec["error"] or f"{type(e).__name__}: {e}"
    return rec


async def session(cfg: dict) -> dict:
    client = make_client(cfg["client"], cfg["url"])
    stream = stream_httpx if cfg["client"] == "httpx" else stream_openai
    print("ready", flush=True)
    start = float(await asyncio.to_thread(sys.stdin.readline))
    cpu0 = cpu_seconds()
    results = await asyncio.gather(*(one(client, stream, cfg, r, start) for r in cfg["requests"]))
    wall = time.monotonic() - start
    cpu = cpu_seconds() - cpu0
    await (client.aclose() if cfg["client"] == "httpx" else client.close())
    return {"cpu_s": cpu, "wall_s": wall, "results": results}


def run(cfg: dict, shares: list[list[dict]], logdir: Path) -> list[dict]:
    """The parent side: one child per share of requests, started together once all are ready;
    each child's JSON answer, in share order."""
    children = []
    for p, share in enumerate(shares):
        with open(logdir / f"client{p}.log", "w") as log:  # the child keeps its own handle
            child = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
        child.stdin.write(json.dumps({**cfg, "requests": share}) + "\n")
        child.stdin.flush()
        children.append(child)
    for p, child in enumerate(children):
        if child.stdout.readline().strip() != "ready":
            raise SystemExit(f"client {p} did not start: {(logdir / f'client{p}.log').read_text()}")
    start = time.monotonic() + 0.2  # every child past its stdin read before the first send
    for child in children:
        child.stdin.write(f"{start!r}\n")
        child.stdin.flush()
    outs = []
    for p, child in enumerate(children):
        out = child.stdout.read()
        if child.wait() != 0:
            raise SystemExit(f"client {p} failed: {(logdir / f'client{p}.log').read_text()}")
        outs.append(json.loads(out))
    return outs


if __name__ == "__main__":
    print(json.dumps(asyncio.run(session(json.loads(sys.stdin.readline())))))
