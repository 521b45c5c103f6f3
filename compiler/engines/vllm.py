"""vLLM adapter: a plan -> ``vllm serve`` flags / ``--config`` YAML / EngineArgs JSON, and vLLM
flags, config files and (``vllm_log``) logs -> a plan. The rules vLLM applies to what it reads live
in ``vllm_rules``; ``FLAGS`` are the options that shape graphs, every other option of the release
(``flags_data/vllm-<version>.json``) is accepted and ignored (docs/engines.md).
"""

from __future__ import annotations

import json

from . import flags as F
from . import vllm_rules as R
from .flags import Flag
from .vllm_import import finish_sizes, to_draft  # noqa: F401 (API)

ENGINE = "vllm"
VERSIONS, DEFAULT_VERSION = R.VERSIONS, R.DEFAULT_VERSION
FORMATS = ("args", "yaml", "json")

FLAGS = {
    "--max-num-seqs": Flag("max_num_seqs", "int", 1, 65536),
    "--max-num-batched-tokens": Flag("max_num_batched_tokens", "int", 1, 1 << 20),
    "--speculative-config": Flag("speculative_config", "json"),
    "--enable-lora": Flag("enable_lora", "bool"),
    "--no-enable-lora": Flag("enable_lora", "negbool"),
    "--max-loras": Flag("max_loras", "int", 1, 256),
    "--specialize-active-lora": Flag("specialize_active_lora", "bool"),
    "--no-specialize-active-lora": Flag("specialize_active_lora", "negbool"),
    "--data-parallel-size": Flag("data_parallel_size", "int", 1, 1024),
    "-dp": Flag("data_parallel_size", "int", 1, 1024),
    "--tensor-parallel-size": Flag("tensor_parallel_size", "int", 1, 64),
    "-tp": Flag("tensor_parallel_size", "int", 1, 64),
    "--enable-dbo": Flag("enable_dbo", "bool"),
    "--no-enable-dbo": Flag("enable_dbo", "negbool"),
    "--dbo-decode-token-threshold": Flag("dbo_decode_token_threshold", "int", 1, 1 << 20),
    "--dbo-prefill-token-threshold": Flag("dbo_prefill_token_threshold", "int", 1, 1 << 20),
    "--enforce-eager": Flag("enforce_eager", "bool"),
    "--no-enforce-eager": Flag("enforce_eager", "negbool"),
    "--compilation-config": Flag("compilation_config", "json"),
    "-cc": Flag("compilation_config", "json"),
    "-O": Flag("compilation_config", "json"),  # 0.11; later -O<n> is --optimization-level
    "--cudagraph-capture-sizes": Flag("cudagraph_capture_sizes", "ints", 1, 1 << 20),
    "--max-cudagraph-capture-size": Flag("max_cudagraph_capture_size", "int", 1, 1 << 20),
    "--cuda-graph-sizes": Flag("cuda_graph_sizes", "ints", 1, 1 << 20),
    "--optimization-level": Flag("optimization_level", "int", 0, 3),
    "--performance-mode": Flag("performance_mode", "str"),
}
# Flags a version lacks: flag -> why (an error: the engine would refuse it).
REMOVED = {
    "0.11": {
        "--specialize-active-lora": "vLLM 0.11 has no --specialize-active-lora (added by "
        "PR #32005, 2026-01); use --engine-version 0.15",
        "--no-specialize-active-lora": "vLLM 0.11 has no --specialize-active-lora",
    },
}


def normalise(name: str) -> str:
    """vLLM's parser accepts ``--max_num_seqs`` for ``--max-num-seqs``; ``-O3`` for the level."""
    if name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    return name


# -- export ----------------------------------------------------------------------------------


def export_config(spec, mode: str, sizes: tuple, version: str) -> tuple[dict, list]:
    """The EngineArgs keyword dict for a plan (resolved ``mode``, compiled ``sizes``)."""
    s, cg, lora, par = spec.scheduler, spec.cudagraph, spec.lora, spec.parallel
    ub, diags = par.ubatch, []
    out: dict = {"max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens}
    if s.decode_query_len > 1:
        out["speculative_config"] = {"num_speculative_tokens": s.decode_query_len - 1}
        diags.append(
            F.note(
                "scheduler.decode_query_len",
                "speculative_config carries only num_speculative_tokens",
                "add the method and draft model",
            )
        )
    if mode == "NONE" or not sizes:
        out["enforce_eager"] = True
        if lora.enabled:  # eager keeps the LoRA setting: a re-import must read the same plan
            out["compilation_config"] = {"cudagraph_specialize_lora": lora.separate_base}
        if mode != "NONE":
            diags.append(
                F.note(
                    "cudagraph.capture_sizes",
                    "no capture size survives: exported "
                    "as --enforce-eager (every step eager, as in the plan)",
                )
            )
    else:
        cc: dict = {
            "cudagraph_mode": mode,
            "cudagraph_capture_sizes": list(sizes),
            "max_cudagraph_capture_size": max(sizes),
        }
        if list(cg.splitting_ops) != ["attention"]:
            cc["splitting_ops"] = [
                o
                for op in cg.splitting_ops
                for o in (R.ATTENTION_OPS if op == "attention" else (op,))
            ]
        if lora.enabled:
            cc["cudagraph_specialize_lora"] = lora.separate_base
        out["compilation_config"] = cc
        if mode != cg.mode.name:
            diags.append(
                F.note(
                    "cudagraph.mode",
                    f"exported the resolved mode {mode} (the plan "
                    f"asks for {cg.mode.name}; attention_support "
                    f"{cg.attention_support.name} lowers it)",
                )
            )
        if "FULL" in mode:
            diags.append(
                F.note(
                    "cudagraph.attention_support",
                    "vLLM takes graph support from "
                    f"its attention backend: use one with {cg.attention_support.name} "
                    "or stronger, or vLLM lowers the mode further",
                )
            )
    if lora.enabled:
        out.update(enable_lora=True, max_loras=lora.max_loras)
        if lora.specialize_count:
            if version == "0.11":
                diags.append(
                    F.lost(
                        ENGINE,
                        version,
                        "lora.specialize_count",
                        "per-count LoRA graphs (one LoRA graph per size instead)",
                        "use --engine-version 0.15, or specialize_count: false",
                    )
                )
            elif not lora.separate_base:
                diags.append(
                    F.lost(
                        ENGINE,
                        version,
                        "lora.specialize_count",
                        "per-count LoRA "
                        "graphs without base graphs (vLLM honours "
                        "specialize_active_lora only with cudagraph_specialize_lora)",
                        "set lora.separate_base: true",
                    )
                )
            else:
                out["specialize_active_lora"] = True
    if par.data_parallel_size > 1:
        out["data_parallel_size"] = par.data_parallel_size
    if par.tensor_parallel_size > 1:
        out["tensor_parallel_size"] = par.tensor_parallel_size
    if ub.enabled:
        out.update(
            enable_dbo=True,
            dbo_decode_token_threshold=ub.decode_token_threshold,
            dbo_prefill_token_threshold=ub.prefill_token_threshold,
        )
        if ub.num_ubatches != 2:
            diags.append(
                F.lost(
                    ENGINE,
                    version,
                    "parallel.ubatch.num_ubatches",
                    f"{ub.num_ubatches} micro-batches (DBO runs 2)",
                    "use 2",
                )
            )
        if ub.plain_twins:
            diags.append(
                F.lost(
                    ENGINE,
                    version,
                    "parallel.ubatch.plain_twins",
                    "plain twins (an aborted micro-batch runs eager in vLLM)",
                    "set plain_twins: false to match vLLM",
                )
            )
    if cg.strict:
        diags.append(
            F.note(
                "cudagraph.strict",
                "vLLM has no strict mode: it logs downgrades "
                "and dropped sizes (graphplan checked them at compile time)",
            )
        )
    return out, diags


def render(cfg: dict, fmt: str, version: str, name: str) -> str:
    head = f"vLLM {version} configuration for plan {name} (written by graphplan's plan export)"
    if fmt == "json":
        return json.dumps(cfg, indent=2) + "\n"
    pairs = []
    for key, value in cfg.items():
        if key in ("speculative_config", "compilation_config"):
            value = json.dumps(value, separators=(", ", ": "))
        pairs.append((key.replace("_", "-"), value))
    if fmt == "yaml":
        lines = [f"# {head}", "# use: vllm serve MODEL --config this.yaml"]
        for key, value in pairs:
            text = (
                "true"
                if value is True
                else (json.dumps(value) if isinstance(value, str) else str(value))
            )
            lines.append(f"{key}: {text}")
        return "\n".join(lines) + "\n"
    lines = F.shell_lines(
        [("--" + k, json.loads(v) if k.endswith("config") else v) for k, v in pairs]
    )
    # the whole command on one line, each word shell-quoted: pasted into a shell, the JSON of
    # --compilation-config stays one argument (``$(cat this.args)`` would split it into words)
    use = "# use: " + " ".join(["vllm serve MODEL"] + lines)
    return f"# {head}\n{use}\n" + "\n".join(lines) + "\n"


# -- import ----------------------------------------------------------------------------------


def read_args(words, version: str, allow_unknown: bool, file: str = "<args>"):
    """Flags -> settings, after the rewriting vLLM's FlexibleArgumentParser does first."""
    from . import flag_reader
    from .cli_options import load_release
    from .vllm_args import flexible

    words, folded = flexible(F.tokens_of(words), version)
    settings, notes = flag_reader.read_args(
        words,
        FLAGS,
        load_release(ENGINE, version),
        REMOVED.get(version, {}),
        ENGINE,
        file,
        allow_unknown,
        normalise,
    )
    if "compilation_config" in settings and folded:
        cc = settings["compilation_config"]
        settings["compilation_config"] = F.Setting(cc.value, folded)
    return settings, notes


def read_config(path: str, version: str, allow_unknown: bool):
    """``vllm serve --config`` YAML: keys are flag names (``max-num-seqs: 128``)."""
    from . import flag_reader
    from .cli_options import load_release

    return flag_reader.read_config(
        path,
        FLAGS,
        load_release(ENGINE, version),
        REMOVED.get(version, {}),
        ENGINE,
        allow_unknown,
        normalise,
    )


def read_log(path: str):
    from pathlib import Path

    from ..load import read_text
    from .vllm_log import read_log as parse

    return parse(read_text(Path(path)), path)
