"""How vLLM reads its own CUDA-graph settings, as pure functions (written from vLLM's source, not
copied): the default capture list, explicit lists, spec-decode rounding, mode downgrades and LoRA
cases. ``plan import`` uses them to turn a vLLM configuration into the plan vLLM would run; the
fidelity tests use them to check that an exported configuration, read this way, gives graphplan's
table. Sources and versions: docs/engines.md.
"""

from __future__ import annotations

from dataclasses import dataclass

VERSIONS = {
    "0.11": "vLLM 0.11.x: cudagraph_mode, max_cudagraph_capture_size, cudagraph_specialize_lora, "
    "DBO flags; no per-count LoRA graphs",
    "0.15": "vLLM after PR #32005 (2026-01, first released in 0.16.0): adds "
    "--specialize-active-lora (LoRA graphs per active-adapter count)",
    "0.23": "vLLM 0.23: as 0.15, and the default list also captures max_num_batched_tokens when "
    "it caps the list; --performance-mode interactivity starts it with every size 1..32, "
    "throughput doubles the default max_num_seqs and max_num_batched_tokens",
}
DEFAULT_VERSION = "0.11"
ATTENTION_OPS = (
    "vllm::unified_attention",
    "vllm::unified_attention_with_output",
    "vllm::unified_mla_attention",
    "vllm::unified_mla_attention_with_output",
    "vllm::mamba_mixer2",
    "vllm::mamba_mixer",
    "vllm::short_conv",
    "vllm::linear_attention",
    "vllm::plamo2_mamba_mixer",
    "vllm::gdn_attention_core",
    "vllm::kda_attention",
    "vllm::sparse_attn_indexer",
)
"""vLLM's default splitting ops (CompilationConfig._attention_ops): graphplan calls them all
``attention``; vLLM treats attention as split only when every one is listed."""
DEFAULT_CEILING = 512


class VllmRuleError(ValueError):
    """vLLM itself would refuse this configuration (it raises at start-up)."""


def round_up(n: int, q: int) -> int:
    return -(-n // q) * q


def default_max_size(
    max_num_seqs: int, max_num_batched_tokens: int, q: int, max_capture: int | None = None
) -> int:
    """``max_cudagraph_capture_size``: given, else min(2 * q * max_num_seqs, 512); then capped at
    max_num_batched_tokens (VllmConfig._set_cudagraph_sizes)."""
    top = max_capture if max_capture is not None else min(max_num_seqs * q * 2, DEFAULT_CEILING)
    return min(top, max_num_batched_tokens)


def default_sizes(top: int) -> list[int]:
    """``[1, 2, 4] + range(8, min(top + 1, 256), 8) + range(256, top + 1, 16)``, each <= top."""
    return (
        [s for s in (1, 2, 4) if s <= top]
        + list(range(8, min(top + 1, 256), 8))
        + list(range(256, top + 1, 16))
    )


def default_sizes_for(version: str, top: int, tokens: int, performance_mode: str = "") -> list:
    """The default list of a release: 0.23 (``_set_cudagraph_sizes``) starts with 1..min(top, 32)
    in ``interactivity`` mode and adds ``max_num_batched_tokens`` when it is at most ``top``."""
    sizes = default_sizes(top)
    if version in ("0.11", "0.15"):
        return sizes
    if performance_mode == "interactivity":
        sizes = list(range(1, min(top, 32) + 1)) + sizes
    if tokens <= top:
        sizes.append(tokens)
    return sorted(set(sizes))


def explicit_sizes(sizes, max_num_batched_tokens: int) -> list[int]:
    """An explicit ``cudagraph_capture_sizes``: de-duplicated, above max_num_batched_tokens
    dropped (silently, in vLLM), sorted."""
    return sorted({s for s in sizes if s <= max_num_batched_tokens})


def spec_rounded(sizes: list[int], q: int) -> list[int]:
    """``adjust_cudagraph_sizes_for_spec_decode``: round each size up to a multiple of q and drop
    those above the largest size; none left: [q] when q fits, else vLLM raises."""
    if q <= 1 or not sizes:
        return list(sizes)
    top = sizes[-1]
    out = sorted({round_up(s, q) for s in sizes if round_up(s, q) <= top})
    if not out:
        if q > top:
            raise VllmRuleError(f"no cudagraph size is a multiple of {q} at or below {top}")
        out = [q]
    return out


def resolve_mode(mode: str, splitting_ops: list | None, support: str, q: int) -> str:
    """The mode vLLM runs: empty splitting_ops drops the piecewise part (CompilationConfig.
    set_splitting_ops_for_v1), then the attention backend's cudagraph support lowers FULL
    (GPUModelRunner's mode check: mixed FULL needs ALWAYS; decode FULL needs support, and
    UNIFORM_BATCH when q > 1)."""
    attention_splits = splitting_ops is None or any(
        op in ATTENTION_OPS or op == "attention" for op in splitting_ops
    )
    if splitting_ops is not None and not splitting_ops:
        mode = {"PIECEWISE": "NONE", "FULL_AND_PIECEWISE": "FULL"}.get(mode, mode)
    order = ("NEVER", "UNIFORM_SINGLE_TOKEN_DECODE", "UNIFORM_BATCH", "ALWAYS")
    level = order.index(support)
    if mode == "FULL" and level < 3:
        if level == 0:
            raise VllmRuleError("FULL cudagraphs with an attention backend that supports none")
        mode = "FULL_AND_PIECEWISE" if attention_splits else "FULL_DECODE_ONLY"
    decode_full = mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
    if decode_full and (level == 0 or (q > 1 and level < 2)):
        mode = "PIECEWISE" if attention_splits else "NONE"
    return mode


def lora_cases(
    enable_lora: bool, max_loras: int, specialize_lora: bool, specialize_active: bool
) -> list[int]:
    """Captured active-adapter counts in graphplan's labels (SEMANTICS.md section 5): LoRA off ->
    [0]; one LoRA graph per size labelled max_loras + 1, plus the no-LoRA graphs (0) when
    cudagraph_specialize_lora; per-count graphs only with specialize_active_lora, which vLLM honours
    only together with cudagraph_specialize_lora."""
    if not enable_lora:
        return [0]
    top = max_loras + 1
    if specialize_lora and specialize_active:
        return [0] + [n for n in range(1, top + 1) if n & (n - 1) == 0 or n == top]
    return [0, top] if specialize_lora else [top]


@dataclass(frozen=True, slots=True)
class VllmRun:
    """What vLLM captures for a configuration."""

    mode: str
    sizes: tuple[int, ...]
    lora_cases: tuple[int, ...]


def read_engine_args(args: dict, support: str) -> VllmRun:
    """An EngineArgs keyword dict (``plan export --format json``), read by vLLM's rules."""
    cc = dict(args.get("compilation_config") or {})
    seqs, tokens = args["max_num_seqs"], args["max_num_batched_tokens"]
    q = 1 + int((args.get("speculative_config") or {}).get("num_speculative_tokens", 0))
    mode = "NONE" if args.get("enforce_eager") else cc.get("cudagraph_mode", "FULL_AND_PIECEWISE")
    mode = resolve_mode(mode, cc.get("splitting_ops"), support, q)
    sizes: list[int] = []
    if mode != "NONE":
        top = default_max_size(seqs, tokens, q, cc.get("max_cudagraph_capture_size"))
        if cc.get("cudagraph_capture_sizes") is not None:
            sizes = explicit_sizes(cc["cudagraph_capture_sizes"], tokens)
            given = cc.get("max_cudagraph_capture_size")
            if given is not None and sizes and given != sizes[-1]:
                raise VllmRuleError(
                    f"max_cudagraph_capture_size={given} is not the largest of "
                    f"cudagraph_capture_sizes ({sizes[-1]})"
                )
        else:
            sizes = default_sizes(top)
        if mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
            sizes = spec_rounded(sizes, q)
    cases = lora_cases(
        bool(args.get("enable_lora")),
        int(args.get("max_loras", 1)),
        bool(cc.get("cudagraph_specialize_lora", True)),
        bool(args.get("specialize_active_lora", False)),
    )
    return VllmRun(mode=mode, sizes=tuple(sizes), lora_cases=tuple(cases))
