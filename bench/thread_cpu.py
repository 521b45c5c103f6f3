"""CPU time per streamed token of graphplan-serve's two threads, the HTTP event loop
(``graphplan-http``: parsing, the OpenAI chunks, the sockets) and the engine (``graphplan-engine``:
scheduling, the model's step, sampling), read from the kernel's per-thread counters
(``/proc/self/task/<tid>/stat``, Linux; no profiler in the way), for an in-process server over the
tiny Llama shape (random weights) and ``--clients`` streaming clients of ``--tokens`` tokens each.
Both threads share the GIL: their Python time per step bounds how fast a step can follow the last.

    python bench/thread_cpu.py --device cpu --clients 64 --rounds 3 --out bench/results/thread_cpu.md

The counters tick at the kernel's clock rate (usually 100 Hz): a round's figure is good to
10 ms / (clients x tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import shlex
import sys
import tempfile
import threading
from pathlib import Path

import torch

from graphplan.server import Server
from graphplan.server.core.hf_model import HFSpec

import load_test
from machine import machine
from sse_clients import stream_one
from timing import publish

THREADS = ("graphplan-http", "graphplan-engine")
ROOT = Path(__file__).resolve().parents[1]


def thread_cpu_seconds(native_id: int) -> float:
    """User + system CPU seconds of one thread of this process."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if min(a.clients, a.tokens, a.rounds) < 1:
        p.error("--clients, --tokens and --rounds must be at least 1")
    if not Path("/proc/self/task").is_dir():
        p.error("needs Linux's /proc/self/task (per-thread CPU counters)")
    return a


def measure(a) -> list[dict[str, float]]:
    """Per round, microseconds of CPU per streamed token of each thread."""
    max_len = 8 + a.tokens + 8
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = load_test.write_model(Path(tmp) / "m", "tiny", max_len)
        spec = HFSpec(
            model=str(model_dir),
            max_model_len=max_len,
            random_weights=True,
            served_model_name="load",
        )
        sets = {"scheduler": {"max_num_seqs": a.clients, "max_num_batched_tokens": 8 * a.clients}}
        server = Server(
            ROOT / "plans" / "hf-mixed.yaml",
            overrides=sets,
            spec=spec,
            device=a.device,
            progress=False,
            port=0,
        ).start()
        try:
            if not server.wait_ready(300):
                raise SystemExit(f"thread_cpu: the server did not start: {server.engine.error}")
            port = server.address[1]
            ids = {t.name: t.native_id for t in threading.enumerate() if t.name in THREADS}
            rng = random.Random(0)
            rounds = []
            for _ in range(a.rounds):
                work = [
                    {
                        "body": load_test.request_body(
                            [rng.randrange(1, 500) for _ in range(8)], a.tokens
                        ),
                        "disconnect_after": None,
                        "kind": "steady",
                    }
                    for _ in range(a.clients)
                ]
                before = {n: thread_cpu_seconds(i) for n, i in ids.items()}
                results = asyncio.run(_all(port, work))
                bad = [r for r in results if r.error or len(r.token_times) != a.tokens]
                if bad:
                    raise SystemExit(f"thread_cpu: {len(bad)} requests failed: {bad[0]}")
                streamed = a.clients * a.tokens
                rounds.append(
                    {
                        n: (thread_cpu_seconds(i) - before[n]) / streamed * 1e6
                        for n, i in ids.items()
                    }
                )
            return rounds
        finally:
            server.stop()


async def _all(port: int, work: list[dict]):
    return await asyncio.gather(*(stream_one(port, w) for w in work))


def main(argv=None) -> int:
    a = parse_args(argv)
    rounds = measure(a)
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else machine()
    lines = [
        f"## thread_cpu: {a.clients} streaming clients x {a.tokens} tokens, {a.device}",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {where}, torch "
        f"{torch.__version__}, python {platform.python_version()}; "
        f"`python bench/thread_cpu.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "| round | " + " | ".join(f"{n} us/token" for n in THREADS) + " |",
        "|---|" + "---|" * len(THREADS),
    ]
    for k, r in enumerate(rounds, 1):
        lines.append(f"| {k} | " + " | ".join(f"{r[n]:.1f}" for n in THREADS) + " |")
    publish("\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
