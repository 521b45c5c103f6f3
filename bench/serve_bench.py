"""Serving benchmark, as users measure servers (issue 34): ``graphplan-serve`` started as a user
starts it, a workload of streamed ``/v1/completions`` from several client processes, and the
figures vLLM's and SGLang's serving benchmarks print (output and total tok/s, TTFT, TPOT, ITL),
plus each client process's CPU so a client-bound run shows. GPU only: a result needs a CUDA
device; ``--device cpu --shape tiny`` is a smoke run that checks the program.

    python bench/serve_bench.py --offline --out bench/results/serve_bench.md     # 8B, H100
    python bench/serve_bench.py --workload sharegpt --request-rate 20 --client openai
    python bench/serve_bench.py --server-arg='--api-server-count 2' --server-arg=--no-async-scheduling
    python bench/serve_bench.py --url http://127.0.0.1:8000                       # a running server
    python bench/serve_bench.py --device cpu --shape tiny --requests 16 --max-len 32   # smoke
    python bench/serve_bench.py --workload chat --prefix-caching compare   # issue 38: on vs off

The server: ``graphplan-serve --plan P --model DIR --random-weights ...`` (``python -m
graphplan.server`` where the script is not installed), a subprocess, ready at /healthz 200. DIR is
a Llama checkpoint of the shape (bench/load_test.py's ``write_model``: config.json, weights drawn
from the seed) with a word-level tokenizer of the shape's vocabulary (128,256 words for Llama-3),
so the server detokenizes every token it streams. ``--server-arg`` passes a flag through verbatim
(repeat it; write ``--server-arg=--flag`` since its value starts with a dash). ``--url`` attaches
to a running server instead.

Workloads (bench/serve_workload.py): ``loguniform``, bench/offline_throughput.py's draw (1,000
requests, prompts and outputs log-uniform in 4-1024 tokens, seed 0), and ``sharegpt``, synthetic
ShareGPT-like lengths. Prompts are token ids; every request is greedy with ``ignore_eos`` and
``max_tokens`` its output length, so a whole answer has exactly that many tokens. Requests go all
at once (``--request-rate inf``) or as a Poisson process. Clients (bench/serve_clients.py): 8
processes on CUDA (2 on the CPU), each an asyncio loop of raw httpx (default) or the ``openai``
client. The arithmetic (bench/serve_stats.py) follows vLLM's and SGLang's benchmarks.

``--prefix-caching compare`` runs the workload twice in one run, the server started with
``--enable-prefix-caching`` then ``--no-enable-prefix-caching``, and prints both tables, the
ratios (TTFT p50 off / on, output tok/s on / off) against issue 38's bars (the ``chat`` workload:
>= 4x and >= 1.5x; any other, nothing shared: output tok/s within 3 %), the cache's hit rate
(graphplan_prefix_cache_hits_total / queries_total) and the step mix from /metrics (engine steps,
tokens per step: a cached prefix leaves shorter prefill chunks).

``--offline`` then runs bench/offline_throughput.py's engine loop on the same workload (a
subprocess, after the server has stopped) and prints served / offline output tok/s; the issue's bar
is >= 0.95 in the same device session.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_metrics import mix, scrape

import load_test
import serve_clients
from llama_shapes import SHAPES
from offline_throughput import ANCHORS
from serve_stats import Outcome, client_bound, summary, table
from serve_workload import WORKLOADS, body, chat_max_len, requests, send_offsets
from sse_clients import free_port
from timing import publish

ROOT = Path(__file__).resolve().parents[1]
BAR = 0.95  # served / offline output tok/s
ITL_BAR = 2.0  # served ITL p99 / the offline engine's decode step at full batch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="attach to this running server instead of starting one")
    p.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--plan", type=Path, default=ROOT / "plans" / "llama3-8b-h100.yaml")
    p.add_argument("--set", action="append", default=None,
                   help="plan overrides (default for --shape tiny: bench/load_test.py's)")  # fmt: skip
    p.add_argument("--server-arg", action="append", default=[], help="a serve flag, verbatim")
    p.add_argument("--workload", choices=WORKLOADS, default="loguniform")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt and longest output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system-len", type=int, default=2000, help="chat: the shared system prompt")
    p.add_argument("--turns", type=int, default=3, help="chat: most turns of a conversation")
    p.add_argument("--turn-len", type=int, default=60, help="chat: a user turn's median tokens")
    p.add_argument(
        "--prefix-caching", choices=("default", "on", "off", "compare"), default="default",
        help="the server's --[no-]enable-prefix-caching; compare: both, one after the other",
    )  # fmt: skip
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, or inf")
    p.add_argument("--client-procs", type=int, default=None, help="default 8 (CPU: 2)")
    p.add_argument("--client", choices=("httpx", "openai"), default="httpx")
    p.add_argument("--max-model-len", type=int, default=None, help="default 2 x max-len + 16")
    p.add_argument("--kv-memory-fraction", type=float, default=0.85, help="CUDA only")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--offline", action="store_true", help="then bench/offline_throughput.py")
    p.add_argument(
        "--offline-loop", choices=("plain", "engine"), default="engine",
        help="bench/offline_throughput.py's --loop",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="append the dated record to this markdown file")
    a = p.parse_args(argv)
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.client_procs = a.client_procs or (2 if a.device == "cpu" else 8)
    if a.workload == "chat":  # the longest conversation fits
        a.max_model_len = a.max_model_len or chat_max_len(a) + 16
    a.max_model_len = a.max_model_len or 2 * a.max_len + 16  # offline_throughput's
    if a.set is None:
        a.set = load_test.PLAN_SETS["tiny"] if a.shape == "tiny" else []
    if a.prefix_caching == "compare" and (a.url or a.offline):
        p.error("--prefix-caching compare starts the server twice: no --url, no --offline")
    if a.offline and (a.url or a.workload != "loguniform"):
        p.error("--offline runs bench/offline_throughput.py's workload: loguniform, no --url")
    if not 1 <= a.client_procs <= a.requests:
        p.error("--client-procs must be between 1 and --requests")
    return a


def write_tokenizer(path: Path, vocab: int) -> Path:
    """A word-level fast tokenizer of ``vocab`` words ('w0' ...), saved into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


def server_command(a, model_dir: Path, port: int) -> list[str]:
    beside = Path(sys.executable).parent / "graphplan-serve"  # this Python's, before PATH's
    exe = str(beside) if beside.exists() else shutil.which("graphplan-serve")
    cmd = [exe] if exe else [sys.executable, "-m", "graphplan.server"]
    cmd += ["--plan", str(a.plan), "--model", str(model_dir), "--random-weights"]
    cmd += ["--served-model-name", "serve-bench", "--port", str(port), "--device", a.device]
    cmd += ["--no-progress", "--max-model-len", str(a.max_model_len), "--max-waiting", "4096"]
    if a.device.startswith("cuda"):
        cmd += ["--kv-memory-fraction", str(a.kv_memory_fraction)]
    for s in a.set:
        cmd += ["--set", s]
    if a.prefix_caching in ("on", "off"):
        cmd.append(
            "--enable-prefix-caching" if a.prefix_caching == "on" else "--no-enable-prefix-caching"
        )
    return cmd + [x for arg in a.server_arg for x in shlex.split(arg)]


def wait_ready(url: str, proc, timeout: float, log: Path) -> float:
    """Seconds until ``url``/healthz answers 200; exits with the log's tail if it never does."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and (proc is None or proc.poll() is None):
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = log.read_text()[-4000:] if log.exists() else ""
    raise SystemExit(f"{tail}\nserve_bench: the server at {url} did not become ready")


def stop(proc) -> None:
    proc.send_signal(2)  # SIGINT: the server's orderly exit
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def clients(a, url: str, tmp: Path) -> dict:
    """The workload through ``--client-procs`` processes: the run's summary."""
    prompts, outputs = requests(a, SHAPES[a.shape]["vocab_size"])
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    offsets = send_offsets(len(prompts), a.request_rate, a.seed)
    reqs = [{"i": i, "offset": offsets[i], "body": body(model, prompts[i], outputs[i])}
            for i in range(len(prompts))]  # fmt: skip
    shares = [reqs[p :: a.client_procs] for p in range(a.client_procs)]
    answers = serve_clients.run({"url": url, "client": a.client}, shares, tmp)
    procs = [{"cpu_s": x["cpu_s"], "wall_s": x["wall_s"], "requests": len(x["results"])}
             for x in answers]  # fmt: skip
    return summary([outcome(r, prompts, outputs) for x in answers for r in x["results"]], procs)


def outcome(r: dict, prompts: list[list[int]], outputs: list[int]) -> Outcome:
    """A client's record of request ``r["i"]`` (bench/serve_clients.py) as an ``Outcome``."""
    return Outcome(
        prompt_len=len(prompts[r["i"]]),
        max_tokens=outputs[r["i"]],
        sent=r["sent"],
        chunks=tuple((t, k) for t, k in r["chunks"]),
        finish=r["finish"],
        done=r["done"],
        status=r["status"],
        error=r["error"],
    )


def served(a) -> dict:
    """Start the server (or attach), run the clients, stop it: the run's record."""
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if a.url:
            wait_ready(a.url, None, a.startup_timeout, tmp / "none")
            s = clients(a, a.url.rstrip("/"), tmp)
            s["metrics"] = scrape(a.url.rstrip("/"))
            return {"summary": s, "server": f"attached to {a.url}", "startup_s": None}
        model_dir = load_test.write_model(tmp / f"llama-{a.shape}", a.shape, a.max_model_len)
        write_tokenizer(model_dir, SHAPES[a.shape]["vocab_size"])
        port = free_port()
        cmd, log = server_command(a, model_dir, port), tmp / "server.log"
        with open(log, "w") as f:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            startup = wait_ready(url, proc, a.startup_timeout, log)
            print(f"serve_bench: server ready in {startup:.1f} s", flush=True)
            s = clients(a, url, tmp)
            s["metrics"] = scrape(url)
        finally:
            stop(proc)
    return {"summary": s, "server": f"`{shown(cmd)}`", "startup_s": startup}


def shown(cmd: list[str]) -> str:
    """The server's command as a user types it (the script's or python's name, not its path)."""
    return shlex.join([Path(cmd[0]).name, *cmd[1:]])


def offline(a) -> dict:
    """bench/offline_throughput.py on the same workload, in a subprocess: its output and total
    tok/s, and whether every request finished with all its tokens."""
    cmd = [sys.executable, str(ROOT / "bench" / "offline_throughput.py"), "--device", a.device,
           "--shape", a.shape, "--plan", str(a.plan), "--requests", str(a.requests),
           "--min-len", str(a.min_len), "--max-len", str(a.max_len), "--seed", str(a.seed),
           "--loop", a.offline_loop, *(x for s in a.set for x in ("--set", s))]  # fmt: skip
    child = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    m = re.search(r"\*\*output tokens/s (\d+)\*\*; total tokens/s (\d+)", child.stdout)
    if child.returncode not in (0, 1) or m is None:
        raise SystemExit(f"{child.stdout[-2000:]}{child.stderr[-4000:]}\nthe offline run failed")
    whole = "every request finished with all its tokens: True" in child.stdout
    step = re.search(r"decode step at full batch \(median of \d+ [^)]*\) ([\d.]+) ms", child.stdout)
    itl = re.search(r"inter-token latency: p50 [\d.]+ ms, p99 ([\d.]+) ms", child.stdout)
    return {
        "output_tok_s": int(m[1]),
        "total_tok_s": int(m[2]),
        "whole": whole,
        "full_step_ms": float(step[1]) if step else None,
        "itl_p99_ms": float(itl[1]) if itl else None,
    }


def workload_name(a) -> str:
    if a.workload != "chat":
        return a.workload
    return f"chat: a {a.system_len}-token system prompt, conversations of up to {a.turns} turns"


def device_name(a) -> str:
    if not a.device.startswith("cuda"):
        return a.device
    import torch

    return torch.cuda.get_device_name()


def report(a, argv, run: dict, off: dict | None) -> tuple[str, bool]:
    s = run["summary"]
    rate = "inf" if math.isinf(a.request_rate) else f"{a.request_rate:g}/s"
    ok = s["whole"] == s["requests"]
    lines = [
        f"## serve_bench ({a.shape}, {a.workload}), {device_name(a)}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"command: `python bench/serve_bench.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        f"server: {run['server']}"
        + (f"; ready in {run['startup_s']:.1f} s" if run["startup_s"] is not None else ""),
        f"- {a.requests} requests ({workload_name(a)}, lengths {a.min_len}-{a.max_len}, seed {a.seed}) "
        f"at request rate {rate}; {a.client_procs} client processes ({a.client}), streaming "
        "/v1/completions, greedy, ignore_eos",
        "",
        *table(s),
        "",
    ]
    if s["first_problem"]:
        lines.append(f"- the first request not answered whole: {s['first_problem']}")
    if client_bound(s):
        lines.append("**A client process was CPU-bound: the figures measure the client; raise "
                     "--client-procs.**")  # fmt: skip
    if off is not None:
        # each verdict is the printed figure's, so the line can never read "2.00x (MISSED: <= 2.0x)"
        ratio = round(s["output_tok_s"] / off["output_tok_s"], 3)
        ok &= off["whole"]
        lines.append(
            f"- offline (bench/offline_throughput.py, same workload and plan): "
            f"{off['output_tok_s']} output tok/s, {off['total_tok_s']} total; **served / offline "
            f"{ratio:.3f}** ({'met' if ratio >= BAR else 'MISSED'}: >= {BAR})"
        )
        if off["full_step_ms"]:
            itl = s["itl_ms"]["p99"]
            x = round(itl / off["full_step_ms"], 2)
            lines.append(
                f"- served ITL p99 {itl:.1f} ms against the offline engine's decode step at full "
                f"batch, {off['full_step_ms']:.1f} ms: **{x:.2f}x** "
                f"({'met' if x <= ITL_BAR else 'MISSED'}: <= {ITL_BAR}x)"
            )
        if off.get("itl_p99_ms"):  # what serving adds to the engine's own latency
            lines.append(
                f"- the offline engine's own ITL p99 (same plan, mixed steps included) "
                f"{off['itl_p99_ms']:.1f} ms: served / engine **{s['itl_ms']['p99'] / off['itl_p99_ms']:.2f}x**"
            )
    if "metrics" in s:
        lines.append(f"- {mix(s['metrics'])}")
    if a.shape != "70b":  # the anchors are Llama-3-8B figures (tiny stands in for 8B on a CPU)
        lines += [f"- anchor: {x}" for x in ANCHORS]
    lines.append(f"\n**{'PASS' if ok else 'FAIL'}**: every request finished whole")
    return "\n".join(lines) + "\n", ok


def compare(a, argv) -> tuple[str, bool]:
    """``--prefix-caching compare``: the workload with the cache on, then off; both reports and
    the ratios against issue 38's bars."""
    runs, texts, ok = {}, [], True
    for mode in ("on", "off"):
        a.prefix_caching = mode
        runs[mode] = served(a)
        text, whole = report(a, argv, runs[mode], None)
        texts.append(
            text.replace("## serve_bench (", f"## serve_bench (prefix caching {mode}, ", 1)
        )
        ok &= whole
    a.prefix_caching = "compare"
    on, off = runs["on"]["summary"], runs["off"]["summary"]
    ttft = round(off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"], 2)  # verdicts on printed figures
    ttft99 = off["ttft_ms"]["p99"] / on["ttft_ms"]["p99"]
    tok = round(on["output_tok_s"] / off["output_tok_s"], 3)
    shared = a.workload == "chat"
    met = ttft >= 4 and tok >= 1.5 if shared else abs(tok - 1) <= 0.03
    bar = "TTFT p50 >= 4x lower, output tok/s >= 1.5x" if shared else "output tok/s within 3 %"
    texts.append(
        f"### prefix caching on vs off ({a.workload})\n"
        f"- TTFT p50 off / on **{ttft:.2f}x** (p99 {ttft99:.2f}x); output tok/s on / off "
        f"**{tok:.3f}x**: issue 38's bar ({bar}) **{'met' if met else 'MISSED'}**\n"
        f"- on: {mix(on['metrics'])}\n- off: {mix(off['metrics'])}\n"
    )
    return "\n".join(texts), ok


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.prefix_caching == "compare":
        text, ok = compare(a, argv)
        publish(text, str(a.out) if a.out else None, append=True)
        return 0 if ok else 1
    run = served(a)
    off = offline(a) if a.offline else None
    text, ok = report(a, argv, run, off)
    publish(text, str(a.out) if a.out else None, append=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
