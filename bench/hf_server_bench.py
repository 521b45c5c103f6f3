"""The server with a Hugging Face model under a mixed workload (issue 14): FULL_DECODE_ONLY
(plans/hf-decode.yaml: mixed steps eager) vs FULL_AND_PIECEWISE (plans/hf-mixed.yaml: mixed steps
replay piece graphs around eager attention), same model, same requests.

    python bench/hf_server_bench.py --out bench/results/hf_server_h100.md      # GPU: HF Llama, bf16
    python bench/hf_server_bench.py --device cpu --smoke                        # smoke run

The model is the stock LlamaForCausalLM of the HF issue (vocab 32000, hidden 1024, intermediate
2816, 8 layers, 16 heads / 4 KV heads, random weights: a config.json alone in a temp directory).
Each client sends its requests over /v1/completions (token-id prompts, greedy) after random
exponential gaps, so new prompts arrive while others decode; the engine prefills them in chunks
within the token budget beside the running decodes. Reported per plan: requests and output tokens
per second, end-to-end latency p50/p99, the server's steps and the replays by graph mode (from
/metrics). Every request must answer (exit 1 otherwise); the share of requests whose tokens are the
same under both plans is printed (bf16 rounds differently in FULL, piecewise and eager kernels, so
near-ties may flip; on the CPU in float32 it should be 100%). The server runs as a subprocess.

GPU only: its results need a CUDA device; ``--device cpu`` is a smoke run that checks the program,
not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import platform
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from hf_setup import FULL_SIZE, SMOKE_SIZE
from server_load import get, run_server, run_threads

ROOT = Path(__file__).resolve().parents[1]
PLANS = {
    "FULL_DECODE_ONLY": ROOT / "plans" / "hf-decode.yaml",
    "FULL_AND_PIECEWISE": ROOT / "plans" / "hf-mixed.yaml",
}
SMOKE_LLAMA = dict(SMOKE_SIZE, intermediate_size=128)
SMOKE_SETS = [
    "scheduler.max_num_seqs=4",
    "scheduler.max_num_batched_tokens=32",
    "cudagraph.capture_sizes=[1,2,4,8,16,24,32]",
]


def write_model(path: Path, size: dict) -> Path:
    """config.json alone: the server draws random weights from --seed (--random-weights)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        **size,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    return path


def workload(a, vocab: int):
    """Per client: (gap before it in seconds, prompt ids, max_tokens) for each request."""
    rng = random.Random(a.seed)
    return [
        [
            (
                rng.expovariate(1 / a.gap) if a.gap > 0 else 0.0,
                [
                    rng.randrange(vocab)
                    for _ in range(rng.randint(max(1, a.prompt_len // 4), a.prompt_len))
                ],
                rng.randint(max(1, a.max_tokens // 2), a.max_tokens),
            )
            for _ in range(a.requests)
        ]
        for _ in range(a.clients)
    ]


def launch(a, model_dir: Path, plan: Path, log_path: Path):
    cmd = [
        sys.executable,
        "-m",
        "graphplan.server",
        "--model",
        str(model_dir),
        "--plan",
        str(plan),
        "--port",
        "0",
        "--device",
        a.device,
        "--no-progress",
        "--max-model-len",
        str(a.max_model_len),
        "--seed",
        "0",
        "--random-weights",
    ]
    for s in a.set + (SMOKE_SETS if a.smoke else []):
        cmd += ["--set", s]
    return run_server(cmd, log_path, a.startup_timeout)


def complete(conn, name: str, prompt: list[int], max_tokens: int) -> list[int]:
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    text = r.read().decode()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {text.strip()[:200]}")
    return json.loads(text)["choices"][0]["token_ids"]


def run_clients(port: int, name: str, work) -> dict:
    res = {"lat": [], "tokens": 0, "lost": [], "out": {}}
    lock = threading.Lock()

    def client(c):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        for i, (gap, prompt, n) in enumerate(work[c]):
            time.sleep(gap)
            t0 = time.perf_counter()
            try:
                out = complete(conn, name, prompt, n)
            except Exception as e:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                with lock:
                    res["lost"].append(f"client {c} request {i}: {type(e).__name__}: {e}")
                continue
            with lock:
                res["lat"].append(time.perf_counter() - t0)
                res["tokens"] += len(out)
                res["out"][c, i] = out
        conn.close()

    res["seconds"] = run_threads(client, len(work))
    return res


def scrape(port: int) -> dict:
    _, text = get(port, "/metrics")
    by_mode: dict[str, int] = {}
    for labels, v in re.findall(r"^graphplan_graph_replays_total\{([^}]*)\} (\S+)$", text, re.M):
        mode = re.search(r'mode="([A-Z_]+)"', labels)
        if mode:
            by_mode[mode.group(1)] = by_mode.get(mode.group(1), 0) + int(float(v))
    eager = sum(
        float(v)
        for v in re.findall(r"^graphplan_eager_steps_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    )
    steps = sum(
        float(v)
        for v in re.findall(
            r"^graphplan_server_step_seconds_count(?:\{[^}]*\})? (\S+)$", text, re.M
        )
    )
    return {"by_mode": by_mode, "eager": int(eager), "steps": int(steps)}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))] if xs else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model and plan overrides (max_num_seqs 4, budget 32 tokens)",
    )
    p.add_argument("--clients", type=int, default=None, help="default 32 (smoke: 3)")
    p.add_argument("--requests", type=int, default=None, help="per client; default 8 (smoke: 2)")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="prompts of [this / 4, this] tokens; default 512 (smoke: 24)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="max_tokens in [this / 2, this]; default 128 (smoke: 6)",
    )
    p.add_argument(
        "--gap",
        type=float,
        default=None,
        help="mean seconds between a client's requests; default 0.2 (smoke: 0.05)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="default 1024 (smoke: 64)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="plan override for both plans (e.g. scheduler.max_num_batched_tokens=512)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=400)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    defaults = (
        dict(clients=3, requests=2, prompt_len=24, max_tokens=6, gap=0.05, max_model_len=64)
        if a.smoke
        else dict(
            clients=32, requests=8, prompt_len=512, max_tokens=128, gap=0.2, max_model_len=1024
        )
    )
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    size = SMOKE_LLAMA if a.smoke else FULL_SIZE
    work = workload(a, size["vocab_size"])
    name = (
        torch.cuda.get_device_name()
        if a.device.startswith("cuda")
        else (platform.processor() or "cpu")
    )
    lines = [
        f"# hf_server_bench: python bench/hf_server_bench.py {' '.join(sys.argv[1:])}",
        f"# date {datetime.datetime.now().isoformat(timespec='seconds')}, device {name}, "
        f"torch {torch.__version__}",
        f"# model: LlamaForCausalLM, random weights, {size}; max_model_len {a.max_model_len}",
        f"# workload: {a.clients} clients x {a.requests} requests, prompts "
        f"{a.prompt_len // 4}-{a.prompt_len} tokens, max_tokens {a.max_tokens // 2}-"
        f"{a.max_tokens}, exponential gaps of mean {a.gap} s; plan overrides "
        f"{a.set + (SMOKE_SETS if a.smoke else []) or 'none'}",
        f"{'mode':<19} {'plan':<15} {'req/s':>7} {'tok/s':>9} {'p50 s':>8} {'p99 s':>8} "
        f"{'steps':>6} {'FULL':>6} {'PIECEWISE':>9} {'eager':>6} {'lost':>5}",
    ]
    lines.append("-" * len(lines[-1]))
    results, failed = {}, False
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "hf-llama", size)
        for mode, plan in PLANS.items():
            proc, port = launch(a, model_dir, plan, Path(tmp) / f"{mode}.log")
            try:
                res = run_clients(port, "hf-llama", work)
                m = scrape(port)
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            results[mode] = res
            failed |= bool(res["lost"])
            n = len(res["lat"])
            lines.append(
                f"{mode:<19} {plan.name:<15} {n / res['seconds']:>7.2f} "
                f"{res['tokens'] / res['seconds']:>9.1f} {pct(res['lat'], 50):>8.3f} "
                f"{pct(res['lat'], 99):>8.3f} {m['steps']:>6} "
                f"{m['by_mode'].get('FULL', 0):>6} {m['by_mode'].get('PIECEWISE', 0):>9} "
                f"{m['eager']:>6} {len(res['lost']):>5}"
            )
            lines += [f"#   lost: {x}" for x in res["lost"][:5]]
    a_out, b_out = (results[k]["out"] for k in PLANS)
    both = set(a_out) & set(b_out)
    same = sum(a_out[k] == b_out[k] for k in both)
    d, pw = (results[k] for k in PLANS)
    speed = (pw["tokens"] / pw["seconds"]) / max(d["tokens"] / d["seconds"], 1e-9)
    lines.append(
        f"# FULL_AND_PIECEWISE vs FULL_DECODE_ONLY: throughput {speed:.2f}x, p50 "
        f"{pct(pw['lat'], 50) / pct(d['lat'], 50):.2f}x, p99 "
        f"{pct(pw['lat'], 99) / pct(d['lat'], 99):.2f}x; identical outputs "
        f"{same}/{len(both)} requests"
    )
    lines.append(
        f"# result: {'FAIL (lost requests)' if failed else 'PASS (every request answered)'}"
    )
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
