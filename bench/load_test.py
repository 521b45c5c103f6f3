"""Load test of the OpenAI API (issue 26): N concurrent streaming clients against graphplan-serve,
a mix of prompt and output lengths, some clients disconnecting mid-stream. Reports p50/p99 time to
first token (TTFT) and inter-token latency (ITL), throughput, and checks that every request not
cancelled finished whole (max_tokens tokens, ``finish_reason`` "length", ``data: [DONE]``) and that
the cancelled ones freed their seats and KV blocks (/metrics after the run). GPU only: its results
need a CUDA device; ``--device cpu --shape tiny`` is a smoke run that checks the program.

    python bench/load_test.py --random-weights --out bench/results/load_test_h100.md   # 8B, 256
    python bench/load_test.py --random-weights --device cpu --shape tiny --clients 6 --requests 2

The server runs as a subprocess (``python -m graphplan.server --model DIR --random-weights``, DIR
holding only the shape's config.json: random bf16 weights, no download); the clients are asyncio
connections speaking HTTP/1.1 and server-sent events directly, so nothing beyond the standard
library is needed on the client side. Prompts are token ids; ``ignore_eos`` makes every output
exactly ``max_tokens`` long; half the requests sample (seeded), half are greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_shapes import SHAPES
from sse_clients import Result, free_port, get, metric, pct, run_clients

ROOT = Path(__file__).resolve().parents[1]
# (prompt tokens, max_tokens) ranges of each kind of request, and how often it comes
MIX = {
    "8b": [((16, 64), (16, 64), 0.4), ((128, 512), (64, 256), 0.4), ((512, 1024), (32, 128), 0.2)],
    "tiny": [((4, 12), (4, 12), 0.5), ((12, 40), (8, 20), 0.5)],
}
LONG = "long"
PLAN_SETS = {
    "8b": ["scheduler.max_num_seqs=256", "scheduler.max_num_batched_tokens=2048"],
    "tiny": [
        "scheduler.max_num_seqs=8",
        "scheduler.max_num_batched_tokens=64",
        "cudagraph.capture_sizes=[1,2,4,8,16,32,64]",
    ],
}


def write_model(path: Path, shape: str, max_len: int) -> Path:
    """config.json alone: the server draws the weights from --seed (--random-weights)."""
    from transformers import LlamaConfig

    shape_args = {**SHAPES[shape], "max_position_embeddings": max_len, "tie_word_embeddings": False}
    cfg = LlamaConfig(**shape_args, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    return path


def sampling_params(seed: int | None) -> dict:
    """Greedy, or with a ``seed`` sampled (temperature 0.8, top_p 0.95)."""
    if seed is None:
        return {"temperature": 0.0}
    return {"temperature": 0.8, "top_p": 0.95, "seed": seed}


def request_body(prompt: list[int], max_tokens: int, seed: int | None = None) -> dict:
    """A streamed completion of exactly ``max_tokens`` tokens (``sampling_params(seed)``)."""
    return {
        "model": "load",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        **sampling_params(seed),
    }


def workload(a) -> list[list[dict]]:
    """Per client, its requests: the body to send and when to hang up (None: never)."""
    rng = random.Random(a.seed)
    vocab = SHAPES[a.shape]["vocab_size"]
    mix = MIX[a.shape]
    out = []
    for c in range(a.clients):
        reqs = []
        for r in range(a.requests):
            (plo, phi), (olo, ohi), _ = rng.choices(mix, weights=[m[2] for m in mix])[0]
            n_out = rng.randint(olo, ohi)
            sampled = rng.random() < 0.5
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(plo, phi))]
            body = request_body(prompt, n_out, c * 1000 + r if sampled else None)
            hang_up = rng.randint(1, max(1, n_out // 2)) if rng.random() < a.disconnect else None
            kind = f"{plo}-{phi}/{olo}-{ohi}"
            reqs.append({"body": body, "disconnect_after": hang_up, "kind": kind})
        out.append(reqs)
    if a.long_prompt:  # one more client: a long prompt beside the others (issue 25's 32k case)
        body = request_body(
            [rng.randrange(1, vocab) for _ in range(a.long_prompt)], a.long_max_tokens
        )
        out.append([{"body": body, "disconnect_after": None, "kind": LONG}])
    return out


def server_switches(a) -> list[str]:
    """The serve flags of bench/serve_overhead.py's variant switches in ``a``, on or off
    explicitly (the server's defaults are async scheduling on, the fused sampler on with CUDA);
    none where ``a`` has no such switch (bench/load_test.py: the server's defaults)."""
    names = ("async_scheduling", "fused_sampler")
    flag = {True: "--", False: "--no-"}
    return [flag[bool(getattr(a, n))] + n.replace("_", "-") for n in names if hasattr(a, n)]


def launch(a, model_dir: Path, port: int, log):
    cmd = [
        sys.executable,
        "-m",
        "graphplan.server",
        "--model",
        str(model_dir),
        "--random-weights",
        "--served-model-name",
        "load",
        "--plan",
        str(a.plan),
        "--port",
        str(port),
        "--device",
        a.device,
        "--no-progress",
        "--max-model-len",
        str(a.max_model_len),
        "--max-waiting",
        "4096",
    ]
    for s in PLAN_SETS[a.shape] + a.set:
        cmd += ["--set", s]
    if a.kv_memory_fraction:
        cmd += ["--kv-memory-fraction", str(a.kv_memory_fraction)]
    cmd += server_switches(a)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return cmd, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def report(
    a, cmd, results: list[Result], wall: float, after: str, startup: float
) -> tuple[str, bool]:
    whole = [r for r in results if not r.cancelled]
    cut = [r for r in results if r.cancelled]
    bad = [
        r
        for r in whole
        if r.status != 200
        or not r.done
        or r.finish_reason != "length"
        or len(r.token_times) != r.max_tokens
        or r.error
    ]
    ttft = [1000 * (r.token_times[0] - r.sent) for r in results if r.token_times]
    itl = [1000 * (t1 - t0) for r in results for t0, t1 in zip(r.token_times, r.token_times[1:])]
    tokens = sum(len(r.token_times) for r in results)
    long_line = ""
    for r in results:
        if r.kind == LONG:
            ttft_s = r.token_times[0] - r.sent if r.token_times else float("nan")
            long_line = (
                f"- the long request ({a.long_prompt} prompt tokens, {r.max_tokens} out): "
                f"{'finished whole' if r not in bad else 'FAILED: ' + (r.error or '?')}, "
                f"{len(r.token_times)} tokens, first after {ttft_s:.1f} s, all in "
                f"{(r.token_times[-1] - r.sent) if r.token_times else float('nan'):.1f} s"
            )
    preempted = metric(after, "graphplan_server_preemptions_total")
    running = metric(after, "graphplan_server_running_requests")
    used = metric(after, "graphplan_server_kv_blocks_used")
    aborted = metric(after, "graphplan_server_requests_total", 'code="499"')
    ok = not bad and running == 0 and used == 0
    lines = [
        f"# load test: {a.clients} streaming clients x {a.requests} requests"
        + (f" + 1 of {a.long_prompt} prompt tokens" if a.long_prompt else "")
        + f", {a.shape} shape, max_model_len {a.max_model_len}",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"device: {a.device_name}, python {platform.python_version()}",
        f"- server: `{shlex.join(cmd[1:])}`",
        f"- bench: `python {shlex.join(sys.argv)}`",
        f"- start-up (model + capture) {startup:.1f} s; run {wall:.1f} s; "
        f"{tokens} tokens streamed, {tokens / wall:.0f} tokens/s; preemptions {preempted:g}",
        *([long_line] if long_line else []),
        "",
        "| requests | finished whole | cancelled by the client | failed |",
        "|---:|---:|---:|---:|",
        f"| {len(results)} | {len(whole) - len(bad)} / {len(whole)} | {len(cut)} | {len(bad)} |",
        "",
        "| ms | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {pct(xs, 50):.1f} | {pct(xs, 90):.1f} | {pct(xs, 99):.1f} | "
            f"{max(xs) if xs else float('nan'):.1f} |"
            for name, xs in (("TTFT", ttft), ("ITL", itl))
        ),
        "",
        f"After the run, /metrics: running requests {running:g}, KV blocks used {used:g}, "
        f"requests ended by a disconnect (499) {aborted:g} (clients that hung up: {len(cut)}).",
        "",
        f"**{'PASS' if ok else 'FAIL'}**: every request not cancelled finished whole"
        + ("" if not bad else f" except {len(bad)}: {bad[0]}"),
    ]
    return "\n".join(lines) + "\n", ok


def parser(description: str = __doc__.split("\n\n")[0]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--random-weights",
        action="store_true",
        required=True,
        help="required: the model's weights are random (drawn from its config)",
    )
    p.add_argument("--shape", choices=sorted(MIX), default="8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--plan", type=Path, default=ROOT / "plans" / "hf-mixed.yaml")
    p.add_argument("--set", action="append", default=[], help="more plan overrides")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--requests", type=int, default=2, help="per client, one after the other")
    p.add_argument(
        "--disconnect",
        type=float,
        default=0.1,
        help="fraction of requests whose client hangs up mid-stream",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="default 2048 (tiny: 64)")
    p.add_argument("--kv-memory-fraction", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=500)
    p.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        help="one more client sends a prompt of this many tokens (e.g. 32000 with "
        "--max-model-len 32768)",
    )
    p.add_argument("--long-max-tokens", type=int, default=256)
    p.add_argument("--out", type=Path)
    return p


def finish_args(a):
    a.max_model_len = a.max_model_len or (64 if a.shape == "tiny" else 2048)
    a.device_name = a.device
    if a.device.startswith("cuda"):
        import torch

        a.device_name = torch.cuda.get_device_name()
    return a


def serve(a, work) -> dict | None:
    """Start the server, run the clients of ``work``, scrape /metrics, stop it: the run's record,
    or None (after printing the server's log) when it did not start."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / f"llama-{a.shape}", a.shape, a.max_model_len)
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            cmd, proc = launch(a, model_dir, port, log)
            try:
                t0 = time.monotonic()
                while get(port, "/healthz")[0] != 200:
                    if proc.poll() is not None or time.monotonic() - t0 > a.startup_timeout:
                        print(log_path.read_text()[-4000:], file=sys.stderr)
                        print("the server did not start", file=sys.stderr)
                        return None
                    time.sleep(0.5)
                startup = time.monotonic() - t0
                before = get(port, "/metrics")[1]
                print(f"server ready in {startup:.1f} s; {len(work)} clients", flush=True)
                t1 = time.perf_counter()
                results = asyncio.run(run_clients(port, work))
                wall = time.perf_counter() - t1
                time.sleep(0.5)  # the last cancellations are freed at the next step
                after = get(port, "/metrics")[1]
            finally:
                proc.send_signal(2)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return dict(cmd=cmd, results=results, wall=wall, before=before, after=after, startup=startup)


def main(argv=None) -> int:
    a = finish_args(parser().parse_args(argv))
    run = serve(a, workload(a))
    if run is None:
        return 1
    text, ok = report(a, run["cmd"], run["results"], run["wall"], run["after"], run["startup"])
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
