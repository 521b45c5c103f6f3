"""graphplan-serve --plan plans/tiny-llama.yaml [--port 8000] [--device cuda]
   graphplan-serve --model DIR --plan plans/hf-mixed.yaml    (a Hugging Face decoder;
                            plans/hf-decode.yaml: FULL graphs for decodes only, mixed steps eager)

Compiles the plan (or loads a compiled table.json), starts listening, builds the model (the tiny
Llama, or --model's checkpoint) sized to the table, captures its graphs (progress in the log),
then serves. SIGHUP re-reads the plan and swaps it in between steps; SIGTERM / SIGINT drain and
stop. ``/admin/reload`` is off unless an admin token is given (``GRAPHPLAN_ADMIN_TOKEN``, or
``--admin-token``, which other users can see in the process list), and reloads only files inside
``--reload-dir`` (default: the plan's folder).
Exit codes: 0 after a clean stop, 2 for an invalid plan, 1 for any other start-up failure.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import torch

from graphplan.compiler.errors import GraphplanError

from .app import Server
from .hf_model import HFSpec
from .model import DTYPES, ModelSpec, ServingSpec, parse_sets
from .security import TOKEN_ENV, admin_token

log = logging.getLogger("graphplan.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphplan-serve",
        description="Serve the tiny Llama, or a Hugging Face decoder "
        "(--model), through graphplan's runtime.",
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
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (see the log)")
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
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        help="--model: KV-cache size in tokens (default: max_num_seqs x max-model-len)",
    )
    p.add_argument(
        "--kv-memory-fraction",
        type=float,
        help="--model: KV cache from this fraction of the free device memory",
    )
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument(
        "--max-model-len",
        type=int,
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
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for running requests",
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
        type=float,
        default=30.0,
        metavar="S",
        help="close a connection that sends nothing for this many seconds",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.random_weights and not a.model:
        parser.error("--random-weights applies to --model (the tiny Llama's come from --seed)")
    d = ModelSpec()
    logging.basicConfig(
        level=a.log_level.upper(),
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
        )
    except GraphplanError as e:
        print(f"server: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"server: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, server.handle_sighup)
    server.start()
    while not stop.wait(0.2):  # the main thread stays free for signal handlers
        if server.engine.state == "failed":
            break
    log.info("stopping (%s)", "start-up failed" if server.engine.state == "failed" else "signal")
    server.stop()
    return 1 if server.engine.state == "failed" else 0
