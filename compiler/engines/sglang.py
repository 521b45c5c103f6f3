"""SGLang adapter: a plan <-> ``python -m sglang.launch_server`` flags / the ServerArgs dict.

SGLang keeps two lists: decode batch sizes in requests (``--cuda-graph-bs``, FULL graphs of
uniform decode) and, with ``--enable-piecewise-cuda-graph``, prefill token counts
(``--piecewise-cuda-graph-tokens``). graphplan has one token list for both routines: export splits
it (decode sizes / q, every size for piecewise); import takes the union. Sources: docs/engines.md.
"""

from __future__ import annotations

import json

from ..records import decode_token_range
from . import flags as F
from .draft import Draft
from .flags import Flag

ENGINE = "sglang"
VERSIONS = {
    "0.5": "SGLang 0.5.x: --cuda-graph-bs/--cuda-graph-max-bs, --enable-piecewise-cuda-"
    "graph with --piecewise-cuda-graph-tokens/--piecewise-cuda-graph-max-tokens"
}
DEFAULT_VERSION = "0.5"
FORMATS = ("args", "json")
BIG = 1 << 20

FLAGS = {
    "--cuda-graph-bs": Flag("cuda_graph_bs", "ints", 1, 65536),
    "--cuda-graph-max-bs": Flag("cuda_graph_max_bs", "int", 1, 65536),
    "--disable-cuda-graph": Flag("disable_cuda_graph", "bool"),
    "--disable-cuda-graph-padding": Flag("disable_cuda_graph_padding", "bool"),
    "--enable-piecewise-cuda-graph": Flag("enable_piecewise_cuda_graph", "bool"),
    "--piecewise-cuda-graph-max-tokens": Flag("piecewise_cuda_graph_max_tokens", "int", 1, BIG),
    "--piecewise-cuda-graph-tokens": Flag("piecewise_cuda_graph_tokens", "ints", 1, BIG),
    "--dp-size": Flag("dp_size", "int", 1, 1024),
    "--data-parallel-size": Flag("dp_size", "int", 1, 1024),
    "--tp-size": Flag("tp_size", "int", 1, 1024),
    "--tensor-parallel-size": Flag("tp_size", "int", 1, 1024),
    "--enable-dp-attention": Flag("enable_dp_attention", "bool"),
    "--enable-two-batch-overlap": Flag("enable_two_batch_overlap", "bool"),
    "--max-running-requests": Flag("max_running_requests", "int", 1, 65536),
    "--chunked-prefill-size": Flag("chunked_prefill_size", "int", -1, BIG),
    "--max-prefill-tokens": Flag("max_prefill_tokens", "int", 1, BIG),
    "--speculative-algorithm": Flag("speculative_algorithm", "str"),
    "--speculative-num-draft-tokens": Flag("speculative_num_draft_tokens", "int", 1, 64),
    "--enable-lora": Flag("enable_lora", "bool"),
    "--max-loras-per-batch": Flag("max_loras_per_batch", "int", 1, 256),
}
REMOVED = {
    "0.5": {
        "--cuda-graph-bs-prefill": "SGLang 0.5 spells it --piecewise-cuda-graph-tokens "
        "(later releases renamed it)",
        "--cuda-graph-max-bs-prefill": "SGLang 0.5 spells it "
        "--piecewise-cuda-graph-max-tokens (later releases renamed it)",
    }
}


def export_config(spec, mode: str, sizes: tuple, version: str) -> tuple[dict, list]:
    s, cg, lora, par = spec.scheduler, spec.cudagraph, spec.lora, spec.parallel
    q, diags = s.decode_query_len, []
    out: dict = {
        "max_running_requests": s.max_num_seqs,
        "chunked_prefill_size": s.max_num_batched_tokens,
    }
    if q > 1:
        out["speculative_num_draft_tokens"] = q
        diags.append(
            F.note(
                "scheduler.decode_query_len",
                "add --speculative-algorithm and the "
                "draft model; num_draft_tokens is the verify width q",
            )
        )
    mode, bs, pieces = F.engine_routines(
        ENGINE,
        version,
        mode,
        sizes,
        q,
        s.max_num_seqs,
        {
            "PIECEWISE": "PIECEWISE graphs for decode batches (SGLang captures FULL decode graphs)",
            "FULL": "FULL graphs for mixed batches (SGLang's prefill graphs are piecewise)",
        },
        diags,
    )
    if mode == "NONE" or not bs:
        out["disable_cuda_graph"] = True
        if mode != "NONE" and sizes:
            diags.append(
                F.lost(
                    ENGINE,
                    version,
                    "cudagraph.capture_sizes",
                    "graphs without decode graphs",
                    f"add a size between {q} and {decode_token_range(q, s.max_num_seqs)[-1]}",
                )
            )
    else:
        out.update(cuda_graph_bs=bs, cuda_graph_max_bs=bs[-1])
        if pieces:
            out.update(
                enable_piecewise_cuda_graph=True,
                piecewise_cuda_graph_tokens=pieces,
                piecewise_cuda_graph_max_tokens=pieces[-1],
            )
    if lora.enabled:
        out.update(enable_lora=True, max_loras_per_batch=lora.max_loras)
        if lora.specialize_count or lora.separate_base:
            diags.append(
                F.lost(
                    ENGINE,
                    version,
                    "lora",
                    "LoRA graphs per adapter count or base "
                    "graphs without LoRA (SGLang captures one LoRA graph per size)",
                    "set specialize_count: false and separate_base: false",
                )
            )
    if par.data_parallel_size > 1:
        out["dp_size"] = par.data_parallel_size
        diags.append(
            F.note(
                "parallel.data_parallel_size",
                "SGLang DP attention also needs --enable-dp-attention and a tp size",
            )
        )
    if par.tensor_parallel_size > 1:
        out["tp_size"] = par.tensor_parallel_size
    if par.ubatch.enabled:
        out["enable_two_batch_overlap"] = True
        diags.append(
            F.lost(
                ENGINE,
                version,
                "parallel.ubatch",
                "micro-batching thresholds and "
                "plain twins (two-batch overlap splits every eligible batch)",
            )
        )
    if cg.strict:
        diags.append(F.note("cudagraph.strict", "SGLang has no strict mode"))
    return out, diags


def render(cfg: dict, fmt: str, version: str, name: str) -> str:
    if fmt == "json":
        return json.dumps(cfg, indent=2) + "\n"
    lines = [
        f"# SGLang {version} flags for plan {name} (written by graphplan's plan export)",
        "# use: python -m sglang.launch_server --model-path MODEL $(grep -v '^#' this.args)",
    ]
    for key, value in cfg.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            lines.append(flag + " " + " ".join(map(str, value)))
        else:
            lines += F.shell_lines([(flag, value)])
    return "\n".join(lines) + "\n"


def read_args(words, version: str, allow_unknown: bool, file: str = "<args>"):
    """Flags -> settings; every option of the release (``flags_data/sglang-<version>.json``) is
    read, abbreviations as SGLang's argparse parser reads them."""
    from . import flag_reader
    from .cli_options import load_release

    return flag_reader.read_args(
        F.tokens_of(words),
        FLAGS,
        load_release(ENGINE, version),
        REMOVED.get(version, {}),
        ENGINE,
        file,
        allow_unknown,
    )


def read_config(path: str, version: str, allow_unknown: bool):
    """A YAML/JSON of ServerArgs fields or flag names (``cuda_graph_max_bs: 256``)."""
    from . import flag_reader
    from .cli_options import load_release

    return flag_reader.read_config(
        path,
        FLAGS,
        load_release(ENGINE, version),
        REMOVED.get(version, {}),
        ENGINE,
        allow_unknown,
        lambda n: n.replace("_", "-"),
    )


def to_draft(settings: dict, version: str) -> Draft:
    d, get = Draft(), settings.get
    d.put("name", "sglang-import", "plan name (change with --set name=...)")
    running = get("max_running_requests")
    if running:
        d.put("scheduler.max_num_seqs", running.value, running.source)
    else:
        d.assume(
            "scheduler.max_num_seqs",
            256,
            "SGLang sizes max_running_requests from KV-cache "
            "memory: give --set scheduler.max_num_seqs=N",
        )
    chunk, prefill = get("chunked_prefill_size"), get("max_prefill_tokens")
    if chunk and chunk.value > 0:
        d.put("scheduler.max_num_batched_tokens", chunk.value, chunk.source)
    elif prefill:
        d.put(
            "scheduler.max_num_batched_tokens",
            prefill.value,
            prefill.source + " (chunked prefill off)",
        )
    else:
        d.assume(
            "scheduler.max_num_batched_tokens",
            8192 if not chunk else 16384,
            "SGLang's chunked_prefill_size on an 80 GB GPU"
            if not chunk
            else "SGLang's max_prefill_tokens default (chunked prefill off)",
        )
    n, algorithm = get("speculative_num_draft_tokens"), get("speculative_algorithm")
    if n:
        d.put("scheduler.decode_query_len", n.value, n.source + " (verify width)")
    elif algorithm:
        d.assume(
            "scheduler.decode_query_len",
            1,
            f"{algorithm.source} without its verify width: give --set scheduler.decode_query_len=N",
        )
    d.assume("scheduler.decode_query_len", 1, "no speculative decoding")
    off = get("disable_cuda_graph")
    piece = get("enable_piecewise_cuda_graph")
    if off and off.value:
        d.put("cudagraph.mode", "NONE", off.source)
    elif piece and piece.value:
        d.put(
            "cudagraph.mode",
            "FULL_AND_PIECEWISE",
            "decode graphs (SGLang default) + " + piece.source,
        )
    else:
        d.assume(
            "cudagraph.mode",
            "FULL_DECODE_ONLY",
            "SGLang captures FULL graphs for decode "
            "batches; prefill runs eager without --enable-piecewise-cuda-graph",
        )
    d.assume(
        "cudagraph.attention_support",
        "UNIFORM_BATCH",
        "SGLang's backends run decode and spec-verify batches in graphs",
    )
    d.assume(
        "cudagraph.splitting_ops", ["attention"], "SGLang's piecewise graphs split at attention"
    )
    d.put("cudagraph.strict", False, "SGLang has no strict mode")
    on = get("enable_lora")
    if on and on.value:
        d.put("lora.enabled", True, on.source)
        m = get("max_loras_per_batch")
        d.put(
            "lora.max_loras",
            m.value if m else 8,
            m.source if m else "assumed: SGLang's default max_loras_per_batch",
        )
        d.put("lora.specialize_count", False, "SGLang captures one LoRA graph per size")
        d.put("lora.separate_base", False, "SGLang captures one LoRA graph per size")
    else:
        d.assume("lora.enabled", False, "no --enable-lora")
    dp = get("dp_size")
    d.put(
        "parallel.data_parallel_size",
        dp.value if dp else 1,
        dp.source if dp else "assumed: SGLang's default dp_size",
    )
    _tensor_parallel(d, get, dp)
    tbo = get("enable_two_batch_overlap")
    if tbo and tbo.value and dp and dp.value > 1:
        d.put("parallel.ubatch.enabled", True, tbo.source)
        d.put("parallel.ubatch.plain_twins", False, "SGLang captures no plain twin")
        d.note("two-batch overlap has no token thresholds; graphplan's defaults are assumed")
    elif tbo and tbo.value:
        d.note(f"{tbo.source}: ignored, graphplan micro-batches only across DP ranks")
    d.assume("parallel.ubatch.enabled", False, "no --enable-two-batch-overlap")
    d.pending = settings
    return d


def _tensor_parallel(d: Draft, get, dp) -> None:
    """Without DP attention SGLang runs dp_size replicas of tp_size GPUs each (world dp x tp);
    with it, tp_size is the world and attention is split dp_size ways, each over tp/dp GPUs."""
    tp = get("tp_size")
    if not tp:
        d.put("parallel.tensor_parallel_size", 1, "assumed: SGLang's default tp_size")
        return
    dpa = get("enable_dp_attention")
    if not (dpa and dpa.value and dp and dp.value > 1):
        d.put("parallel.tensor_parallel_size", tp.value, tp.source)
        return
    if tp.value % dp.value:
        raise F.input_error(
            tp.source,
            "bad-value",
            f"tp_size={tp.value} is not a multiple of dp_size={dp.value} (SGLang's DP attention "
            "splits the tp_size GPUs dp_size ways)",
            "make tp_size a multiple of dp_size",
        )
    d.put(
        "parallel.tensor_parallel_size",
        tp.value // dp.value,
        f"{tp.source} / {dp.source} (DP attention: each DP rank's attention over tp/dp GPUs)",
    )
    if tp.value > dp.value:
        d.note(
            f"{dpa.source}: the MLP runs over all {tp.value} GPUs in SGLang; graphplan's TP "
            f"groups are {tp.value // dp.value} GPUs for the whole layer"
        )


def finish_sizes(d: Draft, version: str) -> None:
    if "cudagraph.capture_sizes" in d.values:
        return
    from ..sizes import sglang_sizes
    from ..spec import SchedulerSpec

    get = d.pending.get
    seqs, q = d.count("scheduler.max_num_seqs"), d.count("scheduler.decode_query_len")
    tokens = d.count("scheduler.max_num_batched_tokens")
    top = get("cuda_graph_max_bs")
    if get("cuda_graph_bs"):
        bs = sorted(set(get("cuda_graph_bs").value))
        if bs[-1] > seqs:  # SGLang's runner caps at max_running_requests, adding it
            bs = [b for b in bs if b <= seqs] + [seqs]
        decode, why = [b * q for b in bs], get("cuda_graph_bs").source + " (x q tokens)"
    elif get("disable_cuda_graph_padding") and get("disable_cuda_graph_padding").value:
        m = min(top.value if top else 256, seqs)
        decode, why = list(range(q, m * q + 1, q)), "every batch size 1..max_bs (padding off)"
    else:
        sched = SchedulerSpec(max_num_seqs=seqs, max_num_batched_tokens=tokens, decode_query_len=q)
        decode = sglang_sizes(sched, top.value if top else 0)
        why = f"SGLang {version} default decode list, max_bs " + (
            top.source if top else "256 (assumed: its 80 GB GPU default)"
        )
        if d.values["cudagraph.mode"] != "FULL_AND_PIECEWISE":
            d.put(
                "cudagraph.capture_sizes",
                {"preset": "sglang", "max_size": top.value if top else 0},
                why,
            )
            return
    sizes = set(decode)
    if d.values["cudagraph.mode"] == "FULL_AND_PIECEWISE":
        pw = get("piecewise_cuda_graph_tokens")
        if pw:
            pieces, pwhy = pw.value, pw.source
        else:
            m = get("piecewise_cuda_graph_max_tokens")
            cap = m.value if m else tokens
            pieces = [
                t
                for t in (
                    list(range(4, 33, 4))
                    + list(range(48, 257, 16))
                    + list(range(288, 513, 32))
                    + list(range(576, 1025, 64))
                    + list(range(1280, 4097, 256))
                    + list(range(4608, cap + 1, 512))
                )
                if t <= cap
            ]
            pwhy = "SGLang's default piecewise tokens up to " + (
                m.source if m else "chunked_prefill_size"
            )
        sizes |= set(pieces)
        why += f" united with {pwhy}: graphplan captures both routines at every size"
    d.put("cudagraph.capture_sizes", sorted(sizes), why)
