"""The loop on graphplan's own server (issue 28): serve a chat-like workload, read the server's
``/metrics``, tune the capture sizes on it, hot-swap the tuned plan, serve the same workload again,
and compare padded tokens per step before and after.

    python examples/tune_loop.py                      # the tiny Llama on the CPU (10 s on an idle 2-core machine)
    python examples/tune_loop.py --device cuda --out tune_loop.md --json tune_loop.json

Only the public surface is used: ``graphplan-serve`` (``python -m graphplan.server``) and ``plan``
(``python -m graphplan.compiler.cli``) as subprocesses, and HTTP (``/generate``, ``/metrics``,
``/admin/reload``). The steps:

1. copy the plan (default ``plans/tiny-llama.yaml``: the server's default sizes, vLLM's list) into
   a temporary reload directory and serve it, with an admin token (``GRAPHPLAN_ADMIN_TOKEN``);
2. scrape ``/metrics``, send the workload, scrape again;
3. ``plan workload --from-metrics before.prom after.prom -o w.jsonl``;
4. ``plan optimize plan.yaml --trace w.jsonl --budget-graphs G -o tuned.yaml``, G = the default
   plan's graphs, so the tuned plan has no more;
5. ``POST /admin/reload {"path": tuned.yaml}``, then the same workload (same seed) and scrapes.

The workload (``--seed``): ``--requests`` requests, bursts of 25 (two arrivals an engine step)
alternating with quiet spells (one every four steps), prompt and output lengths log-uniform between
4 tokens and half the model's length (ShareGPT's are heavy-tailed toward short turns; scaled to the
model), end-of-sequence ignored, so the number of running requests, and with it the decode batch,
rises and falls. Arrivals are counted in engine steps (``graphplan_server_steps_total``, polled),
not seconds, so both runs see the same batches however fast the machine is. Padded tokens per step
= the increase of ``graphplan_graph_padding_tokens_total`` (all graphs, all plans) over that of
``graphplan_server_steps_total`` (all steps, eager ones included). Exit 1 when the drop is below
``--min-drop`` (default 0.30) or the tuned plan has more graphs than the default.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
PLAN = [sys.executable, "-m", "graphplan.compiler.cli"]
SERVE = [sys.executable, "-m", "graphplan.server"]
STEPS = re.compile(rb"^graphplan_server_steps_total\{[^}]*\} (\S+)$", re.M)


def http(url: str, body: dict | None = None, token: str = "", timeout: float = 120) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def workload(n: int, max_len: int, seed: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt ids, output tokens) per request: the same for the same seed. Bursts
    of 25 requests (2 a step) alternate with quiet spells (one every 4 steps)."""
    rng = random.Random(seed)
    top = max(4, max_len // 2)

    def length() -> int:
        return min(top, int(math.exp(rng.uniform(math.log(4), math.log(top + 1)))))

    at, out = 0.0, []
    for i in range(n):
        at += rng.expovariate(2.0 if (i // 25) % 2 == 0 else 0.25)
        prompt = [rng.randrange(1, 100) for _ in range(length())]
        out.append((int(at), prompt, length()))
    return out


def engine_steps(url: str) -> int:
    return int(sum(float(v) for v in STEPS.findall(http(url + "/metrics"))))


def drive(url: str, work: list[tuple[int, list[int], int]], poll: float = 0.01) -> float:
    """Send each request once the engine has run its arrival step (counted from the first
    request; an idle engine runs no steps, so the clock skips ahead to the next arrival):
    arrivals follow the engine's steps, not wall time, so the same workload gives the same
    batches on a fast or a slow (or busy) machine. Seconds until all finished."""
    t0, pending, running = time.monotonic(), list(work), []
    base = engine_steps(url) - work[0][0]

    def one(prompt: list[int], n: int) -> None:
        got = json.loads(http(url + "/generate", {"prompt": prompt, "max_tokens": n}))
        if len(got["tokens"]) != n:
            raise RuntimeError(f"asked for {n} tokens, got {got}")

    with ThreadPoolExecutor(len(work)) as pool:
        while pending or running:
            now = engine_steps(url)
            for f in [f for f in running if f.done()]:
                f.result()  # a failed request ends the run
                running.remove(f)
            if pending and not running and base + pending[0][0] > now:
                base = now - pending[0][0]  # idle: nothing would advance the clock
            while pending and base + pending[0][0] <= now:
                _, prompt, n = pending.pop(0)
                running.append(pool.submit(one, prompt, n))
            time.sleep(poll)
    return time.monotonic() - t0


def totals(text: str) -> dict[str, float]:
    """Sums over every series of the counters the comparison reads, also by graph mode (FULL:
    decode steps, PIECEWISE: mixed ones) and by step kind."""
    want = {
        "graphplan_graph_padding_tokens": ("padding", "mode"),
        "graphplan_server_steps": ("steps", "kind"),
        "graphplan_graph_replays": ("replays", ""),
        "graphplan_eager_steps": ("eager", ""),
        "graphplan_captured_graphs": ("graphs", ""),
    }
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        key, label = want.get(family.name, ("", ""))
        for sample in family.samples if key else ():
            if not sample.name.endswith("_created"):
                out[key] = out.get(key, 0.0) + sample.value
                if label:
                    part = f"{key}_{sample.labels[label].lower()}"
                    out[part] = out.get(part, 0.0) + sample.value
    return out


def window(before: str, after: str) -> dict:
    a, b = totals(before), totals(after)
    d = {k: int(v - a.get(k, 0.0)) for k, v in b.items() if k != "graphs"}
    d["graphs"] = int(b.get("graphs", 0))
    d["padding_per_step"] = d["padding"] / d["steps"] if d.get("steps") else 0.0
    return d


class Serving:
    """graphplan-serve in a subprocess; its log goes to a file (read for the port)."""

    def __init__(self, plan: Path, reload_dir: Path, device: str, token: str, log: Path):
        cmd = [*SERVE, "--plan", str(plan), "--port", "0", "--device", device, "--no-progress"]
        cmd += ["--reload-dir", str(reload_dir)]
        env = {**os.environ, "GRAPHPLAN_ADMIN_TOKEN": token}
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        self.port: int | None = None
        self._seen = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._seen.wait(120) or self.port is None:
            self.stop()
            raise SystemExit(f"tune_loop: the server did not start; see {log}")
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"tune_loop: the server never became ready; see {log}")
            time.sleep(0.1)

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.write(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._seen.set()
        self._seen.set()

    def _ready(self) -> bool:
        try:
            return json.loads(http(self.url + "/healthz", timeout=5))["status"] == "ready"
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()


def plan_cli(*args: str) -> str:
    r = subprocess.run([*PLAN, *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"tune_loop: plan {' '.join(args)} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


def graphs_of(plan: Path) -> int:
    return json.loads(plan_cli("compile", str(plan), "--format", "json"))["num_graphs"]


def table(before: dict, after: dict, drop: float) -> str:
    rows = [
        "| plan | steps (decode + mixed) | eager steps | padded tokens (decode + mixed) "
        "| padded tokens per step | graphs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, w in (("default sizes", before), ("tuned, hot-swapped", after)):
        steps = f"{w['steps']} ({w.get('steps_decode', 0)} + {w.get('steps_mixed', 0)})"
        pad = f"{w['padding']} ({w.get('padding_full', 0)} + {w.get('padding_piecewise', 0)})"
        rows.append(
            f"| {name} | {steps} | {w.get('eager', 0)} | {pad} | {w['padding_per_step']:.3f} "
            f"| {w['graphs']} |"
        )
    return "\n".join(rows) + f"\n\npadded tokens per step: {100 * drop:.1f} % fewer\n"


def run(a: argparse.Namespace, tmp: Path) -> dict:
    reload_dir = tmp / "plans"
    reload_dir.mkdir()
    plan = reload_dir / Path(a.plan).name
    shutil.copyfile(a.plan, plan)
    default_graphs = graphs_of(plan)
    token = secrets.token_urlsafe(24)
    server = Serving(plan, reload_dir, a.device, token, tmp / "server.log")
    try:
        url = server.url
        max_len = json.loads(http(url + "/v1/models"))["data"][0]["max_model_len"]
        work = workload(a.requests, max_len, a.seed)
        scrapes = [tmp / f"{i}.prom" for i in range(4)]
        scrapes[0].write_bytes(http(url + "/metrics"))
        seconds = [drive(url, work)]
        scrapes[1].write_bytes(http(url + "/metrics"))
        w = tmp / "w.jsonl"
        plan_cli("workload", "--from-metrics", str(scrapes[0]), str(scrapes[1]), "-o", str(w))
        tuned = reload_dir / "tuned.yaml"
        opt = plan_cli(
            "optimize",
            str(plan),
            "--trace",
            str(w),
            "--budget-graphs",
            str(default_graphs),
            "-o",
            str(tuned),
            "--format",
            "json",
        )
        swap = json.loads(http(url + "/admin/reload", {"path": str(tuned)}, token))
        scrapes[2].write_bytes(http(url + "/metrics"))
        seconds.append(drive(url, work))
        scrapes[3].write_bytes(http(url + "/metrics"))
    finally:
        server.stop()
    text = [p.read_text() for p in scrapes]
    before, after = window(text[0], text[1]), window(text[2], text[3])
    drop = 1 - after["padding_per_step"] / before["padding_per_step"]
    return {
        "device": a.device,
        "plan": str(a.plan),
        "requests": a.requests,
        "seed": a.seed,
        "max_model_len": max_len,
        "default_graphs": default_graphs,
        "tuned_graphs": graphs_of(tuned),
        "before": before,
        "after": after,
        "drop": drop,
        "seconds": seconds,
        "optimize": json.loads(opt),
        "reload": swap,
    }


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", default=str(ROOT / "plans" / "tiny-llama.yaml"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=positive, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-drop", type=float, default=0.30)
    p.add_argument("--json", type=Path, help="write the measurements here")
    p.add_argument("--out", type=Path, help="write the table (Markdown) here")
    p.add_argument("--keep", type=Path, help="keep the scrapes, workload and plans in this folder")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tune_loop.") as tmp:
        try:
            r = run(a, Path(tmp))
        except (OSError, RuntimeError, ValueError) as e:  # the server went away, a bad answer
            print(f"tune_loop: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        finally:
            if a.keep:
                shutil.copytree(tmp, a.keep, dirs_exist_ok=True)
    md = table(r["before"], r["after"], r["drop"])
    head = (
        f"tune_loop: {a.requests} requests (seed {a.seed}) on {a.device}, "
        f"max_model_len {r['max_model_len']}; tuned with --budget-graphs {r['default_graphs']}\n\n"
    )
    print(head + md, end="")
    if a.out:
        a.out.write_text(head + md)
    if a.json:
        a.json.write_text(json.dumps(r, indent=2) + "\n")
    ok = r["drop"] >= a.min_drop and r["after"]["graphs"] <= r["before"]["graphs"]
    ok = ok and r["tuned_graphs"] <= r["default_graphs"]
    if not ok:
        print(f"tune_loop: FAIL: drop below {a.min_drop:.0%} or more graphs", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
