"""graphplan-serve --plan plans/tiny-llama.yaml [--port 8000] [--device cuda]
   graphplan-serve --model DIR --plan plans/hf-mixed.yaml    (a Hugging Face decoder;
                            plans/hf-decode.yaml: FULL graphs for decodes only, mixed steps eager)

Compiles the plan (or loads a compiled table.json), starts listening, starts the engine core process
(it builds the model, the tiny Llama or --model's checkpoint, sized to the table, and captures its
graphs, progress in the log), then serves. The front end (HTTP, tokenization, detokenization, stop
strings, SSE) runs in this process, and in ``--api-server-count`` - 1 more processes on the same
port; ``--single-process`` runs the engine thread in this process instead. SIGHUP re-reads the plan
and swaps it in between steps. ``/admin/reload`` is off unless an admin token is given
(``GRAPHPLAN_ADMIN_TOKEN``, or ``--admin-token``, which other users can see in the process list),
and reloads only files inside ``--reload-dir`` (default: the plan's folder).

SIGINT or SIGTERM while the graphs are captured exits at once. Once serving, new requests get 503
with a Retry-After, requests in flight finish (up to --drain-timeout, 30 s by default), and the
server exits 0; a second signal, or the timeout, stops at once with exit 128 + the signal's number.
If the engine process dies, every open request ends with an error, /healthz turns 503 and the
server exits 1; no process outlives the server.
Exit codes: 2 for an invalid plan or a bad flag, 1 for any other start-up failure or a dead engine,
0 after a complete drain, 128 + N after signal N otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

import torch

from graphplan.compiler.errors import GraphplanError
from graphplan.models.hf.tp_symm import algo_from_env, max_bytes_from_env

from .core.hf_model import HFSpec
from .core.model import DTYPES, ModelSpec, ServingSpec, parse_sets
from .frontend.app import Server
from .frontend.security import TOKEN_ENV, admin_token
from .lora_flags import add_lora_flags, lora_flags
from .spec_flags import add_spec_flag, speculative_config

log = logging.getLogger("graphplan.server")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _number(kind, low: float, high: float | None = None, *, open_low: bool = False, what=""):
    """An argparse type: ``kind`` within [low, high] ((low, high] with open_low)."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what or kind.__name__}") from None
        if v != v or (v <= low if open_low else v < low) or (high is not None and v > high):
            bound = f"above {low:g}" if open_low else f"at least {low:g}"
            top = f" and at most {high:g}" if high is not None else ""
            raise argparse.ArgumentTypeError(f"{text!r} must be {bound}{top}")
        return v

    parse.__name__ = what or kind.__name__
    return parse


PORT = _number(int, 0, 65535, what="a port number")
POSITIVE_INT = _number(int, 1, what="an integer")
SECONDS = _number(float, 0, 365 * 86400, open_low=True, what="a number of seconds")
FRACTION = _number(float, 0, 1, open_low=True, what="a fraction")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphplan-serve",
        description="Serve the tiny Llama, or a Hugging Face decoder "
        "(--model), through graphplan's runtime.",
    )
    from graphplan.compiler import __version__

    p.add_argument(
        "--version", action="version", version=f"graphplan-serve (graphplan) {__version__}"
    )
    p.add_argument(
        "--plan", required=True, help="a plan (.yaml, .yaml.j2) or a compiled table.json"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="plan override, as `plan compile --set` (e.g. cudagraph.mode=NONE)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=PORT, default=8000, help="1-65535, or 0 to pick a free one (see the log)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    d = ModelSpec()
    p.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face checkpoint (config.json + model.safetensors or its shards, "
        "or pytorch_model.bin; tokenizer optional) instead of the tiny Llama; Llama, Qwen2 and "
        "Qwen3 causal LMs. Only its regular files are read and none of its code runs",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="--model: weights drawn from --seed instead of read from DIR (benchmarks, tests); "
        "without it a directory with no weights is refused",
    )
    p.add_argument("--served-model-name", help="the name /v1 clients use (default: DIR's name)")
    add_lora_flags(p, POSITIVE_INT)
    p.add_argument(
        "--kv-cache-tokens",
        type=POSITIVE_INT,
        help="--model: KV-cache size in tokens (default: max_num_seqs x max-model-len)",
    )
    p.add_argument(
        "--kv-memory-fraction",
        type=FRACTION,
        help="--model: KV cache from this fraction of the free device memory",
    )
    p.add_argument("--layers", type=POSITIVE_INT, default=d.layers)
    p.add_argument("--hidden", type=POSITIVE_INT, default=d.hidden)
    p.add_argument("--vocab-size", type=POSITIVE_INT, default=d.vocab_size)
    p.add_argument(
        "--max-model-len",
        type=POSITIVE_INT,
        default=None,
        help=f"default {d.max_model_len} (--model: min(max_position_embeddings, 2048))",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help=f"default {d.dtype} (--model: bfloat16 on CUDA)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default="",
        metavar="BACKEND",
        help="compile the model once (torch.compile, dynamic token dimension) and "
        "capture graphs of the compiled model; BACKEND defaults to inductor",
    )
    p.add_argument("--no-progress", action="store_true", help="no capture progress bar")
    p.add_argument(
        "--on-demand",
        action="store_true",
        default=None,
        help="capture at start only the largest graphs and the plan's "
        "cudagraph.on_demand.start_sizes, every other graph on its first use "
        "(/healthz turns 200 sooner); default: the plan's cudagraph.on_demand.enabled",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on by default (as in vLLM): in the steady decode state, launch each step before "
        "reading the previous step's "
        "tokens, so the host's scheduling overlaps the device's work (steps with prompt logprobs, "
        "a request that can join, cancellations and preemption run synchronously; "
        "a queue waiting for a seat does not stop it); "
        "the same tokens either way",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on by default (as in vLLM): full KV blocks are found by their tokens and shared, so "
        "a prompt's cached beginning (a system prompt, earlier turns) is not computed again; "
        "the same tokens either way",
    )
    p.add_argument(
        "--fused-sampler",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sample with one Triton kernel for the noise, the mask and the argmax "
        "(server/core/sampling_kernels.py; CUDA only) instead of the torch ops; default: on with "
        "--device cuda",
    )
    add_spec_flag(p)
    p.add_argument("--max-body-bytes", type=POSITIVE_INT, default=1 << 20)
    p.add_argument(
        "--max-waiting",
        type=POSITIVE_INT,
        default=1024,
        help="requests queued beyond the running ones before new ones get 429",
    )
    p.add_argument(
        "--drain-timeout",
        type=_number(float, 0, 86400, what="a number of seconds"),
        default=30.0,
        help="seconds a SIGTERM/SIGINT lets running requests finish before exiting (default 30; "
        "0: end them at once)",
    )
    p.add_argument(
        "--api-server-count",
        type=_number(int, 1, 64, what="an integer"),
        default=1,
        metavar="N",
        help="front end processes (HTTP, tokenization, detokenization, SSE) on the one port, "
        "beside the engine process (default 1)",
    )
    p.add_argument(
        "--single-process",
        action="store_true",
        help="run the engine thread in the front end's process (one process, one GIL) instead of "
        "an engine process of its own",
    )
    p.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help=f"bearer token for /admin/ routes (default: ${TOKEN_ENV}; "
        "without one they are off). Prefer the environment variable: a flag is "
        "visible in the process list",
    )
    p.add_argument(
        "--reload-dir",
        metavar="DIR",
        help="/admin/reload reads plans and tables only inside this directory "
        "(default: the folder of --plan)",
    )
    p.add_argument(
        "--idle-timeout",
        type=SECONDS,
        default=30.0,
        metavar="S",
        help="close a connection that sends no request for this many seconds, and answer 408 "
        "to a body that takes longer than this to arrive (> 0)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help="INFO logs one access line per request (logger graphplan.server.access)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    previous = {
        sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    }
    for sig in (signal.SIGTERM, signal.SIGINT):  # until serve() takes over: nothing to drain
        signal.signal(sig, lambda signum, frame: _exit_now(signum, "while starting"))
    try:
        return _main(parser, a)
    finally:  # (main is also called in-process, by tests)
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def _main(parser: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    lora = next((f for f, v in lora_flags(a) if v), None)
    if lora and not a.model:
        parser.error(f"{lora} applies to --model (LoRA adapters of a Hugging Face checkpoint)")
    if a.random_weights and not a.model:
        parser.error("--random-weights applies to --model (the tiny Llama's come from --seed)")
    if a.single_process and a.api_server_count > 1:
        parser.error(
            "--api-server-count > 1 needs the engine in a process of its own: drop --single-process"
        )
    try:
        torch.device(a.device)
    except RuntimeError:
        parser.error(f"--device {a.device!r} is not a torch device: use cpu, cuda or cuda:N")
    if a.fused_sampler and not a.device.startswith("cuda"):
        parser.error(
            f"--fused-sampler runs a Triton kernel on the GPU: it needs --device cuda, not {a.device}"
        )
    try:  # the TP ranks' symmetric-memory settings, read here before any rank starts
        max_bytes_from_env(), algo_from_env()
    except ValueError as e:
        parser.error(str(e))
    d = ModelSpec()
    logging.basicConfig(
        level=a.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    spec: ServingSpec
    if a.model:
        spec = HFSpec(
            model=a.model,
            max_model_len=a.max_model_len,
            dtype=a.dtype,
            seed=a.seed,
            random_weights=a.random_weights,
            kv_cache_tokens=a.kv_cache_tokens,
            kv_memory_fraction=a.kv_memory_fraction,
            served_model_name=a.served_model_name,
            compile=a.compile,
            lora_modules=tuple(a.lora_modules or ()),
            max_loras=a.max_loras,
            max_lora_rank=a.max_lora_rank,
        )
    else:
        spec = ModelSpec(
            layers=a.layers,
            hidden=a.hidden,
            vocab_size=a.vocab_size,
            max_model_len=a.max_model_len or d.max_model_len,
            seed=a.seed,
            dtype=a.dtype or d.dtype,
            compile=a.compile,
        )
    try:
        speculative = speculative_config(a)
        spec.check()  # an unsupported or missing checkpoint fails here, before capture
        server = Server(
            a.plan,
            overrides=parse_sets(a.set) or None,
            host=a.host,
            port=a.port,
            device=a.device,
            spec=spec,
            progress=not a.no_progress,
            max_body_bytes=a.max_body_bytes,
            drain_timeout=a.drain_timeout,
            admin_token=admin_token(a.admin_token),
            reload_dir=a.reload_dir,
            idle_timeout=a.idle_timeout,
            on_demand=a.on_demand,
            max_waiting=a.max_waiting,
            async_scheduling=a.async_scheduling,
            fused_sampler=a.fused_sampler,
            enable_prefix_caching=a.enable_prefix_caching,
            speculative=speculative,
            processes=not a.single_process,
            api_server_count=a.api_server_count,
            log_level=logging.getLevelName(a.log_level),
        )
    except GraphplanError as e:
        print(f"server: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"server: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr)
        return 1
    return serve(server)


SWITCH_INTERVAL_S = 0.001


def serve(server: Server) -> int:
    """Run until a signal (see the module docstring); the exit code."""
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(signum, frame):
        signals.append(signum)
        if server.state == "starting" or len(signals) > 1:
            _exit_now(signum, "while capturing graphs" if len(signals) == 1 else "again")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, server.handle_sighup)
    # One process: the engine thread gives up the GIL at every device call; when it wants it back
    # while the HTTP thread formats chunks, CPython makes it wait up to the switch interval (5 ms by
    # default, half a decode step): 1 ms bounds what that wait adds to a step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server.start()
    while not stop.wait(0.2):  # the main thread stays free for signal handlers
        if server.state == "failed":
            break
    failed = server.state == "failed"
    why = "the engine failed" if failed else signal.Signals(signals[0]).name
    log.info("stopping (%s)%s", why, "" if failed else ": draining")
    drained = server.stop()
    if failed:
        error = server.engine.health().get("error", "")
        print(f"graphplan-serve: {why} ({error}): stopped", file=sys.stderr, flush=True)
        return 1
    name = signal.Signals(signals[0]).name
    if drained:
        print(f"graphplan-serve: {name}: drained, stopped", file=sys.stderr, flush=True)
        return 0
    print(
        f"graphplan-serve: {name}: stopped before every request finished",
        file=sys.stderr,
        flush=True,
    )
    return 128 + signals[0]


def _exit_now(signum: int, when: str) -> None:
    """End the process now: the engine thread may be inside a capture that takes a minute."""
    name = signal.Signals(signum).name
    print(f"graphplan-serve: {name} {when}: exiting now", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(128 + signum)
