"""Server load test (issue 6): N concurrent clients x M requests each against graphplan's server on
127.0.0.1, once with the plan's graphs and once eager (the same plan with cudagraph.mode=NONE), on
the same random workload. Every response is checked against offline greedy decoding of its prompt
alone (reference_generate); a lost or wrong response fails the run (exit 1).

    python bench/server_load.py --device cpu --out bench/results/server_load_cpu.md
    python bench/server_load.py --device cuda --clients 32 --requests 16 \\
        --out bench/results/server_load_h100.md

Bounded: at most clients x requests requests per mode, none sent after --time-limit seconds. The
server runs as a subprocess (python -m graphplan.server), so clients and server do not share a GIL.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import queue
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from itertools import zip_longest
from pathlib import Path

import torch

from graphplan.models.tiny_llama import reference_generate
from graphplan.server import ModelSpec, build_model, load_table
from graphplan.server.core.model import parse_sets

ROOT = Path(__file__).resolve().parents[1]


def workload(a, vocab: int) -> list[list[tuple[list[int], int, bool]]]:
    """Per client: (prompt, max_tokens, stream) for each of its requests."""
    rng = random.Random(a.seed)
    return [
        [
            (
                [rng.randrange(vocab) for _ in range(rng.randint(1, a.prompt_len))],
                rng.randint(max(1, a.max_tokens // 4), a.max_tokens),
                rng.random() < a.stream_fraction,
            )
            for _ in range(a.requests)
        ]
        for _ in range(a.clients)
    ]


def start_server(a, spec: ModelSpec, sets: list[str], log_path: Path):
    cmd = [
        sys.executable,
        "-m",
        "graphplan.server",
        "--plan",
        a.plan,
        "--port",
        "0",
        "--device",
        a.device,
        "--no-progress",
        "--layers",
        str(spec.layers),
        "--hidden",
        str(spec.hidden),
        "--vocab-size",
        str(spec.vocab_size),
        "--max-model-len",
        str(spec.max_model_len),
        "--dtype",
        spec.dtype,
        "--seed",
        str(spec.seed),
    ]
    for s in sets:
        cmd += ["--set", s]
    return run_server(cmd, log_path, a.startup_timeout)


def run_server(cmd: list[str], log_path: Path, startup_timeout: float):
    """Start ``python -m graphplan.server ...`` (``cmd``) from the repo root on port 0; returns
    (process, port) once /healthz answers 200. Its log goes to ``log_path``."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    log = open(log_path, "w")

    def pump():  # keep draining the server's log so it never blocks on a full pipe
        for line in proc.stderr:
            log.write(line)
            log.flush()
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            while time.monotonic() < deadline:
                if get(port, "/healthz")[0] == 200:
                    return proc, port
                time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"server did not become ready; its log: {log_path}")


def get(port: int, path: str):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    except OSError:
        return 0, ""
    finally:
        conn.close()


def post_generate(conn, prompt, max_tokens, stream) -> list[int]:
    conn.request(
        "POST",
        "/generate",
        json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": stream}),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    text = r.read().decode()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {text.strip()}")
    if not stream:
        return json.loads(text)["tokens"]
    lines = [json.loads(x) for x in text.splitlines()]
    streamed = [x["token"] for x in lines if "token" in x]
    final = lines[-1]
    if not final.get("done") or final["tokens"] != streamed:
        raise RuntimeError(f"bad stream ending {final}")
    return streamed


def run_clients(port, work, expected, deadline) -> dict:
    res = {"lat": [], "tokens": 0, "ok": 0, "lost": [], "wrong": [], "not_sent": 0}
    lock = threading.Lock()

    def client(c):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        for i, (prompt, n, stream) in enumerate(work[c]):
            if time.monotonic() > deadline:
                with lock:
                    res["not_sent"] += len(work[c]) - i
                break
            t0 = time.perf_counter()
            try:
                out = post_generate(conn, prompt, n, stream)
            except Exception as e:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                with lock:
                    res["lost"].append(f"client {c} request {i}: {type(e).__name__}: {e}")
                continue
            dt = time.perf_counter() - t0
            with lock:
                res["lat"].append(dt)
                res["tokens"] += len(out)
                if expected is None or out == expected[c][i]:
                    res["ok"] += 1
                else:
                    res["wrong"].append((c, i, out))
        conn.close()

    res["seconds"] = run_threads(client, len(work))
    return res


def run_threads(client, n: int) -> float:
    """``client(c)`` for c in range(n), each on its own thread, all at once; wall seconds."""
    threads = [threading.Thread(target=client, args=(c,)) for c in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def scrape(port: int) -> dict:
    _, text = get(port, "/metrics")

    def total(name):
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    steps = total("graphplan_server_step_seconds_count")
    return {
        "replays": int(total("graphplan_graph_replays_total")),
        "eager": int(total("graphplan_eager_steps_total")),
        "padding": int(total("graphplan_graph_padding_tokens_total")),
        "tokens": int(total("graphplan_server_step_tokens_total")),
        "steps": int(steps),
        "step_s": total("graphplan_server_step_seconds_sum"),
        "graphs": int(total("graphplan_captured_graphs")),
    }


@torch.no_grad()
def diverges(model, prompt, got, want) -> str:
    """Where a wrong answer departs from the reference, and the reference logit gap there: a gap
    near zero is a numerical near-tie (kernels that round differently per batch size), a large
    one is a bug."""
    i = next(k for k, (a, b) in enumerate(zip_longest(got, want)) if a != b)
    if i >= min(len(got), len(want)):
        return f"{len(got)} tokens, expected {len(want)}"
    from graphplan.models.tiny_llama import make_batch

    logits = model(**make_batch(model, [(0, 0, prompt + want[:i])]))[-1]
    gap = float(logits[want[i]] - logits[got[i]])
    return f"token {i}: got {got[i]}, expected {want[i]}; reference logit gap {gap:.2e}"


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))] if xs else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="plans/tiny-llama.yaml")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=8, help="per client")
    p.add_argument("--prompt-len", type=int, default=32, help="prompts have 1..this many tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens in [this / 4, this]")
    p.add_argument("--stream-fraction", type=float, default=0.25)
    p.add_argument("--time-limit", type=float, default=300, help="seconds per mode")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--modes", default="graphs,eager")
    p.add_argument("--seed", type=int, default=0)
    d = ModelSpec()
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--out", help="also write the report (markdown) here")
    a = p.parse_args(argv)
    spec = ModelSpec(
        layers=a.layers,
        hidden=a.hidden,
        vocab_size=a.vocab_size,
        max_model_len=a.max_model_len,
        seed=a.seed,
        dtype=a.dtype,
    )
    table = load_table(a.plan)
    work = workload(a, spec.vocab_size)
    t0 = time.perf_counter()
    model = build_model(spec, table, a.device)  # the server's weights, built the same way
    expected = [[reference_generate(model, [pr], n)[0] for pr, n, _ in reqs] for reqs in work]
    ref_s = time.perf_counter() - t0
    modes = {"graphs": [], "eager": ["cudagraph.mode=NONE"]}
    parse_sets(modes["eager"])
    rows, failed = [], False
    logs = Path(a.out).with_suffix("") if a.out else Path("/tmp/server_load")
    for mode in a.modes.split(","):
        proc, port = start_server(a, spec, modes[mode], Path(f"{logs}.{mode}.log"))
        try:
            warm = [[(w[0][0][:4], 2, False)] for w in work]  # first-call costs out of the way
            run_clients(port, warm, None, time.monotonic() + 60)
            before = scrape(port)
            r = run_clients(port, work, expected, time.monotonic() + a.time_limit)
            after = scrape(port)
        finally:
            proc.terminate()
            rc = proc.wait(60)
        m = {
            k: after[k] - before[k]
            for k in ("replays", "eager", "padding", "tokens", "steps", "step_s")
        }
        steps = max(m["steps"], 1)
        rows.append(
            {
                "mode": mode,
                "sent": len(r["lat"]) + len(r["lost"]),
                "ok": r["ok"],
                "lost": len(r["lost"]),
                "wrong": len(r["wrong"]),
                "tok_s": r["tokens"] / r["seconds"],
                "req_s": len(r["lat"]) / r["seconds"],
                "p50": pct(r["lat"], 50) * 1e3,
                "p90": pct(r["lat"], 90) * 1e3,
                "p99": pct(r["lat"], 99) * 1e3,
                "graphs": after["graphs"],
                "replay_pct": 100 * m["replays"] / steps,
                "eager": m["eager"],
                "pad_pct": 100 * m["padding"] / max(m["padding"] + m["tokens"], 1),
                "step_ms": 1e3 * m["step_s"] / steps,
                "exit": rc,
                "not_sent": r["not_sent"],
            }
        )
        for msg in r["lost"][:5]:
            print(f"{mode}: lost {msg}", file=sys.stderr)
        for c, i, out in r["wrong"][:5]:
            why = diverges(model, work[c][i][0], out, expected[c][i])
            print(f"{mode}: wrong: client {c} request {i}: {why}", file=sys.stderr)
        failed |= bool(r["lost"] or r["wrong"] or rc != 0)
    print(report(a, argv, rows, ref_s))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(report(a, argv, rows, ref_s))
    return 1 if failed else 0


def report(a, argv, rows, ref_s) -> str:
    dev = (
        torch.cuda.get_device_name()
        if a.device.startswith("cuda")
        else (platform.processor() or platform.machine()) + f", {os.cpu_count()} CPUs"
    )
    cmd = "python bench/server_load.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    out = [
        f"# Server load test: {a.clients} clients x {a.requests} requests, graphs vs eager",
        "",
        f"- device: {dev}; torch {torch.__version__}; {datetime.date.today().isoformat()}",
        f"- command: `{cmd}`",
        f"- model: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab_size}, {a.dtype}; plan "
        f"{a.plan}; prompts 1..{a.prompt_len} tokens, max_tokens {max(1, a.max_tokens // 4)}.."
        f"{a.max_tokens}, {a.stream_fraction:.0%} streamed",
        f"- every response compared with reference_generate of its prompt alone "
        f"({ref_s:.1f} s to compute)",
        "",
        "| mode | ok/sent | lost | wrong | tokens/s | req/s | p50 ms | p90 ms | p99 ms | "
        "graphs | steps replayed | eager steps | padding | mean step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['mode']} | {r['ok']}/{r['sent']} | {r['lost']} | {r['wrong']} | "
            f"{r['tok_s']:.0f} | {r['req_s']:.1f} | {r['p50']:.0f} | {r['p90']:.0f} | "
            f"{r['p99']:.0f} | {r['graphs']} | {r['replay_pct']:.0f}% | {r['eager']} | "
            f"{r['pad_pct']:.0f}% | {r['step_ms']:.2f} |"
        )
    by = {r["mode"]: r for r in rows}
    if "graphs" in by and "eager" in by:
        g, e = by["graphs"], by["eager"]
        out += [
            "",
            f"graphs / eager: throughput x{g['tok_s'] / e['tok_s']:.2f}, "
            f"p50 latency x{g['p50'] / e['p50']:.2f}, "
            f"mean step x{g['step_ms'] / e['step_ms']:.2f}",
        ]
    if not a.device.startswith("cuda"):
        out.append(
            "On the CPU the runner replays its graph stand-in (it re-runs the recorded "
            "call), so the ratio checks the plumbing, not what CUDA graphs save."
        )
    if any(r["not_sent"] for r in rows):
        left = ", ".join(f"{r['mode']} {r['not_sent']}" for r in rows)
        out.append(f"not sent (time limit): {left}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
