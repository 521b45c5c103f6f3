"""vLLM settings -> plan values (``plan import``), each with its source or the default vLLM
assumes; capture sizes are resolved last, once ``--set`` has fixed the scheduler values.
"""

from __future__ import annotations

from . import flags as F
from . import vllm_rules as R
from .draft import Draft


def to_draft(settings: dict, version: str) -> Draft:
    """vLLM settings -> plan values, each with its source or the default vLLM assumes."""
    d, get = Draft(), settings.get
    d.put("name", "vllm-import", "plan name (change with --set name=...)")
    for key, default, why in (
        (
            "max_num_seqs",
            256,
            "EngineArgs fallback; vLLM raises it on "
            "large GPUs: give --set scheduler.max_num_seqs=N",
        ),
        (
            "max_num_batched_tokens",
            8192,
            "vllm serve's default with "
            "chunked prefill; give --set scheduler.max_num_batched_tokens=N",
        ),
    ):
        perf = get("performance_mode")
        if key in settings:
            d.put(f"scheduler.{key}", settings[key].value, settings[key].source)
        elif perf and perf.value == "throughput" and version not in ("0.11", "0.15"):
            d.put(f"scheduler.{key}", 2 * default, f"twice the default {default} ({perf.source})")
        else:
            d.assume(f"scheduler.{key}", default, why)
    spec = get("speculative_config")
    q = 1
    if spec and spec.value:
        n = spec.value.get("num_speculative_tokens", spec.value.get("num_spec_tokens"))
        if n is None:
            raise F.input_error(
                "<vllm>",
                "missing-value",
                f"{spec.source}: no num_speculative_tokens",
                "give --set scheduler.decode_query_len=N",
            )
        q = 1 + F.to_int(n, spec.source, 0, 63, "<vllm>")
        d.put("scheduler.decode_query_len", q, f"1 + num_speculative_tokens ({spec.source})")
    else:
        d.assume("scheduler.decode_query_len", 1, "no speculative decoding")
    compilation = get("compilation_config")
    cc = dict(compilation.value) if compilation else {}
    cc_src = compilation.source if compilation and cc else ""
    _mode(d, settings, cc, cc_src)
    d.assume(
        "cudagraph.attention_support",
        "UNIFORM_BATCH",
        "vLLM reads it from the attention "
        "backend (FlashAttention 3: --set cudagraph.attention_support=ALWAYS)",
    )
    ops = cc.get("splitting_ops")
    if ops is None:
        d.assume("cudagraph.splitting_ops", ["attention"], "vLLM splits at its attention ops")
    else:
        attn = set(R.ATTENTION_OPS) | {o.replace("::", ".") for o in R.ATTENTION_OPS}
        names = (["attention"] if any(o in attn for o in ops) else []) + [
            o for o in ops if o not in attn
        ]
        d.put("cudagraph.splitting_ops", names, f"compilation_config.splitting_ops ({cc_src})")
    d.put("cudagraph.strict", False, "vLLM has no strict mode (it logs downgrades)")
    _lora(d, settings, cc)
    _parallel(d, settings)
    d.pending = (cc, cc_src, settings)  # sizes need the final scheduler values (see finish)
    return d


def _mode(d: Draft, settings: dict, cc: dict, src: str) -> None:
    compile_mode = cc.get("mode", cc.get("level"))  # CompilationMode (0.11+) / level (older)
    asked = str(cc.get("cudagraph_mode") or "FULL_AND_PIECEWISE").upper()
    if settings.get("enforce_eager") and settings["enforce_eager"].value:
        d.put("cudagraph.mode", "NONE", settings["enforce_eager"].source)
    elif (
        compile_mode is not None
        and str(compile_mode) not in ("3", "VLLM_COMPILE", "PIECEWISE")
        and asked in ("PIECEWISE", "FULL_AND_PIECEWISE")
    ):
        d.put(
            "cudagraph.mode",
            "NONE",
            f"compilation_config mode {compile_mode} ({src}): vLLM captures piecewise graphs "
            "only with mode 3 (VLLM_COMPILE) and then captures none",
        )
    elif cc.get("cudagraph_mode") is not None:
        mode = str(cc["cudagraph_mode"]).upper()
        if mode not in ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
            raise F.input_error(
                "<vllm>",
                "bad-value",
                f"{src}: cudagraph_mode {mode!r} is not a vLLM CUDAGraphMode",
                "NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE",
            )
        d.put("cudagraph.mode", mode, f"compilation_config.cudagraph_mode ({src})")
    elif cc.get("full_cuda_graph") or cc.get("use_cudagraph") is not None:  # vLLM <= 0.10
        mode = (
            "FULL"
            if cc.get("full_cuda_graph")
            else ("PIECEWISE" if cc.get("use_cudagraph") else "NONE")
        )
        d.put(
            "cudagraph.mode",
            mode,
            f"compilation_config use_cudagraph/full_cuda_graph ({src}; vLLM <= 0.10 spelling)",
        )
    elif settings.get("optimization_level"):
        lvl = settings["optimization_level"]
        d.put(
            "cudagraph.mode",
            ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE")[lvl.value],
            f"{lvl.source} (its mode)",
        )
    else:
        d.assume("cudagraph.mode", "FULL_AND_PIECEWISE", "vLLM's default cudagraph_mode (-O2)")


def _lora(d: Draft, settings: dict, cc: dict) -> None:
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
    d.put(
        "lora.separate_base",
        base,
        "compilation_config.cudagraph_specialize_lora"
        + ("" if "cudagraph_specialize_lora" in cc else " (vLLM default true)"),
    )
    act = settings.get("specialize_active_lora")
    d.put(
        "lora.specialize_count",
        bool(act and act.value) and base,
        act.source if act else "vLLM captures one LoRA graph per size (no per-count graphs)",
    )


def _parallel(d: Draft, settings: dict) -> None:
    dp = settings.get("data_parallel_size")
    if dp:
        d.put("parallel.data_parallel_size", dp.value, dp.source)
    d.assume("parallel.data_parallel_size", 1, "vLLM's default data_parallel_size")
    tp = settings.get("tensor_parallel_size")
    if tp:
        d.put("parallel.tensor_parallel_size", tp.value, tp.source)
    d.assume("parallel.tensor_parallel_size", 1, "vLLM's default tensor_parallel_size")
    dbo = settings.get("enable_dbo")
    if dbo and dbo.value:
        d.put("parallel.ubatch.enabled", True, dbo.source)
        d.put("parallel.ubatch.num_ubatches", 2, "DBO runs two micro-batches")
        d.put(
            "parallel.ubatch.plain_twins",
            False,
            "vLLM captures no plain twin for a micro-batched size",
        )
        for key, default in (("decode_token_threshold", 32), ("prefill_token_threshold", 512)):
            s = settings.get(f"dbo_{key}")
            if s:
                d.put(f"parallel.ubatch.{key}", s.value, s.source)
            else:
                d.assume(f"parallel.ubatch.{key}", default, f"vLLM's default dbo_{key}")
    else:
        d.assume("parallel.ubatch.enabled", False, "no --enable-dbo")


def finish_sizes(d: Draft, version: str) -> None:
    """Capture sizes, once max_num_seqs, max_num_batched_tokens and q are final (after --set)."""
    if "cudagraph.capture_sizes" in d.values:
        return
    cc, src, settings = d.pending
    seqs = d.count("scheduler.max_num_seqs")
    tokens, q = d.count("scheduler.max_num_batched_tokens"), d.count("scheduler.decode_query_len")
    top_in = cc.get("max_cudagraph_capture_size")
    explicit = cc.get("cudagraph_capture_sizes")
    where = f"compilation_config ({src})"
    for key in ("cudagraph_capture_sizes", "max_cudagraph_capture_size"):
        if key in settings:
            explicit, top_in, where = (
                (settings[key].value, top_in, settings[key].source)
                if key.startswith("cuda")
                else (explicit, settings[key].value, settings[key].source)
            )
    legacy = settings.get("cuda_graph_sizes")
    if legacy:
        explicit, top_in, where = (
            (None, legacy.value[0], legacy.source)
            if len(legacy.value) == 1
            else (legacy.value, None, legacy.source)
        )
    if explicit:
        sizes = R.explicit_sizes(explicit, tokens)
        if top_in is not None and sizes and top_in != sizes[-1] and not legacy:
            raise F.input_error(
                "<vllm>",
                "inconsistent",
                f"{where}: max_cudagraph_capture_size="
                f"{top_in} is not the largest capture size ({sizes[-1]}); vLLM "
                "refuses this",
                "drop one of the two",
            )
        dropped = len(set(explicit)) - len(sizes)
        d.put(
            "cudagraph.capture_sizes",
            sizes,
            f"{where}"
            + (f"; {dropped} above max_num_batched_tokens dropped as vLLM does" if dropped else ""),
        )
    else:
        top = R.default_max_size(seqs, tokens, q, top_in)
        why = (
            f"min(max_cudagraph_capture_size {top_in} ({where}), max_num_batched_tokens)"
            if top_in is not None
            else "min(2 * q * max_num_seqs, 512, max_num_batched_tokens)"
        )
        perf = settings.get("performance_mode")
        sizes = R.default_sizes_for(version, top, tokens, perf.value if perf else "")
        extra = "" if sizes == R.default_sizes(top) else " (with vLLM 0.23's additions)"
        d.put(
            "cudagraph.capture_sizes",
            sizes,
            f"vLLM {version} default list [1, 2, 4] + 8../8 + 256../16 up to {top} = {why}" + extra,
        )
