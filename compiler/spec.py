"""What a plan says, as frozen dataclasses built once by the loader (docs/semantics.md §1-§8).

Field names are the plan's YAML keys; defaults live in ``schemas/plan.schema.json`` only (the
loader fills them in before these are built), and a test checks the two agree field for field.
"""

from __future__ import annotations

from dataclasses import dataclass

from .records import AttentionSupport, CudagraphMode


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerSpec:
    max_num_seqs: int
    """Most requests in one step."""
    max_num_batched_tokens: int
    """Most tokens in one step; the route table covers 1..this."""
    decode_query_len: int
    """q = 1 + speculative tokens: tokens per request in a uniform-decode step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SizeRange:
    start: int  # YAML key `from`
    to: int
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureSizesSpec:
    """One of three forms: an explicit list, a preset, or ranges plus includes."""

    kind: str
    """``list`` | ``preset`` | ``ranges``."""
    sizes: tuple[int, ...] = ()
    preset: str = ""
    ceiling: int = 512
    max_size: int = 0
    """sglang/trtllm: largest batch size in requests (0 = the preset's own default)."""
    enable_padding: bool = False
    """trtllm only: its padded list (+64 steps after 128, padded up to the cap) instead."""
    ranges: tuple[SizeRange, ...] = ()
    include: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class OnDemandSpec:
    enabled: bool
    """Capture only the start set at start, every other graph on its first use."""
    start_sizes: tuple[int, ...]
    """Token counts whose graphs are captured at start besides the largest of each routine."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CudagraphSpec:
    mode: CudagraphMode
    attention_support: AttentionSupport
    splitting_ops: tuple[str, ...]
    capture_sizes: CaptureSizesSpec
    pinned_sizes: tuple[int, ...]
    """Sizes ``plan optimize`` keeps; the table does not depend on them."""
    strict: bool
    on_demand: OnDemandSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    enabled: bool
    max_loras: int
    specialize_count: bool
    separate_base: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class UbatchSpec:
    enabled: bool
    num_ubatches: int
    decode_token_threshold: int
    prefill_token_threshold: int
    plain_twins: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelSpec:
    data_parallel_size: int
    tensor_parallel_size: int
    """Ranks that split one model (Megatron-style); world = DP x TP."""
    backend: str
    """torch.distributed backend for the per-step DP all-reduce: ``gloo`` | ``nccl`` | ``auto``."""
    sync_timeout_s: float
    """A rank that does not reach the DP all-reduce within this many seconds is an error."""
    ubatch: UbatchSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class LimitsSpec:
    max_graphs: int
    """Most graphs the plan may compile to; more is an error (resolve.check_graph_count)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSpec:
    version: int
    name: str
    scheduler: SchedulerSpec
    cudagraph: CudagraphSpec
    lora: LoraSpec
    parallel: ParallelSpec
    limits: LimitsSpec


def _sizes_from_dict(d) -> CaptureSizesSpec:
    if isinstance(d, list):
        return CaptureSizesSpec(kind="list", sizes=tuple(d))
    if "ranges" in d:
        ranges = tuple(SizeRange(start=r["from"], to=r["to"], step=r["step"]) for r in d["ranges"])
        return CaptureSizesSpec(kind="ranges", ranges=ranges, include=tuple(d.get("include", ())))
    return CaptureSizesSpec(
        kind="preset",
        preset=d["preset"],
        ceiling=d["ceiling"],
        max_size=d["max_size"],
        enable_padding=d["enable_padding"],
    )


def plan_from_dict(d: dict) -> PlanSpec:
    """Build the spec from a schema-valid dict with every default filled in."""
    cg, par = d["cudagraph"], d["parallel"]
    return PlanSpec(
        version=d["version"],
        name=d["name"],
        scheduler=SchedulerSpec(**d["scheduler"]),
        cudagraph=CudagraphSpec(
            mode=CudagraphMode[cg["mode"]],
            attention_support=AttentionSupport[cg["attention_support"]],
            splitting_ops=tuple(cg["splitting_ops"]),
            capture_sizes=_sizes_from_dict(cg["capture_sizes"]),
            pinned_sizes=tuple(cg.get("pinned_sizes", ())),  # tables compiled before it load
            strict=cg["strict"],
            on_demand=OnDemandSpec(
                enabled=cg["on_demand"]["enabled"],
                start_sizes=tuple(cg["on_demand"]["start_sizes"]),
            ),
        ),
        lora=LoraSpec(**d["lora"]),
        parallel=ParallelSpec(
            data_parallel_size=par["data_parallel_size"],
            tensor_parallel_size=par.get("tensor_parallel_size", 1),  # tables compiled before it
            backend=par["backend"],
            sync_timeout_s=par["sync_timeout_s"],
            ubatch=UbatchSpec(**par["ubatch"]),
        ),
        limits=LimitsSpec(**d["limits"]),
    )
