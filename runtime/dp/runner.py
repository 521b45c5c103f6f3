"""DPRunner: a GraphRunner stepping together with its DP peers, micro-batching when they agree.

Composition, not a subclass: every step is route -> (check) -> DP all-reduce -> re-route with the
synced mode at the agreed size -> one of

- a graph (plain, or ubatched: its body runs the ubatch schedule, recorded at capture) through
  ``runner.execute``;
- eager micro-batches at the agreed size (ubatching agreed, no ubatched graph for this batch);
- eager at the agreed size (a mode or size the runner has no graph for; peers run the same size);
- eager at the batch's own size (synced mode NONE, no ubatch), through ``runner.execute``.

Every eager step runs what a single-rank eager step runs: the runner's ``eager_model`` (the model
as written, also with ``compile`` on), whole through ``GraphRunner.run_eager`` or micro-batch by
micro-batch.

A rank with no work calls ``step(None)`` and runs a dummy batch built from the runner's
StaticInput pad values (what graphs are captured on) at ``DPDecision.dummy_tokens``.
"""

from __future__ import annotations

import torch

from graphplan.compiler.errors import BatchError
from graphplan.compiler.records import decode_token_range, is_uniform_decode, padded_num_reqs

from ..buffers import as_tuple, real_rows
from .agreement import DPCoordinator, DPDecision, DPError, contribution
from .ubatch import (
    UbatchStreams,
    run_ubatches,
    slice_inputs,
    sm_carveout,
    ubatch_slices,
    uniform_query_lens,
)


def pad_inputs(specs, inputs: dict[str, torch.Tensor], tokens: int, reqs: int) -> dict:
    """New tensors holding ``inputs`` grown to ``tokens`` / ``reqs`` rows with each input's pad
    value (``"last"`` repeats the last row, or 0 with no rows)."""
    out = {}
    for s in specs:
        t, want = inputs[s.name], s.rows(tokens, reqs)
        extra = want - t.shape[0]
        if extra <= 0:
            out[s.name] = t
            continue
        if s.pad == "last" and t.shape[0]:
            fill = t[-1:].expand(extra, *t.shape[1:])
        else:
            fill = t.new_full((extra, *t.shape[1:]), s.fill)
        out[s.name] = torch.cat([t, fill])
    return out


def _shape(n: int, num_reqs, max_query_len, num_active_loras) -> tuple:
    """What prepare() announces and step() must match (any batch without tokens is "no work")."""
    return (n, num_reqs, max_query_len, num_active_loras) if n else (0, None, None, 0)


def _shape_text(n: int, num_reqs, max_query_len, num_active_loras) -> str:
    if not n:
        return "no work"
    return (
        f"{n} tokens, num_reqs={num_reqs}, max_query_len={max_query_len}, "
        f"num_active_loras={num_active_loras}"
    )


def dummy_shape(tokens: int, q: int, max_num_seqs: int) -> tuple[int, int]:
    """(num_reqs, max_query_len) of an idle rank's dummy batch: uniform decode when it can be
    (so FULL decode graphs replay), else as many requests as allowed."""
    if tokens in decode_token_range(q, max_num_seqs):
        return padded_num_reqs(tokens, max_num_seqs, q), q
    reqs = padded_num_reqs(tokens, max_num_seqs)
    return reqs, -(-tokens // reqs)  # the longest request: tokens / reqs, rounded up


class DPRunner:
    """Wraps a GraphRunner whose table has ``data_parallel_size`` > 1 (or a DP group of one).

    ``coordinator`` defaults to one made from the table (backend, timeout) over the world group.
    At construction every rank checks that all ranks loaded the same table (collective).
    """

    def __init__(
        self,
        runner,
        coordinator: DPCoordinator | None = None,
        *,
        check_fingerprint: bool = True,
        comm_sms: int | None = None,
    ):
        self.runner, self.table = runner, runner.table
        self.comm_sms = comm_sms  # SMs matmuls leave to communication while ubatches overlap
        self.coord = coordinator or DPCoordinator.for_table(self.table)
        if check_fingerprint:
            self.coord.check_fingerprint(self.table.content_fingerprint)
        want = self.table.settings.data_parallel_size
        if self.coord.size not in (1, want):
            raise DPError(
                f"the plan has parallel.data_parallel_size={want}, but the DP group has "
                f"{self.coord.size} ranks: compile the plan for {self.coord.size} ranks "
                f"(--set parallel.data_parallel_size={self.coord.size})"
            )
        ub = self.table.settings.ubatch
        self.k = ub.num_ubatches
        self.streams = UbatchStreams(runner.device, self.k) if ub.enabled else None
        self.specs = runner.buffers.specs
        self._offsets = next((s.name for s in self.specs if s.per == "req+1"), None)
        self._dummies: dict = {}
        self.last_decision: DPDecision | None = None
        self._announced: tuple | None = None  # the shape prepare() started an exchange for
        self.counts = {
            "steps": 0,
            "idle_steps": 0,
            "dummy_steps": 0,
            "ubatched_steps": 0,
            "ubatch_aborted": 0,
            "dp_padding_tokens": 0,
        }
        runner.ubatch_body = self._ubatch_body  # capture records ubatched keys with this body

    def capture(self, modes: tuple[str, ...] | None = None) -> dict:
        """The runner's capture (its default modes unless given); ubatched keys included."""
        return self.runner.capture() if modes is None else self.runner.capture(modes)

    # -- the step -------------------------------------------------------------------------------
    def step(
        self,
        inputs: dict[str, torch.Tensor] | None = None,
        num_reqs: int | None = None,
        max_query_len: int | None = None,
        num_active_loras: int = 0,
        query_lens: list[int] | None = None,
    ):
        """One DP step; every rank calls it, with ``inputs=None`` when it has no work.

        Returns the outputs for the real tokens (views valid until the next step), or None on a
        rank without work. ``query_lens`` (tokens per request) is needed only when a mixed batch
        is micro-batched; without it they come from the ``req+1`` input (a host sync). A bad
        batch raises BatchError before the all-reduce, and the peers then time out: validate
        batches before stepping.
        """
        table, runner = self.table, self.runner
        n = 0 if inputs is None else runner.buffers.num_tokens(inputs)
        if self._announced is None:
            route = (
                None
                if inputs is None
                else table.route(n, num_reqs, max_query_len, num_active_loras)
            )
        elif _shape(n, num_reqs, max_query_len, num_active_loras) != self._announced:
            got = _shape_text(n, num_reqs, max_query_len, num_active_loras)
            raise BatchError(
                f"step() got a batch of shape {got}, but prepare() announced "
                f"{_shape_text(*self._announced)} and the DP peers are agreeing on that one: call "
                "step() with the announced batch (inputs=None if it had no tokens)"
            )
        if inputs is not None:
            runner.buffers.check(inputs, n, num_reqs)
        if self._announced is None:
            d = self.coord.sync(*contribution(n, route))
        else:  # the exchange prepare() started: only collect it
            self._announced = None
            d = self.coord.finish()
        self.last_decision = d
        c = self.counts
        c["steps"] += 1
        c["ubatch_aborted"] += d.ubatch_aborted
        if d.idle:
            c["idle_steps"] += 1
            return None
        dummy = inputs is None
        if dummy:
            c["dummy_steps"] += 1
            n = d.dummy_tokens
            num_reqs, max_query_len = dummy_shape(n, table.q, table.max_num_seqs)
            num_active_loras, query_lens = 0, None
            inputs = self._dummy(n, num_reqs)
        route = table.route(
            n,
            num_reqs,
            max_query_len,
            num_active_loras,
            allow=d.mode,
            pad_to=d.pad_to,
            ubatched=d.ubatch,
        )
        me = self.coord.rank
        if d.num_tokens[me] and d.pad_to:  # beyond this rank's own padding
            c["dp_padding_tokens"] += d.pad_to - d.padded_tokens[me]
        out = self._execute(route, d, inputs, n, num_reqs, max_query_len, query_lens)
        return None if dummy else out

    __call__ = step

    def prepare(
        self,
        num_tokens: int = 0,
        num_reqs: int | None = None,
        max_query_len: int | None = None,
        num_active_loras: int = 0,
    ) -> None:
        """Start the next step's DP exchange now, from the batch's shape alone, so that it runs
        while the current step's GPU work does (a scheduler knows the next batch's shape before
        the sampled tokens that fill it exist). The next ``step()`` must get a batch of exactly
        this shape (``num_tokens=0``: no work, ``step(None)``) and only collects the agreement.
        A shape the table rejects raises BatchError here, before anything is sent."""
        if self._announced is not None:
            raise BatchError(
                f"prepare() was already called for the next step "
                f"({_shape_text(*self._announced)}): call step() first"
            )
        route = (
            self.table.route(num_tokens, num_reqs, max_query_len, num_active_loras)
            if num_tokens
            else None
        )
        self.coord.start(*contribution(num_tokens, route))
        self._announced = _shape(num_tokens, num_reqs, max_query_len, num_active_loras)

    def _execute(self, route, d: DPDecision, inputs, n, num_reqs, max_query_len, query_lens):
        runner, gid = self.runner, route.graph_id
        captured = runner.has_graph(gid)
        if d.ubatch:
            self.counts["ubatched_steps"] += 1
            if captured:
                return runner.execute(route, inputs, n, num_reqs)
            return self._eager_ubatched(route, inputs, n, num_reqs, max_query_len, query_lens)
        if captured or route.padded_tokens <= n:
            return runner.execute(route, inputs, n, num_reqs)
        # no graph, but peers run the agreed size: run it too, eagerly
        runner.record_eager(route)
        padded = pad_inputs(self.specs, inputs, route.padded_tokens, num_reqs or 0)
        return real_rows(runner.run_eager(padded), n)

    def _eager_ubatched(self, route, inputs, n, num_reqs, max_query_len, query_lens):
        runner, table = self.runner, self.table
        runner.record_eager(route)
        reqs = num_reqs or 0
        if query_lens is None:
            if reqs and is_uniform_decode(n, reqs, max_query_len, table.q):
                query_lens = uniform_query_lens(n, table.q)
            elif self._offsets is not None and reqs:
                query_lens = inputs[self._offsets][: reqs + 1].diff().tolist()
            else:  # no per-request inputs: tokens are independent
                query_lens, reqs = [1] * n, 0
        padded_reqs = max(route.padded_reqs or 0, reqs)
        padded = pad_inputs(self.specs, inputs, route.padded_tokens, padded_reqs)
        slices = ubatch_slices(
            query_lens, route.padded_tokens, self.k, max(padded_reqs, len(query_lens))
        )
        ubatches = [slice_inputs(self.specs, padded, sl) for sl in slices]
        # the runner's eager model (run_eager's), as the model wrote it: its forward_stages, if
        # it has them, interleave the micro-batches
        with torch.no_grad(), sm_carveout(self.comm_sms):
            outs = run_ubatches(runner.eager_model, ubatches, self.streams)
        parts = [as_tuple(o) for o in outs]
        full = tuple(torch.cat(cols) for cols in zip(*parts))
        return real_rows(full if len(full) > 1 else full[0], n)

    def _dummy(self, tokens: int, reqs: int) -> dict:
        key = (tokens, reqs)
        batch = self._dummies.get(key)
        if batch is None:
            dev = self.runner.device
            batch = {
                s.name: torch.full(
                    (s.rows(tokens, reqs), *s.trailing), s.fill, dtype=s.dtype, device=dev
                )
                for s in self.specs
            }
            if len(self._dummies) > 64:
                self._dummies.clear()
            self._dummies[key] = batch
        return batch

    # -- capture hook ---------------------------------------------------------------------------
    def _ubatch_body(self, key, views: dict, tokens: int, outputs: tuple):
        """The function a ubatched graph records: the ubatch schedule over the static views of a
        uniform-decode batch of ``key.num_tokens`` tokens, outputs copied into the static rows."""
        if self.streams is None:
            raise BatchError("the table has ubatched graphs but ubatching is off")
        runner, specs, k = self.runner, self.specs, self.k
        slices = ubatch_slices(
            uniform_query_lens(key.num_tokens, self.table.q), key.num_tokens, k, key.num_reqs
        )
        model, streams = runner.model, self.streams

        def fn():
            with sm_carveout(self.comm_sms):
                outs = run_ubatches(
                    model, [slice_inputs(specs, views, sl) for sl in slices], streams
                )
            for sl, out in zip(slices, outs):
                for dst, src in zip(outputs, as_tuple(out)):
                    dst[sl.token_start : sl.padded_token_stop].copy_(src)

        return fn

    def stats(self) -> dict:
        """The runner's stats plus DP counters and the time spent in the DP all-reduce."""
        s = self.runner.stats()
        s["dp"] = {
            **self.counts,
            "rank": self.coord.rank,
            "size": self.coord.size,
            "backend": self.coord.backend,
            "sync_seconds": self.coord.sync_seconds,
        }
        return s
