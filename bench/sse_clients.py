"""Streaming OpenAI clients for the load benches (bench/load_test.py, bench/serve_overhead.py):
asyncio connections speaking HTTP/1.1 and server-sent events directly (standard library only), each
recording when every token arrived, plus the small /metrics and percentile helpers they share."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Result:
    kind: str
    max_tokens: int
    disconnect_after: int | None
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    status: int = 0
    error: str = ""

    @property
    def cancelled(self) -> bool:
        return self.disconnect_after is not None


async def stream_one(port: int, spec: dict) -> Result:
    res = Result(spec["kind"], spec["body"]["max_tokens"], spec["disconnect_after"])
    data = json.dumps(spec["body"]).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    try:
        res.sent = time.perf_counter()
        writer.write(head + data)
        await writer.drain()
        res.status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            chunked |= line.lower().startswith(b"transfer-encoding: chunked")
        if res.status != 200 or not chunked:
            res.error = (await reader.read(2000)).decode(errors="replace")
            return res
        buf = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            buf += (await reader.readexactly(size + 2))[:-2]
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                payload = ev.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    res.done = True
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    res.error = obj["error"]["message"]
                    continue
                now = time.perf_counter()
                for ch in obj["choices"]:
                    res.token_times += [now] * len(ch.get("token_ids") or [])
                    res.finish_reason = ch.get("finish_reason") or res.finish_reason
            if res.cancelled and len(res.token_times) >= res.disconnect_after:
                return res  # hang up mid-stream
    except (ConnectionError, asyncio.IncompleteReadError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        writer.close()
    return res


async def run_clients(port: int, work) -> list[Result]:
    async def client(reqs):
        return [await stream_one(port, spec) for spec in reqs]

    per_client = await asyncio.gather(*(client(reqs) for reqs in work))
    return [r for rs in per_client for r in rs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def metric(text: str, name: str, labels: str = "") -> float:
    pat = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    m = re.search(pat, text, re.M)
    return float(m.group(1)) if m else 0.0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]
