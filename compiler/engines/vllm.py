"""vLLM adapter: a plan -> ``vllm serve`` flags / ``--config`` YAML / EngineArgs JSON, and vLLM
flags, config files and (``vllm_log``) logs -> a plan. The rules vLLM applies to what it reads live
in ``vllm_rules``; flag names are checked against vLLM's source (docs/engines.md).
"""

from __future__ import annotations

import json

from graphplan.compiler.engines import flags as F
from graphplan.compiler.engines import vllm_rules as R
from graphplan.compiler.engines.flags import Flag

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
    "--enable-dbo": Flag("enable_dbo", "bool"),
    "--no-enable-dbo": Flag("enable_dbo", "negbool"),
    "--dbo-decode-token-threshold": Flag("dbo_decode_token_threshold", "int", 1, 1 << 20),
    "--dbo-prefill-token-threshold": Flag("dbo_prefill_token_threshold", "int", 1, 1 << 20),
    "--enforce-eager": Flag("enforce_eager", "bool"),
    "--no-enforce-eager": Flag("enforce_eager", "negbool"),
    "--compilation-config": Flag("compilation_config", "json"),
    "-cc": Flag("compilation_config", "json"),
    "--cudagraph-capture-sizes": Flag("cudagraph_capture_sizes", "ints", 1, 1 << 20),
    "--max-cudagraph-capture-size": Flag("max_cudagraph_capture_size", "int", 1, 1 << 20),
    "--cuda-graph-sizes": Flag("cuda_graph_sizes", "ints", 1, 1 << 20),
    "--optimization-level": Flag("optimization_level", "int", 0, 3),
}
# Flags vLLM has that do not shape CUDA graphs (their values are skipped).
IGNORED = set("""--model --host --port --served-model-name --tensor-parallel-size -tp
--pipeline-parallel-size -pp --gpu-memory-utilization --max-model-len --trust-remote-code --dtype
--quantization -q --kv-cache-dtype --enable-prefix-caching --no-enable-prefix-caching
--enable-chunked-prefill --no-enable-chunked-prefill --task --limit-mm-per-prompt
--disable-custom-all-reduce --max-log-len --seed --download-dir --lora-modules --max-lora-rank
--max-cpu-loras --lora-dtype --fully-sharded-loras --enable-expert-parallel -ep --all2all-backend
--async-scheduling --no-async-scheduling --block-size --swap-space --api-key --chat-template
--tokenizer --tokenizer-mode --revision --load-format --attention-backend --uvicorn-log-level
--disable-log-requests --disable-log-stats --enable-log-requests --enable-auto-tool-choice
--tool-call-parser --reasoning-parser --kv-transfer-config --distributed-executor-backend
--max-num-partial-prefills --long-prefill-token-threshold --scheduling-policy --hf-overrides
--generation-config --override-generation-config --mm-processor-kwargs --enable-sleep-mode
--model-impl --data-parallel-rank -dpn --data-parallel-start-rank -dpr --data-parallel-size-local
-dpl --data-parallel-address -dpa --data-parallel-rpc-port -dpp --data-parallel-backend -dpb
--data-parallel-hybrid-lb --data-parallel-external-lb --headless --enable-eplb --eplb-config
--disable-nccl-for-dp-synchronization --ubatch-size --allowed-origins --root-path --ssl-keyfile
--ssl-certfile --max-seq-len-to-capture --num-gpu-blocks-override --cpu-offload-gb
--disable-sliding-window --disable-cascade-attn --enable-prompt-embeds --structured-outputs-config
--kv-events-config --additional-config --cuda-graph-max-size""".split())
# Flags a version lacks: flag -> why (an error: the engine would refuse it).
REMOVED = {
    "0.11": {"--specialize-active-lora": "vLLM 0.11 has no --specialize-active-lora (added by "
             "PR #32005, 2026-01); use --engine-version 0.15",
             "--no-specialize-active-lora": "vLLM 0.11 has no --specialize-active-lora"},
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
        diags.append(F.note("scheduler.decode_query_len", "speculative_config carries only "
                            "num_speculative_tokens", "add the method and draft model"))
    if mode == "NONE" or not sizes:
        out["enforce_eager"] = True
        if mode != "NONE":
            diags.append(F.note("cudagraph.capture_sizes", "no capture size survives: exported "
                                "as --enforce-eager (every step eager, as in the plan)"))
    else:
        cc: dict = {"cudagraph_mode": mode, "cudagraph_capture_sizes": list(sizes),
                    "max_cudagraph_capture_size": max(sizes)}
        if list(cg.splitting_ops) != ["attention"]:
            cc["splitting_ops"] = [o for op in cg.splitting_ops
                                   for o in (R.ATTENTION_OPS if op == "attention" else (op,))]
        if lora.enabled:
            cc["cudagraph_specialize_lora"] = lora.separate_base
        out["compilation_config"] = cc
        if mode != cg.mode.name:
            diags.append(F.note("cudagraph.mode", f"exported the resolved mode {mode} (the plan "
                                f"asks for {cg.mode.name}; attention_support "
                                f"{cg.attention_support.name} lowers it)"))
        if "FULL" in mode:
            diags.append(F.note("cudagraph.attention_support", "vLLM takes graph support from "
                                f"its attention backend: use one with {cg.attention_support.name} "
                                "or stronger, or vLLM lowers the mode further"))
    if lora.enabled:
        out.update(enable_lora=True, max_loras=lora.max_loras)
        if lora.specialize_count:
            if version == "0.11":
                diags.append(F.lost(ENGINE, version, "lora.specialize_count", "per-count LoRA "
                                    "graphs (one LoRA graph per size instead)",
                                    "use --engine-version 0.15, or specialize_count: false"))
            elif not lora.separate_base:
                diags.append(F.lost(ENGINE, version, "lora.specialize_count", "per-count LoRA "
                                    "graphs without base graphs (vLLM honours "
                                    "specialize_active_lora only with cudagraph_specialize_lora)",
                                    "set lora.separate_base: true"))
            else:
                out["specialize_active_lora"] = True
    if par.data_parallel_size > 1:
        out["data_parallel_size"] = par.data_parallel_size
    if ub.enabled:
        out.update(enable_dbo=True, dbo_decode_token_threshold=ub.decode_token_threshold,
                   dbo_prefill_token_threshold=ub.prefill_token_threshold)
        if ub.num_ubatches != 2:
            diags.append(F.lost(ENGINE, version, "parallel.ubatch.num_ubatches",
                                f"{ub.num_ubatches} micro-batches (DBO runs 2)", "use 2"))
        if ub.plain_twins:
            diags.append(F.lost(ENGINE, version, "parallel.ubatch.plain_twins", "plain twins (an "
                                "aborted micro-batch runs eager in vLLM)",
                                "set plain_twins: false to match vLLM"))
    if cg.strict:
        diags.append(F.note("cudagraph.strict", "vLLM has no strict mode: it logs downgrades "
                            "and dropped sizes (graphplan checked them at compile time)"))
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
            text = "true" if value is True else (json.dumps(value) if isinstance(value, str)
                                                 else str(value))
            lines.append(f"{key}: {text}")
        return "\n".join(lines) + "\n"
    lines = F.shell_lines([("--" + k, json.loads(v) if k.endswith("config") else v)
                           for k, v in pairs])
    return f"# {head}\n# use: vllm serve MODEL $(grep -v '^#' this.args)\n" + "\n".join(lines) + "\n"


# -- import ----------------------------------------------------------------------------------


def read_args(words, version: str, allow_unknown: bool, file: str = "<args>"):
    """Flags -> settings; ``-cc.key=value`` and ``-O<n>`` spellings are folded in."""
    plain, dotted, level = [], {}, None
    for w in F.tokens_of(words):
        head, eq, value = w.partition("=")
        if head.startswith(("-cc.", "--compilation-config.")) and eq:
            key = head.split(".", 1)[1]
            try:
                dotted[key] = F.Setting(json.loads(value), w)
            except json.JSONDecodeError:
                dotted[key] = F.Setting(value, w)
        elif len(w) == 3 and w.startswith("-O") and w[2].isdigit():
            level = F.Setting(int(w[2]), w)
        else:
            plain.append(w)
    settings, notes = F.read_flags(plain, FLAGS, IGNORED, REMOVED.get(version, {}), ENGINE, file,
                                   allow_unknown, normalise)
    if level:
        settings["optimization_level"] = level
    if dotted:
        cc = dict(settings["compilation_config"].value) if "compilation_config" in settings else {}
        cc.update({k: s.value for k, s in dotted.items()})
        settings["compilation_config"] = F.Setting(cc, " ".join(s.source for s in dotted.values()))
    return settings, notes


def to_draft(settings: dict, version: str) -> F.Draft:
    """vLLM settings -> plan values, each with its source or the default vLLM assumes."""
    d, get = F.Draft(), settings.get
    d.put("name", "vllm-import", "plan name (change with --set name=...)")
    for key, default, why in (("max_num_seqs", 256, "EngineArgs fallback; vLLM raises it on "
                               "large GPUs: give --set scheduler.max_num_seqs=N"),
                              ("max_num_batched_tokens", 8192, "vllm serve's default with "
                               "chunked prefill; give --set scheduler.max_num_batched_tokens=N")):
        if key in settings:
            d.put(f"scheduler.{key}", settings[key].value, settings[key].source)
        else:
            d.assume(f"scheduler.{key}", default, why)
    spec = get("speculative_config")
    q = 1
    if spec and spec.value:
        n = spec.value.get("num_speculative_tokens", spec.value.get("num_spec_tokens"))
        if n is None:
            raise F.input_error("<vllm>", "missing-value", f"{spec.source}: no "
                                "num_speculative_tokens", "give --set scheduler.decode_query_len=N")
        q = 1 + F.to_int(n, spec.source, 0, 63, "<vllm>")
        d.put("scheduler.decode_query_len", q, f"1 + num_speculative_tokens ({spec.source})")
    else:
        d.assume("scheduler.decode_query_len", 1, "no speculative decoding")
    cc = dict(get("compilation_config").value) if get("compilation_config") else {}
    cc_src = get("compilation_config").source if cc else ""
    _mode(d, settings, cc, cc_src)
    d.assume("cudagraph.attention_support", "UNIFORM_BATCH", "vLLM reads it from the attention "
             "backend (FlashAttention 3: --set cudagraph.attention_support=ALWAYS)")
    ops = cc.get("splitting_ops")
    if ops is None:
        d.assume("cudagraph.splitting_ops", ["attention"], "vLLM splits at its attention ops")
    else:
        attn = set(R.ATTENTION_OPS) | {o.replace("::", ".") for o in R.ATTENTION_OPS}
        names = (["attention"] if any(o in attn for o in ops) else []) + \
            [o for o in ops if o not in attn]
        d.put("cudagraph.splitting_ops", names, f"compilation_config.splitting_ops ({cc_src})")
    d.put("cudagraph.strict", False, "vLLM has no strict mode (it logs downgrades)")
    _lora(d, settings, cc)
    _parallel(d, settings)
    d.pending = (cc, cc_src, settings)  # sizes need the final scheduler values (see finish)
    return d


def _mode(d: F.Draft, settings: dict, cc: dict, src: str) -> None:
    if settings.get("enforce_eager") and settings["enforce_eager"].value:
        d.put("cudagraph.mode", "NONE", settings["enforce_eager"].source)
    elif cc.get("cudagraph_mode") is not None:
        mode = str(cc["cudagraph_mode"]).upper()
        if mode not in ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
            raise F.input_error("<vllm>", "bad-value", f"{src}: cudagraph_mode {mode!r} is not a "
                                "vLLM CUDAGraphMode", "NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or "
                                "FULL_AND_PIECEWISE")
        d.put("cudagraph.mode", mode, f"compilation_config.cudagraph_mode ({src})")
    elif cc.get("full_cuda_graph") or cc.get("use_cudagraph") is not None:  # vLLM <= 0.10
        mode = "FULL" if cc.get("full_cuda_graph") else (
            "PIECEWISE" if cc.get("use_cudagraph") else "NONE")
        d.put("cudagraph.mode", mode, f"compilation_config use_cudagraph/full_cuda_graph ({src}; "
              "vLLM <= 0.10 spelling)")
    elif settings.get("optimization_level"):
        lvl = settings["optimization_level"]
        d.put("cudagraph.mode", ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE",
                                 "FULL_AND_PIECEWISE")[lvl.value], f"{lvl.source} (its mode)")
    else:
        d.assume("cudagraph.mode", "FULL_AND_PIECEWISE", "vLLM's default cudagraph_mode (-O2)")


def _lora(d: F.Draft, settings: dict, cc: dict) -> None:
    on = settings.get("enable_lora")
    if not (on and on.value):
        d.assume("lora.enabled", False, "no --enable-lora")
        return
    d.put("lora.enabled", True, on.source)
    m = settings.get("max_loras")
    if m:
        d.put("lora.max_loras", m.value, m.source)
    else:
        d.assume("lora.max_loras", 1, "vLLM's default max_loras")
    base = bool(cc.get("cudagraph_specialize_lora", True))
    d.put("lora.separate_base", base, "compilation_config.cudagraph_specialize_lora"
          + ("" if "cudagraph_specialize_lora" in cc else " (vLLM default true)"))
    act = settings.get("specialize_active_lora")
    d.put("lora.specialize_count", bool(act and act.value) and base,
          act.source if act else "vLLM captures one LoRA graph per size (no per-count graphs)")


def _parallel(d: F.Draft, settings: dict) -> None:
    dp = settings.get("data_parallel_size")
    if dp:
        d.put("parallel.data_parallel_size", dp.value, dp.source)
    d.assume("parallel.data_parallel_size", 1, "vLLM's default data_parallel_size")
    dbo = settings.get("enable_dbo")
    if dbo and dbo.value:
        d.put("parallel.ubatch.enabled", True, dbo.source)
        d.put("parallel.ubatch.num_ubatches", 2, "DBO runs two micro-batches")
        d.put("parallel.ubatch.plain_twins", False, "vLLM captures no plain twin for a "
              "micro-batched size")
        for key, default in (("decode_token_threshold", 32), ("prefill_token_threshold", 512)):
            s = settings.get(f"dbo_{key}")
            if s:
                d.put(f"parallel.ubatch.{key}", s.value, s.source)
            else:
                d.assume(f"parallel.ubatch.{key}", default, f"vLLM's default dbo_{key}")
    else:
        d.assume("parallel.ubatch.enabled", False, "no --enable-dbo")


def finish_sizes(d: F.Draft, version: str) -> None:
    """Capture sizes, once max_num_seqs, max_num_batched_tokens and q are final (after --set)."""
    if "cudagraph.capture_sizes" in d.values:
        return
    cc, src, settings = d.pending
    seqs = d.values["scheduler.max_num_seqs"]
    tokens, q = d.values["scheduler.max_num_batched_tokens"], d.values["scheduler.decode_query_len"]
    top_in = cc.get("max_cudagraph_capture_size")
    explicit = cc.get("cudagraph_capture_sizes")
    where = f"compilation_config ({src})"
    for key in ("cudagraph_capture_sizes", "max_cudagraph_capture_size"):
        if key in settings:
            explicit, top_in, where = ((settings[key].value, top_in, settings[key].source)
                                       if key.startswith("cuda") else
                                       (explicit, settings[key].value, settings[key].source))
    legacy = settings.get("cuda_graph_sizes")
    if legacy:
        explicit, top_in, where = ((None, legacy.value[0], legacy.source) if len(legacy.value) == 1
                                   else (legacy.value, None, legacy.source))
    if explicit:
        sizes = R.explicit_sizes(explicit, tokens)
        if top_in is not None and sizes and top_in != sizes[-1] and not legacy:
            raise F.input_error("<vllm>", "inconsistent", f"{where}: max_cudagraph_capture_size="
                                f"{top_in} is not the largest capture size ({sizes[-1]}); vLLM "
                                "refuses this", "drop one of the two")
        dropped = len(set(explicit)) - len(sizes)
        d.put("cudagraph.capture_sizes", sizes, f"{where}" + (f"; {dropped} above "
              f"max_num_batched_tokens dropped as vLLM does" if dropped else ""))
    else:
        top = R.default_max_size(seqs, tokens, q, top_in)
        why = (f"max_cudagraph_capture_size {top_in} ({where})" if top_in is not None else
               f"min(2 * q * max_num_seqs, 512)") + f", capped at max_num_batched_tokens = {top}"
        d.put("cudagraph.capture_sizes", R.default_sizes(top), f"vLLM {version} default list "
              f"[1, 2, 4] + 8..248/8 + 256../16 up to {why}")


def read_config(path: str, version: str, allow_unknown: bool):
    """``vllm serve --config`` YAML: keys are flag names (``max-num-seqs: 128``)."""
    return F.read_flag_config(path, FLAGS, IGNORED, REMOVED.get(version, {}), ENGINE,
                              allow_unknown, normalise)


def read_log(path: str):
    from pathlib import Path

    from graphplan.compiler.engines.vllm_log import read_log as parse
    from graphplan.compiler.load import read_text
    return parse(read_text(Path(path)), path)
