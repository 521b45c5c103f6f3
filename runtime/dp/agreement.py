"""Data-parallel agreement (docs/semantics.md §7) on torch.distributed.

Every step each DP rank writes four int32 values into its own column of a ``[4, dp_size]`` tensor
(unpadded tokens, padded tokens, wants-ubatch, dispatched runtime mode), one exchange makes every
column visible to every rank (NCCL: an all-reduce of the zero-padded matrix; Gloo: the columns sent
point-to-point, the same matrix at lower latency), and ``agree`` turns that matrix into the same
decision on every rank. The exchange can be started early (``start``) and collected later
(``finish``), so it runs while the previous step's GPU work does. ``agree`` and ``contribution``
are pure; ``DPCoordinator`` owns the tensor, the process group and the timeout.

graphplan's choices where vLLM leaves room (docs/semantics.md §7.1, §7.3, §7.5; each tested):
- a rank with no work contributes ``IDLE``: 0 tokens, no ubatch wish, mode FULL (neutral for the
  min), so an idle rank never lowers the others' mode but does call off micro-batching (its last
  ubatch would be empty), as vLLM's one-token dummy run does;
- when every rank is idle nobody runs anything (``DPDecision.idle``);
- an idle rank runs a dummy batch of ``dummy_tokens``: the agreed padded size, or the largest
  unpadded size when ranks keep their own sizes (synced mode NONE, no ubatch);
- a rank that wants to micro-batch at a size with a ubatched FULL graph contributes FULL at that
  size, plain twins or not; an aborted ubatch then runs what the re-dispatch at the agreed mode
  and size gives (the plain twin, or eager at the agreed size without one);
- with nothing padded (synced NONE, no ubatch) each rank runs eagerly at its own unpadded size
  (vLLM runs at its own padded size: the same outputs, less work).
"""

from __future__ import annotations

import datetime
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphplan.compiler.errors import GraphplanError
from graphplan.compiler.records import RuntimeMode

from .ubatch import last_ubatch_empty

UNPADDED, PADDED, WANTS_UBATCH, MODE = range(4)  # rows of the all-reduced tensor
IDLE = (0, 0, 0, int(RuntimeMode.FULL))
_MODES = tuple(RuntimeMode)  # int -> RuntimeMode without the enum's call overhead
P2P_MAX_RANKS = 8  # Gloo DP groups up to this size exchange columns point-to-point
EXCHANGES = ("auto", "p2p", "all_gather", "all_reduce")  # how a Gloo group exchanges the matrix
_TAG = 0x6770  # the tag of graphplan's DP exchange on a group the caller may share


class DPError(GraphplanError):
    """DP ranks cannot agree: mismatched tables or group sizes, or a failed collective."""


class DPTimeoutError(DPError):
    """A DP collective did not complete within parallel.sync_timeout_s: a rank died or stalled."""


@dataclass(frozen=True, slots=True)
class DPDecision:
    """What every rank agreed on for one step (identical on every rank)."""

    mode: RuntimeMode
    """Synced runtime mode: the minimum over ranks; re-dispatch allows only this mode."""
    ubatch: bool
    """Every rank wanted to micro-batch and the last ubatch is not empty."""
    pad_to: int | None
    """Agreed token count (max padded over ranks) when mode != NONE or ubatch; None: ranks keep
    their own sizes."""
    num_tokens: tuple[int, ...]
    """Unpadded tokens per rank (0 = idle)."""
    padded_tokens: tuple[int, ...]
    ubatch_aborted: bool
    """Every rank wanted to micro-batch, but the last ubatch would have been empty."""

    @property
    def idle(self) -> bool:
        """No rank has work: nobody runs the model this step."""
        return max(self.num_tokens) == 0

    @property
    def dummy_tokens(self) -> int:
        """Tokens an idle rank runs so that collectives match."""
        return self.pad_to if self.pad_to is not None else max(self.num_tokens)


def contribution(num_tokens: int, route=None) -> tuple[int, int, int, int]:
    """This rank's column: (unpadded, padded, wants_ubatch, mode); IDLE without work.

    A rank that wants to micro-batch at a size that has a ubatched FULL graph contributes FULL
    at that size, with or without plain twins: the route it would take if the ranks agree to
    micro-batch. (Without plain twins its non-ubatched route is PIECEWISE or NONE, which would
    lower the synced mode and leave the ubatched graphs unused.) What an aborted ubatch runs is
    decided after agreement, by the re-dispatch at the agreed mode and size."""
    if route is None or num_tokens == 0:
        return IDLE
    full = int(RuntimeMode.FULL)
    if route.wants_ubatch and route.mode is not RuntimeMode.FULL:
        ub = _ubatched_route(route)
        if ub.mode is RuntimeMode.FULL:
            return (num_tokens, ub.padded_tokens, 1, full)
    return (num_tokens, route.padded_tokens, int(route.wants_ubatch), int(route.mode))


def _ubatched_route(route):
    """The same batch routed as a ubatched one (the route's own table and arguments)."""
    table, n, r, mql, loras, *_ = route.context  # what the route was asked
    return table.route(n, r, mql, loras, ubatched=True)


def agree(matrix, num_ubatches: int) -> DPDecision:
    """The step's decision from the all-reduced ``[4, dp_size]`` matrix (rows of ints)."""
    unpadded, padded, wants, modes = matrix
    mode = _MODES[min(modes)]
    max_padded = max(padded)
    ubatch = min(wants) == 1  # every rank wants it
    aborted = ubatch and last_ubatch_empty(max_padded, min(unpadded), num_ubatches)
    ubatch = ubatch and not aborted
    pad_to = max_padded if (mode or ubatch) and max_padded > 0 else None
    return DPDecision(mode, ubatch, pad_to, tuple(unpadded), tuple(padded), aborted)


def _digest_words(fingerprint: str) -> np.ndarray:
    """A table fingerprint (``sha256:<64 hex>``) as 8 int32 words, summable without overflow;
    any other string is hashed first."""
    algo, _, hexdigest = fingerprint.partition(":")
    try:
        raw = bytes.fromhex(hexdigest) if algo == "sha256" and len(hexdigest) == 64 else None
    except ValueError:
        raw = None
    return np.frombuffer(raw or hashlib.sha256(fingerprint.encode()).digest(), dtype="<i4")


def _words_hex(words: np.ndarray) -> str:
    return "sha256:" + words.astype("<i4").tobytes().hex()


def _group_info(group) -> tuple[int, int, str]:
    """(this process's rank, size, backend name) of a process group: one torch.distributed knows,
    or one built directly over a store (``ProcessGroupGloo(store, rank, size)``: graphplan-serve's
    DP group beside its engines' tensor-parallel worlds)."""
    import torch.distributed as dist

    try:
        return (
            dist.get_rank(group),
            dist.get_world_size(group),
            str(dist.get_backend(group)).lower(),
        )
    except (ValueError, RuntimeError):  # not in torch.distributed's map of groups
        return group.rank(), group.size(), str(group.name()).lower()


class DPCoordinator:
    """One exchange of the [4, dp_size] matrix per step over a DP process group, with a timeout.

    ``group``: the DP process group (default: the world; a single process without
    torch.distributed is a DP group of one). ``backend``: ``auto`` uses the group's own CPU
    (Gloo) backend when it has one, else NCCL on the current CUDA device; ``gloo`` makes a Gloo
    subgroup of the same ranks when the group has none; ``nccl`` all-reduces on the GPU.
    ``exchange`` (Gloo): ``p2p`` sends each rank's column to every peer (the lowest latency,
    the default up to P2P_MAX_RANKS ranks), ``all_gather`` gathers the columns (the default past
    it), ``all_reduce`` sums the zero-padded matrix (docs/semantics.md §7.2 to the letter); all three
    give the same matrix. Construction is collective when it makes a subgroup (every rank must
    construct it).
    """

    def __init__(
        self,
        group=None,
        *,
        backend: str = "auto",
        timeout_s: float = 300.0,
        num_ubatches: int = 2,
        device: torch.device | str | None = None,
        exchange: str = "auto",
    ):
        import torch.distributed as dist

        if exchange not in EXCHANGES:
            raise ValueError(f"exchange={exchange!r}: use one of {', '.join(EXCHANGES)}")
        self.timeout_s, self.num_ubatches = float(timeout_s), num_ubatches
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        self.step_no = 0
        self.sync_seconds = 0.0
        self.group: Any  # a torch.distributed ProcessGroup (None: a group of one)
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.group, self.rank, self.size, self.device = None, 0, 1, torch.device("cpu")
        else:
            group = group or dist.group.WORLD
            self.rank, self.size, have = _group_info(group)
            want = backend.lower()
            if want == "auto":
                want = "gloo" if "gloo" in have else "nccl"
            if want == "gloo" and "gloo" not in have:
                group = dist.new_group(
                    dist.get_process_group_ranks(group), backend="gloo", timeout=self._timeout
                )
            elif want == "nccl" and "nccl" not in have:
                raise DPError(
                    f"parallel.backend is nccl, but the DP process group's backend is "
                    f"{have!r}: initialize it with NCCL, or set parallel.backend: gloo"
                )
            self.group = group
            if want == "nccl":
                self.device = (
                    torch.device(device)
                    if device is not None
                    else torch.device("cuda", torch.cuda.current_device())
                )
            else:
                self.device = torch.device("cpu")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._buf = torch.zeros(4, self.size, dtype=torch.int32, device=self.device)
        if self.device.type == "cuda":
            self._host = torch.zeros(4, self.size, dtype=torch.int32, pin_memory=True)
            self._event = torch.cuda.Event()
        else:
            self._host = self._buf
        self._np = self._host.numpy()  # [4, dp_size] host view: numpy writes cost no dispatch
        # Gloo: every rank sends its column to every peer and receives theirs (point-to-point,
        # posted at once). The result is the same [4, dp_size] matrix as the all-reduce of the
        # zero-padded matrix, in one exchange, and Gloo runs send/recv in the calling thread
        # rather than handing a collective to its worker thread: ~40% less latency than an
        # all-gather (bench/dp_sync_bench.py). Past P2P_MAX_RANKS the all-gather's fewer
        # messages win.
        self._col = torch.zeros(4, dtype=torch.int32)
        self._cols = [torch.zeros(4, dtype=torch.int32) for _ in range(self.size)]
        self._cols[self.rank] = self._col
        self._cols_np = [c.numpy() for c in self._cols]
        if exchange == "auto":
            exchange = "p2p" if self.size <= P2P_MAX_RANKS else "all_gather"
        # NCCL all-reduces; so does a group of one (its own column is the matrix)
        self.exchange = "all_reduce" if self.device.type == "cuda" or self.size == 1 else exchange
        self._peers: list[int] = (
            [r for r in range(self.size) if r != self.rank] if self.exchange == "p2p" else []
        )
        self._inflight: tuple | None = None  # the works of a started, unfinished exchange
        self._t0 = 0.0

    @classmethod
    def for_table(
        cls, table, group=None, *, backend: str | None = None, device=None
    ) -> "DPCoordinator":
        """A coordinator with the plan's backend, timeout and ubatch count."""
        s = table.settings
        return cls(
            group,
            backend=backend or s.dp_backend,
            timeout_s=s.sync_timeout_s,
            num_ubatches=s.ubatch.num_ubatches,
            device=device,
        )

    # -- collectives ----------------------------------------------------------------------------
    def _all_reduce(
        self, buf: torch.Tensor, host: torch.Tensor, what: str, *, wait: bool = True
    ) -> None:
        """Sum ``buf`` over the group in place; on CUDA ``host`` (pinned) is copied in and out
        (``wait=False``: queued only, ``_wait_event`` waits for the copy back)."""
        if self.size == 1:
            return
        assert self.group is not None  # only a DP group of one runs without a process group
        cuda = buf.is_cuda
        if cuda:
            buf.copy_(host, non_blocking=True)
        try:
            work = self.group.allreduce([buf])
            if not cuda:
                work.wait(self._timeout)
                return
            work.wait()  # the current stream waits for NCCL; the host does not
            host.copy_(buf, non_blocking=True)
            self._event.record()
        except RuntimeError as e:
            raise self._failure(what, e) from e
        if wait:
            self._wait_event(what)

    def _wait_event(self, what: str) -> None:
        start = time.monotonic()
        while not self._event.query():  # the host waits with a deadline, never forever
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                raise self._failure(what, RuntimeError("timed out"))
            if waited > 2e-3:  # spin through a normal step; back off once something is late
                time.sleep(1e-4)

    def _failure(self, what: str, e: Exception) -> DPError:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "timed out" in msg.lower() or "timeout" in msg.lower():
            return DPTimeoutError(
                f"DP rank {self.rank}/{self.size}: {what} did not complete within "
                f"parallel.sync_timeout_s={self.timeout_s:g} s: another rank died, stalled or "
                "stopped stepping (every rank calls step() every step, with no batch when it has "
                "no work); the process group is unusable now, restart the DP group"
            )
        return DPError(
            f"DP rank {self.rank}/{self.size}: {what} failed ({msg}): another rank "
            "probably died; restart the DP group"
        )

    def check_fingerprint(self, fingerprint: str) -> None:
        """All ranks must run the same compiled table; a mismatch raises on every rank."""
        host = torch.zeros(self.size, 8, dtype=torch.int32)  # [dp_size, 8]: each rank's digest
        mine = _digest_words(fingerprint)
        host[self.rank] = torch.from_numpy(mine.copy())
        buf = host.to(self.device) if self.device.type == "cuda" else host
        if buf.is_cuda:
            host = host.pin_memory()
        self._all_reduce(buf, host, "the start-up table fingerprint check")
        got = host.numpy()
        bad = [r for r in range(self.size) if not np.array_equal(got[r], mine)]
        if bad:
            raise DPError(
                f"DP table fingerprint mismatch: rank {self.rank} runs table "
                f"{_words_hex(mine)[:23]}..., rank {bad[0]} runs {_words_hex(got[bad[0]])[:23]}... "
                f"(ranks that differ from rank {self.rank}: {bad}); every DP rank must load the "
                "same compiled table (same plan, overrides and compiler version)"
            )

    def start(self, unpadded: int, padded: int, wants_ubatch: int, mode: int) -> None:
        """Post this step's exchange and return at once: the peers' columns arrive while the
        caller does other work (the previous step's GPU work, preparing inputs); ``finish``
        collects them. One exchange at a time; ``sync`` is ``start`` then ``finish``."""
        if self._inflight is not None:
            raise DPError(
                f"DP rank {self.rank}: step {self.step_no}'s exchange is still in "
                "flight: finish() it before starting the next"
            )
        self._t0 = time.perf_counter()
        self.step_no += 1
        col = (unpadded, padded, wants_ubatch, mode)
        if self.exchange == "all_reduce":  # the zero-padded matrix, summed
            self._np.fill(0)
            self._np[:, self.rank] = col
        else:
            self._col.numpy()[:] = col
        g = self.group
        works: tuple = ()  # the posted works (Gloo); NCCL's copy back is waited on by event
        try:
            if self.size == 1 or g is None:  # a DP group of one: its column is the matrix
                pass
            elif self.device.type == "cuda":  # queued with the copy back; finish() waits
                self._all_reduce(self._buf, self._host, self._what(), wait=False)
            elif self.exchange == "all_reduce":
                works = (g.allreduce([self._buf]),)
            elif self.exchange == "all_gather":
                works = (g.allgather([self._cols], [self._col]),)
            else:
                works = (
                    *(g.recv([self._cols[r]], r, _TAG) for r in self._peers),
                    *(g.send([self._col], r, _TAG) for r in self._peers),
                )
        except RuntimeError as e:
            raise self._failure(self._what(), e) from e
        self._inflight = works

    def finish(self) -> DPDecision:
        """Wait for the exchange ``start`` posted (with the timeout) and agree on the matrix."""
        works, self._inflight = self._inflight, None
        if works is None:
            raise DPError(f"DP rank {self.rank}: finish() without start()")
        try:
            for w in works:
                w.wait(self._timeout)
        except RuntimeError as e:
            raise self._failure(self._what(), e) from e
        if self.device.type == "cuda" and self.size > 1:
            self._wait_event(self._what())
        matrix = (
            self._np.tolist()
            if self.exchange == "all_reduce"
            else np.stack(self._cols_np, axis=1).tolist()
        )  # [4, dp_size]
        d = agree(matrix, self.num_ubatches)
        self.sync_seconds += time.perf_counter() - self._t0
        return d

    def _what(self) -> str:
        return f"step {self.step_no}'s DP exchange"

    def sync(self, unpadded: int, padded: int, wants_ubatch: int, mode: int) -> DPDecision:
        """The step's one exchange (NCCL: all-reduce; Gloo: ``exchange``, by default the columns
        point-to-point, or an all-gather past P2P_MAX_RANKS), then ``agree`` on the matrix."""
        self.start(unpadded, padded, wants_ubatch, mode)
        return self.finish()
