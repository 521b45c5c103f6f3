"""The table's records: modes, graph keys, graphs, route reasons and the resolved settings.

Frozen, typed, plain Python (standard library only), so the runtime (torch, no YAML stack) and the
compiler (no torch) share them. The compiler builds them once (``resolve``); ``table_format`` is the
only module that turns them into JSON and back. Rules: docs/semantics.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

ROUTINES = ("full_decode", "full_decode_ubatched", "full_mixed", "piecewise")
"""The route matrices a table holds, one per kind of graph (docs/semantics.md §5)."""


class _Named:
    """Members print as their names, the spelling plans and tables use: ``str(RuntimeMode.FULL)``
    and ``f"{mode}"`` give ``FULL``, not the ``2`` an IntEnum prints; a numeric format
    (``f"{mode:d}"``) still formats an int member's value, and ``repr`` is Enum's."""

    __slots__ = ()
    name: str  # given by the Enum each member class also derives from

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        if spec and spec[-1] in "bcdoxXneEfFgG%" and isinstance(self, int):
            return int.__format__(self, spec)
        return format(self.name, spec)


class RuntimeMode(_Named, enum.IntEnum):
    """What one step runs; the values are what DP ranks exchange (min wins, docs/semantics.md §7)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2


class CudagraphMode(_Named, enum.Enum):
    """A plan's cudagraph mode; YAML spellings are the member names. Value = (decode, mixed)."""

    NONE = (RuntimeMode.NONE, RuntimeMode.NONE)
    PIECEWISE = (RuntimeMode.PIECEWISE, RuntimeMode.PIECEWISE)
    FULL = (RuntimeMode.FULL, RuntimeMode.FULL)
    FULL_DECODE_ONLY = (RuntimeMode.FULL, RuntimeMode.NONE)
    FULL_AND_PIECEWISE = (RuntimeMode.FULL, RuntimeMode.PIECEWISE)

    @property
    def decode_mode(self) -> RuntimeMode:
        return self.value[0]

    @property
    def mixed_mode(self) -> RuntimeMode:
        return self.value[1]

    @property
    def separate_routine(self) -> bool:
        """True when uniform-decode batches have their own (FULL) routine."""
        return self in (CudagraphMode.FULL_DECODE_ONLY, CudagraphMode.FULL_AND_PIECEWISE)

    @property
    def has_full(self) -> bool:
        return RuntimeMode.FULL in self.value


class AttentionSupport(_Named, enum.IntEnum):
    """How much of a batch the attention backend can run inside a FULL graph (weakest first)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchDescriptor:
    """The key of one captured graph."""

    num_tokens: int
    """Padded token count the graph was captured at."""
    num_reqs: int | None
    """Padded request count baked into a FULL graph; None for PIECEWISE (relaxed key)."""
    uniform: bool
    """True for uniform-decode graphs (every request has exactly q tokens)."""
    has_lora: bool
    """Whether LoRA kernels are in the graph."""
    num_active_loras: int
    """Captured LoRA count: batches with fewer active adapters round up to it."""
    num_ubatches: int = 1
    """Micro-batches the graph runs (1 = plain; 2 for DBO)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Graph:
    """One graph to capture: its id (= position in capture order), mode and key."""

    id: int
    """Position in capture order; what route matrices hold."""
    mode: RuntimeMode
    """PIECEWISE or FULL."""
    key: BatchDescriptor
    """The batch shape it was captured at."""
    routine: str
    """Which route matrix refers to it (one of ROUTINES)."""


class Why(_Named, enum.Enum):
    """Why a route ended where it did: (code, metrics label, sentence).

    The code is stable (tests and tables of routes compare it); the label is the
    ``graphplan_eager_steps_total{reason=...}`` value for eager outcomes; the sentence is the
    short form ``plan explain`` expands with the batch's numbers."""

    FULL_DECODE = (0, "full_decode", "a FULL uniform-decode graph")
    FULL_MIXED = (1, "full_mixed", "a FULL graph of the mixed routine")
    FULL_UBATCHED = (2, "full_ubatched", "a FULL micro-batched decode graph")
    PIECEWISE = (3, "piecewise", "a PIECEWISE graph (attention eager between pieces)")
    NO_GRAPHS = (4, "plan_has_no_graphs", "eager: the plan captures no graphs")
    TOO_BIG = (5, "above_largest_capture_size", "eager: the batch exceeds the largest capture size")
    MIXED_NONE = (6, "mixed_routine_none", "eager: the mixed routine is NONE")
    NOT_ALLOWED = (7, "mode_not_allowed", "eager: no graph of the allowed mode exists")
    NO_TWIN = (8, "no_plain_twin", "eager: the size is captured only micro-batched")
    UBATCH_MIXED = (9, "ubatched_mixed_batch", "eager: micro-batches of a mixed batch")
    NO_UBATCH_GRAPH = (10, "no_ubatched_graph", "eager: no micro-batched graph at this size")

    @property
    def code(self) -> int:
        return self.value[0]

    @property
    def label(self) -> str:
        return self.value[1]

    @property
    def sentence(self) -> str:
        return self.value[2]

    @property
    def eager(self) -> bool:
        return self.value[2].startswith("eager")


@dataclass(frozen=True, kw_only=True, slots=True)
class UbatchSettings:
    """Micro-batching (DBO) as resolved (docs/semantics.md §8)."""

    enabled: bool
    """Whether DP ranks may split a step into micro-batches."""
    num_ubatches: int
    """Micro-batches per split step (2 for DBO)."""
    decode_token_threshold: int
    """A uniform-decode step of at least this many tokens wants to micro-batch."""
    prefill_token_threshold: int
    """Any other step of at least this many tokens wants to micro-batch."""
    plain_twins: bool
    """Whether each micro-batched size also has a plain FULL graph for aborted splits."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TableSettings:
    """The resolved plan: everything the router and the runtime need besides graphs and routes."""

    name: str
    """The plan's name (metrics, logs)."""
    mode: CudagraphMode
    """The mode after resolution (docs/semantics.md §2)."""
    requested_mode: CudagraphMode
    """The mode the plan asked for."""
    attention_support: AttentionSupport
    """The attention backend's declared graph support."""
    splitting_ops: tuple[str, ...]
    """Ops that run eager between piecewise graphs (plan names, e.g. ``attention``)."""
    decode_query_len: int
    """q = 1 + speculative tokens: tokens per request in a uniform-decode step."""
    max_num_seqs: int
    """Most requests in one step."""
    max_num_batched_tokens: int
    """Most tokens in one step; routes cover 1..this."""
    capture_sizes: tuple[int, ...]
    """Token counts graphs are captured at, ascending."""
    lora_enabled: bool
    """Whether batches may carry LoRA adapters."""
    lora_cases: tuple[int, ...]
    """Captured active-adapter counts (docs/semantics.md §6)."""
    lora_case_of_count: tuple[int, ...]
    """For each active-adapter count 0..max_loras+1, the index of the case it rounds up to."""
    ubatch: UbatchSettings
    """Micro-batching settings."""
    data_parallel_size: int
    """DP ranks that step together."""
    tensor_parallel_size: int = 1
    """TP ranks that hold one model between them and replay the same graph each step; world =
    data_parallel_size x tensor_parallel_size."""
    dp_backend: str
    """torch.distributed backend of the per-step exchange: gloo | nccl | auto."""
    sync_timeout_s: float
    """Seconds a rank waits for the others at the per-step exchange before failing."""
    on_demand: bool
    """Capture at start only the largest graph of each routine and the graphs of ``start_sizes``;
    every other graph on its first use (runtime/on_demand.py)."""
    start_sizes: tuple[int, ...]
    """Capture sizes whose graphs are captured at start with on_demand, ascending (the largest
    capture size always among them); empty without on_demand."""

    @property
    def decode_mode(self) -> RuntimeMode:
        return self.mode.decode_mode

    @property
    def mixed_mode(self) -> RuntimeMode:
        return self.mode.mixed_mode

    @property
    def separate_routines(self) -> bool:
        return self.mode.separate_routine


# -- batch shapes: the rules the compiler, the router and the runtime share --------------------
def is_uniform_decode(num_tokens, num_reqs, max_query_len, q):
    """Whether a batch is a uniform decode: every request has exactly ``q`` tokens, that is
    ``max_query_len == q`` and ``num_tokens == q * num_reqs``.

    Written with ``&`` rather than ``and`` so that it also works elementwise on numpy arrays (a
    trace's millions of steps at once); on ints it returns a bool all the same."""
    return (max_query_len == q) & (num_tokens == q * num_reqs)


def decode_token_range(q: int, max_num_seqs: int) -> range:
    """Token counts a uniform-decode batch can have: 1 to ``max_num_seqs`` requests of ``q``
    tokens each, so q, 2q, ..., q * max_num_seqs. FULL decode graphs exist only at these sizes;
    ``[-1]`` is the largest. (``max_num_batched_tokens`` may cut it short: callers that route
    batches cap it there.)"""
    return range(q, q * max_num_seqs + 1, q)


def padded_num_reqs(num_tokens: int, max_num_seqs: int, q: int = 1) -> int:
    """Requests a graph of ``num_tokens`` tokens holds, which a batch it runs is padded to: every
    request of a uniform-decode graph has ``q`` tokens (``num_tokens // q`` requests), every
    request of any other graph at least one (``q = 1``: as many requests as tokens); never more
    than ``max_num_seqs``."""
    return min(num_tokens // q, max_num_seqs)
