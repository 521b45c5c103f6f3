"""TensorRT-LLM adapter (PyTorch backend): a plan <-> the extra LLM API options YAML
(``trtllm-serve --config`` / ``--extra_llm_api_options``), the ``LLM(**kwargs)`` dict, and the few
``trtllm-serve`` flags that exist. CUDA graphs there are decode-only (``cuda_graph_config``, batch
sizes in requests); piecewise prefill graphs come from ``torch_compile_config``
(``enable_piecewise_cuda_graph``, ``capture_num_tokens``). Sources: docs/engines.md.
"""

from __future__ import annotations

import json

from ..errors import Diagnostic
from ..sizes import trtllm_filtered, trtllm_generated
from . import flags as F
from . import trtllm_versions as V
from .draft import Draft
from .flags import Flag
from .trtllm_versions import DEFAULT_VERSION, VERSIONS, check_version  # noqa: F401 (API)

ENGINE = "trtllm"
FORMATS = ("yaml", "args", "json")
BIG = 1 << 20
FLAGS = {
    "--max_batch_size": Flag("max_batch_size", "int", 1, 65536),
    "--max_num_tokens": Flag("max_num_tokens", "int", 1, BIG),
    "--tp_size": Flag("tensor_parallel_size", "int", 1, 64),
}
IGNORED = set(
    """--host --port --backend --pp_size --ep_size --cluster_size
--gpus_per_node --kv_cache_free_gpu_memory_fraction --max_seq_len --trust_remote_code
--log_level --tokenizer --num_postprocess_workers --reasoning_parser --extra_llm_api_options
--config""".split()
)
TOP_KEYS = {
    "max_batch_size",
    "max_num_tokens",
    "cuda_graph_config",
    "torch_compile_config",
    "speculative_config",
    "lora_config",
    "enable_attention_dp",
    "tensor_parallel_size",
}
IGNORED_KEYS = {
    "kv_cache_config",
    "print_iter_log",
    "stream_interval",
    "attn_backend",
    "compile_backend",
    "max_seq_len",
    "num_postprocess_workers",
    "backend",
    "enable_chunked_prefill",
    "disable_overlap_scheduler",
    "moe_config",
    "pipeline_parallel_size",
    "moe_expert_parallel_size",
    "enable_iter_perf_stats",
    "trust_remote_code",
    "scheduler_config",
    "model_kwargs",
    "runtime",
    "world_size",
    "max_beam_width",
    "enable_autotuner",
    "sampler_type",
    "cache_transceiver_config",
}
GRAPH_KEYS = {"batch_sizes", "max_batch_size", "enable_padding"}


def export_config(spec, mode: str, sizes: tuple, version: str) -> tuple[dict, list]:
    s, lora, par = spec.scheduler, spec.lora, spec.parallel
    q = s.decode_query_len
    diags: list[Diagnostic] = []
    out: dict = {"max_batch_size": s.max_num_seqs, "max_num_tokens": s.max_num_batched_tokens}
    mode, bs, pieces = F.engine_routines(
        ENGINE,
        version,
        mode,
        sizes,
        q,
        s.max_num_seqs,
        {
            "PIECEWISE": "PIECEWISE graphs for decode batches (its decode graphs are FULL)",
            "FULL": "FULL graphs for mixed batches (its CUDA graphs are decode-only)",
        },
        diags,
    )
    if mode == "NONE" or not bs:
        out["cuda_graph_config"] = None
    else:
        out["cuda_graph_config"] = {
            "batch_sizes": bs,
            "max_batch_size": bs[-1],
            "enable_padding": True,
        }
        if pieces:
            out["torch_compile_config"] = {
                "enable_piecewise_cuda_graph": True,
                "capture_num_tokens": pieces,
            }
    if q > 1:
        out["speculative_config"] = {"max_draft_len": q - 1}
        diags.append(
            F.note(
                "scheduler.decode_query_len",
                "add decoding_type and the draft model to speculative_config",
            )
        )
    if lora.enabled:
        out["lora_config"] = {"max_loras": lora.max_loras}
        if lora.specialize_count or lora.separate_base:
            diags.append(
                F.lost(
                    ENGINE,
                    version,
                    "lora",
                    "LoRA graphs per adapter count or base graphs (one LoRA graph per batch size)",
                    "set specialize_count: false and separate_base: false",
                )
            )
    dp, tp = par.data_parallel_size, par.tensor_parallel_size
    if dp > 1:
        out.update(enable_attention_dp=True, tensor_parallel_size=dp * tp)
        diags.append(
            F.note(
                "parallel.data_parallel_size",
                "exported as attention DP over tensor_parallel_size ranks",
            )
        )
        if tp > 1:
            diags.append(
                F.lost(
                    ENGINE,
                    version,
                    "parallel.tensor_parallel_size",
                    f"DP {dp} x TP {tp} (with enable_attention_dp every one of the "
                    f"{dp * tp} ranks runs attention on its own requests; there is no TP group "
                    "inside a DP rank)",
                    "use data_parallel_size: 1 for a TP plan, or tensor_parallel_size: 1",
                )
            )
    elif tp > 1:
        out["tensor_parallel_size"] = tp
    if par.ubatch.enabled:
        diags.append(F.lost(ENGINE, version, "parallel.ubatch", "micro-batching (DBO)"))
    if spec.cudagraph.strict:
        diags.append(F.note("cudagraph.strict", "TensorRT-LLM has no strict mode"))
    return out, diags


def render(cfg: dict, fmt: str, version: str, name: str) -> str:
    head = f"TensorRT-LLM {version} settings for plan {name} (written by graphplan's plan export)"
    if fmt == "json":
        return json.dumps(cfg, indent=2) + "\n"
    if fmt == "args":
        return (
            f"# {head}\n# CUDA-graph settings have no trtllm-serve flag: pass the yaml "
            "export with --config\n"
            + "\n".join(
                F.shell_lines(
                    [
                        ("--max_batch_size", cfg["max_batch_size"]),
                        ("--max_num_tokens", cfg["max_num_tokens"]),
                    ]
                    + (
                        [("--tp_size", cfg["tensor_parallel_size"])]
                        if "tensor_parallel_size" in cfg and "enable_attention_dp" not in cfg
                        else []
                    )
                )
            )
            + "\n"
        )
    import yaml

    body = yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=100)
    return f"# {head}\n# use: trtllm-serve MODEL --config this.yaml\n{body}"


def read_args(words, version: str, allow_unknown: bool, file: str = "<args>"):
    return F.read_flags(F.tokens_of(words), FLAGS, IGNORED, {}, ENGINE, file, allow_unknown)


def read_config(path: str, version: str, allow_unknown: bool):
    data, pos = F.read_yaml_file(path)
    if not isinstance(data, dict):
        raise F.input_error(
            path, "not-a-mapping", "expected LLM API options (`key: value`)", "", 1, 1
        )
    out, notes = {}, []

    def at(*path):
        return pos.get(tuple(path) + ("<key>",), pos.get(tuple(path), (0, 0)))

    for key, value in data.items():
        line, col = at(key)
        if key in IGNORED_KEYS:
            continue
        if key not in TOP_KEYS:
            hint = F.did_you_mean(key, sorted(TOP_KEYS | IGNORED_KEYS))
            if allow_unknown:
                notes.append(F.note("", f"{path}:{line}: {key}: unknown key ignored", hint))
                continue
            raise F.input_error(
                path,
                "unknown-key",
                f"{key}: not an LLM API option graphplan knows",
                (hint + " Or " if hint else "") + "pass --ignore-unknown to skip it",
                line,
                col,
            )
        if key in ("max_batch_size", "max_num_tokens", "tensor_parallel_size"):
            value = F.to_int(value, key, 1, BIG, path, col, line)
        elif key == "cuda_graph_config" and value is not None:
            _check_graph_config(value, path, at)
        out[key] = F.Setting(value, f"{path}:{line} {key}")
    return out, notes


def _check_graph_config(cfg, path: str, at) -> None:
    if not isinstance(cfg, dict):
        raise F.input_error(
            path,
            "bad-value",
            "cuda_graph_config: expected a mapping or null",
            "",
            *at("cuda_graph_config"),
        )
    for key, value in cfg.items():
        line, col = at("cuda_graph_config", key)
        if key == "padding_enabled":
            raise F.input_error(
                path,
                "flag-not-in-version",
                "cuda_graph_config.padding_enabled "
                "was renamed enable_padding (TensorRT-LLM PR #5795, 2025-07)",
                "write enable_padding",
                line,
                col,
            )
        if key not in GRAPH_KEYS:
            raise F.input_error(
                path,
                "unknown-key",
                f"cuda_graph_config.{key}: not a CudaGraphConfig field",
                F.did_you_mean(key, sorted(GRAPH_KEYS)),
                line,
                col,
            )
        if key == "batch_sizes":
            if not isinstance(value, list) or not value:
                raise F.input_error(
                    path,
                    "bad-value",
                    "cuda_graph_config.batch_sizes: expected a list of batch sizes",
                    "",
                    line,
                    col,
                )
            for v in value:
                F.to_int(v, "cuda_graph_config.batch_sizes", 1, 65536, path, col, line)
        elif key == "max_batch_size":
            F.to_int(value, "cuda_graph_config.max_batch_size", 0, 65536, path, col, line)


def to_draft(settings: dict, version: str) -> Draft:
    d, get = Draft(), settings.get
    d.put("name", "trtllm-import", "plan name (change with --set name=...)")
    for key, path, default in (
        ("max_batch_size", "scheduler.max_num_seqs", 2048),
        ("max_num_tokens", "scheduler.max_num_batched_tokens", 8192),
    ):
        given = get(key)
        if given:
            d.put(path, given.value, given.source)
        else:
            d.assume(path, default, f"TensorRT-LLM's default {key}")
    spec = get("speculative_config")
    if spec and spec.value:
        n = spec.value.get("max_draft_len", spec.value.get("num_nextn_predict_layers"))
        if n is not None:
            d.put("scheduler.decode_query_len", 1 + int(n), f"1 + max_draft_len ({spec.source})")
        else:
            d.assume(
                "scheduler.decode_query_len",
                1,
                f"{spec.source} has no max_draft_len: give --set scheduler.decode_query_len=N",
            )
    d.assume("scheduler.decode_query_len", 1, "no speculative_config")
    graph = get("cuda_graph_config")
    tcc = get("torch_compile_config")
    tc = (tcc.value or {}) if tcc else {}
    if graph and graph.value is None:
        d.put("cudagraph.mode", "NONE", f"{graph.source}: null")
    elif tc.get("enable_piecewise_cuda_graph"):
        d.put(
            "cudagraph.mode",
            "FULL_AND_PIECEWISE",
            "decode graphs + torch_compile_config.enable_piecewise_cuda_graph",
        )
    else:
        d.assume(
            "cudagraph.mode",
            "FULL_DECODE_ONLY",
            "TensorRT-LLM's CUDA graphs are decode-only (cuda_graph_config is on by default)",
        )
    d.assume(
        "cudagraph.attention_support",
        "UNIFORM_BATCH",
        "its decode graphs run spec-verify batches too",
    )
    d.assume("cudagraph.splitting_ops", ["attention"], "piecewise graphs split at attention")
    d.put("cudagraph.strict", False, "TensorRT-LLM has no strict mode")
    lc = get("lora_config")
    if lc and lc.value:
        d.put("lora.enabled", True, lc.source)
        d.put("lora.max_loras", int(lc.value.get("max_loras", 4)), lc.source + " max_loras")
        d.put("lora.specialize_count", False, "one LoRA graph per batch size")
        d.put("lora.separate_base", False, "one LoRA graph per batch size")
    else:
        d.assume("lora.enabled", False, "no lora_config")
    attention_dp = get("enable_attention_dp")
    if attention_dp and attention_dp.value:
        tp = get("tensor_parallel_size")
        d.put(
            "parallel.data_parallel_size",
            tp.value if tp else 1,
            "attention DP over " + (tp.source if tp else "tensor_parallel_size (default 1)"),
        )
    else:
        tp = get("tensor_parallel_size")
        if tp:
            d.put("parallel.tensor_parallel_size", tp.value, tp.source)
    d.assume("parallel.data_parallel_size", 1, "no enable_attention_dp")
    d.assume("parallel.tensor_parallel_size", 1, "TensorRT-LLM's default tensor_parallel_size")
    d.pending = (graph.value if graph else {}, graph.source if graph else "", tc)
    return d


def finish_sizes(d: Draft, version: str) -> None:
    """Capture sizes as TensorRT-LLM builds them: ``batch_sizes``, or the release's generated
    list for ``cuda_graph_config.max_batch_size`` (default 128); then its model engine's filter
    at ``min(max_batch_size, max_num_tokens // q)`` (``compiler.sizes.trtllm_filtered``)."""
    if "cudagraph.capture_sizes" in d.values or d.values["cudagraph.mode"] == "NONE":
        d.assume("cudagraph.capture_sizes", [], "CUDA graphs off")
        return
    graph, src, tc = d.pending
    seqs, q = d.count("scheduler.max_num_seqs"), d.count("scheduler.decode_query_len")
    tokens = d.count("scheduler.max_num_batched_tokens")
    graph = graph or {}
    padding = bool(graph.get("enable_padding", False))
    if graph.get("batch_sizes"):
        given, why = sorted(set(graph["batch_sizes"])), f"{src} batch_sizes (x q tokens)"
    else:
        top, rule = graph.get("max_batch_size") or 128, V.size_rule(version)
        given = trtllm_generated(top, padding, rule)
        why = (
            f"TensorRT-LLM {version} default list for max_batch_size {top}"
            f"{', padded' if padding else ''} ({V.RULE_TEXT[rule]})"
        )
        if V.rule_note(version):
            d.note(V.rule_note(version), "pass the --engine-version of the release you run")
    kept = trtllm_filtered(given, seqs, tokens, q, padding)
    if kept != given:
        why += f", cut at min(max_batch_size {seqs}, max_num_tokens {tokens} // {q})" + (
            " with the cap added (padding)" if padding and kept and kept[-1] not in given else ""
        )
    if not padding:
        d.note(
            "without enable_padding TensorRT-LLM runs a batch whose size is not captured "
            "eagerly; graphplan pads it to the next captured size",
            "export sets enable_padding: true",
        )
    sizes = {b * q for b in kept}
    if d.values["cudagraph.mode"] == "FULL_AND_PIECEWISE":
        # the engine's piecewise token counts: capture_num_tokens, else the config's batch sizes
        pieces = tc.get("capture_num_tokens") or given
        sizes |= {n for n in pieces if n <= tokens}
        why += (
            " united with torch_compile_config.capture_num_tokens"
            if tc.get("capture_num_tokens")
            else " united with the same numbers as piecewise token counts"
        )
    d.put("cudagraph.capture_sizes", sorted(sizes), why)
