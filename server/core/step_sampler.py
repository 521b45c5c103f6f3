"""The engine's sampling step: the batched ``Sampler`` (server/core/sampling.py) over the logits rows
that sample this step, one sampler slot per KV-cache row, replayed as captured graphs.

A request binds its row's slot the first time it samples in that row: its parameters, its seed and,
after a preemption moved it to another row, the tokens it already generated (the step counter its
noise reads and the history its penalties read), so a seeded request gives the same tokens alone, in
any batch and across preemptions. A step whose every row is greedy, unpenalised and asks for no
logprobs takes the argmax directly (one kernel, cheaper than the sampler's sort; the sampler's own
greedy rows give the same tokens).

Every other step replays one graph (``graphs=True``, the default), whatever its mix of greedy,
sampled and penalised rows. Graphs are captured once per padded row count R of ``graph_sizes``
(powers of two up to the number of slots, and that number: a step of n rows pads to the smallest R
>= n), each in eight variants (``Work``): with or without logprobs (a softmax and a top-k over
[R, vocab], only when a request asked for them), truncation thresholds (a sort over [R, vocab], only
when a row has top_k, top_p or min_p on) and penalties (only when a row is penalised), so a step
pays for what its rows ask and nothing else; largest first into the sampler's own pool (its own ``CudaGraphs``: the
smaller graphs reuse the largest one's temporaries). A graph holds ``Sampler.sample`` and
``Sampler.update`` (step counters and histories are device tensors) over static buffers:

- ``_logits`` [slots, vocab] float32: the step's sampled rows, copied in with one ``index_select``;
- ``_staged`` [2 * slots] int64: the step's logits rows then, from offset R, its R slots padded
  with the sampler's ``pad_slot`` (greedy, never bound: its counter and history change, harmlessly,
  and a real slot appears once per step, so it is updated exactly once), copied from a pinned host
  buffer in one non-blocking copy;
- outputs: the tokens [R] int64, or with logprobs [R, 2 + 2 * MAX_LOGPROBS] float32 (token, its
  logprob, the top logprobs, their ids: ids below 2**24 are exact in float32), read back to the
  host in one ``tolist()``, the step's one wait for the device.

On a CPU the runtime's stand-in records each graph as a tape of aten calls on the same buffers
(runtime/graphs.py), so CI runs exactly this replay path. Memory: the pool holds the temporaries of
the largest graph; with the static logits it stays within ``SAMPLER_BYTES_PER_LOGIT`` per slot and
vocabulary entry, what models/hf/step_memory.py reserves (a GPU test checks it at 64 x 32000).
``graphs=False``, or after ``release_graphs()``, runs the same step eagerly on n rows. ``fused``
(``serve --fused-sampler``): the sampler's noise, mask and argmax as one Triton kernel
(server/core/sampling_kernels.py), in the same graphs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar, Hashable, Sequence

import torch

from graphplan.runtime.graphs import Graph, GraphBackend, graph_backend

from ..requests import Request, Sampled
from .batching import StepBatch
from .sampling import Sampler
from .step_logits import StepLogits, step_logits

MAX_LOGPROBS = 20


def graph_sizes(max_rows: int) -> tuple[int, ...]:
    """The padded row counts the sampler captures, largest first: ``max_rows`` and every power of
    two below it (a step of n rows pads to at most 2n)."""
    powers = {1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows}
    return tuple(sorted(powers | {max_rows}, reverse=True))


class StepSampler:
    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        device: torch.device | str,
        *,
        graphs: bool = True,
        fused: bool = False,
    ):
        self.device = torch.device(device)
        self.sampler = Sampler(
            num_slots,
            vocab_size,
            device=self.device,
            max_logprobs=MAX_LOGPROBS,
            penalties=True,
            fused=fused,
        )
        self._owner: list[Request | None] = [None] * num_slots
        self.sizes = graph_sizes(num_slots)
        # [n] -> the padded row count of a step of n rows (array lookup, no search per step)
        self._size_for = [0] + [
            min(s for s in self.sizes if s >= n) for n in range(1, num_slots + 1)
        ]
        pinned = self.device.type == "cuda"
        # two pinned staging buffers, used in turn: with async scheduling a step stages while
        # the previous one's copy may still wait on the device (it is done once its tokens are
        # read, before the step after next stages)
        self._hosts = [
            torch.zeros(2 * num_slots, dtype=torch.int64, pin_memory=pinned) for _ in range(2)
        ]
        self._turn = 0
        self._staged = torch.full(
            (2 * num_slots,), self.sampler.pad_slot, dtype=torch.int64, device=self.device
        )
        self._logits = torch.zeros(num_slots, vocab_size, dtype=torch.float32, device=self.device)
        self._graphs: dict[tuple[int, Work], tuple[Graph, torch.Tensor]] = {}
        self.backend: GraphBackend | None = None
        self.capture_bytes = 0
        """Bytes the capture added on the device (the sampler's pool); 0 on the CPU stand-in."""
        if graphs:
            self._capture()

    def sample(self, batch: StepBatch, logits: StepLogits | torch.Tensor) -> list[Sampled]:
        """One ``Sampled`` per request that samples this step, in ``batch.sampling_rows`` order."""
        return self.launch(batch, logits).read()

    @torch.no_grad()
    def launch(
        self, batch: StepBatch, logits: StepLogits | torch.Tensor, *, keep: bool = False
    ) -> Pending:
        """Start the step's sampling on the device; ``read()`` the result. ``logits``: the step's
        (server/core/step_logits.py; a tensor: every token row's), read at the sampled rows. ``keep`` (async
        scheduling, server/core/pipeline.py): the tokens stay valid while later steps sample (a copy
        of the graph's output), as ``Pending.tokens`` on the device, and their copy to the host
        (with the logprobs, when a request asked for them) starts now, so ``read()`` waits for
        this step alone, not for a step launched after it."""
        rows = batch.sampling_rows
        if not rows:
            return Pending([], None, None, (), False)
        logits = step_logits(logits)
        reqs = _sampling_requests(batch.request_ids, batch.sample_rows)
        n = len(rows)
        work = Work.of(reqs)
        if not (work.logprobs or work.penalise) and all(r.params.greedy for r in reqs):
            index, _ = self._stage(rows, (), n)
            return _pending(logits.rows(index).argmax(dim=-1), reqs, False, keep)
        slots = batch.sampling_cache_rows
        for r, slot in zip(reqs, slots):
            if self._owner[slot] is not r:
                self._bind(r, slot)
        size = self._size_for[n] if self._graphs else n
        index, _ = self._stage(rows, slots, size)
        logits.rows(index, into=self._logits[:n])
        graph = self._graphs.get((size, work))
        if graph is None:
            out = self._step(size, work)
        else:
            graph[0].replay()
            out = graph[1]
        return _pending(out[:n].clone() if keep else out[:n], reqs, work.logprobs, keep)

    def _stage(
        self, rows: Sequence[int], slots: Sequence[int], size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step's logits rows and its slots (padded to ``size`` with ``pad_slot``) to the
        device in one non-blocking copy; returns their views [n] and [size]. The pinned host
        buffer is free again: the read of the step before the previous waited for its copy."""
        self._turn ^= 1
        n, pinned = len(rows), self._hosts[self._turn]
        host = pinned.numpy()
        host[:n] = rows
        host[size : size + len(slots)] = slots
        host[size + len(slots) : 2 * size] = self.sampler.pad_slot
        self._staged[: 2 * size].copy_(pinned[: 2 * size], non_blocking=True)
        return self._staged[:n], self._staged[size : 2 * size]

    def _step(self, size: int, work: Work) -> torch.Tensor:
        """What a graph holds: sample ``size`` rows of the static logits for the staged slots
        doing ``work``, record the tokens in the slots' state, and pack what the host reads."""
        slots = self._staged[size : 2 * size]
        out = self.sampler.sample(
            self._logits[:size],
            slots,
            logprobs=work.logprobs,
            truncate=work.truncate,
            penalise=work.penalise,
        )
        self.sampler.update(slots, out.token_ids)
        if not work.logprobs:
            return out.token_ids
        assert out.logprobs is not None and out.top_logprobs is not None
        assert out.top_ids is not None
        return torch.cat(
            [out.token_ids[:, None].float(), out.logprobs[:, None], out.top_logprobs]
            + [out.top_ids.float()],
            dim=1,
        )

    def _capture(self) -> None:
        """Capture every (size, work) graph, largest first, into the sampler's own pool, each
        size warmed up once eagerly first (lazy kernel loading, the sort's workspace). Only
        ``pad_slot`` is staged meanwhile, so the warm-ups and the stand-in's recording runs change
        no real slot. On any failure, an interrupt included, nothing stays captured."""
        backend = graph_backend(self.device)
        self.backend = backend
        self._staged.fill_(self.sampler.pad_slot)
        try:
            with torch.no_grad():
                before = backend.memory_used()
                for size in self.sizes:
                    self._step(size, Work.ALL)
                    for work in Work.every():
                        segment = backend.open_segment()
                        try:
                            out = self._step(size, work)
                        except BaseException:
                            segment.abort()
                            raise
                        self._graphs[size, work] = (segment.close(), out)
                self.capture_bytes = backend.memory_used() - before
        except BaseException:
            self.release_graphs()
            raise

    def release_graphs(self) -> None:
        """Drop the graphs and return their pool (the engine stops); later steps run eagerly."""
        self._graphs.clear()
        if self.backend is not None:
            self.backend.release()
            self.backend = None

    def bind(self, reqs: Sequence[Request], slots: Sequence[int]) -> None:
        """Give each request its slot's sampler state, where it does not hold it yet (a step
        that samples outside ``launch``: speculative decoding, server/core/spec/step.py)."""
        for r, slot in zip(reqs, slots):
            if self._owner[slot] is not r:
                self._bind(r, slot)

    def _bind(self, r: Request, slot: int) -> None:
        self.sampler.set_row(slot, r.params, r.prompt)
        if r.out:  # moved here by a preemption: replay what it generated into the slot
            self.sampler.update([slot] * len(r.out), r.out)
        self._owner[slot] = r

    def release(self, r: Request) -> None:
        """Forget ``r``'s slot (it finished or was aborted)."""
        for i, owner in enumerate(self._owner):
            if owner is r:
                self._owner[i] = None


@dataclass(frozen=True, slots=True)
class Work:
    """What a step's sampling does beyond Gumbel-max over the scaled logits: the logprobs, the
    truncation thresholds, the penalties (``Sampler.sample``'s switches). A step does what any of
    its rows needs; a graph is captured for each combination."""

    logprobs: bool
    truncate: bool
    penalise: bool

    ALL: ClassVar[Work]

    @staticmethod
    def of(reqs: Sequence[Request]) -> Work:
        return Work(
            logprobs=any(r.logprobs is not None for r in reqs),
            truncate=any(r.params.truncates for r in reqs),
            penalise=any(r.params.penalised for r in reqs),
        )

    @staticmethod
    def every() -> list[Work]:
        return [Work(*flags) for flags in itertools.product((True, False), repeat=3)]


Work.ALL = Work(True, True, True)


class Pending:
    """A launched sampling step: ``tokens`` [n] int64 on the device (``launch(keep=True)``), and
    ``read()``, the step's one wait: for its own copy to the host (an event) when kept, else for
    the device."""

    def __init__(self, values, tokens, done, reqs, with_logprobs: bool):
        self._values, self.tokens, self._done = values, tokens, done
        self._reqs, self._with_logprobs = reqs, with_logprobs

    def read(self) -> list[Sampled]:
        if self._done is not None:
            self._done.synchronize()
        values = self._values.tolist() if isinstance(self._values, torch.Tensor) else self._values
        if not self._with_logprobs:
            return [Sampled(t) for t in values]
        k = MAX_LOGPROBS
        result = []
        for r, v in zip(self._reqs, values):
            if r.logprobs is None:
                result.append(Sampled(int(v[0])))
            else:
                top = r.logprobs
                pairs = tuple(zip(map(int, v[2 + k : 2 + k + top]), v[2 : 2 + top]))
                result.append(Sampled(int(v[0]), v[1], pairs))
        return result


def _pending(out: torch.Tensor, reqs: list[Request], with_logprobs: bool, keep: bool) -> Pending:
    if not keep:
        return Pending(out, None, None, reqs, with_logprobs)
    tokens = out[:, 0].long() if with_logprobs else out  # column 0: the ids (exact in float32)
    if out.device.type != "cuda":
        return Pending(out, tokens, None, reqs, with_logprobs)
    host = out.to("cpu", non_blocking=True)  # into pinned memory, ordered before later steps
    done = torch.cuda.Event()
    done.record()
    return Pending(host, tokens, done, reqs, with_logprobs)


def _sampling_requests(ids: Sequence[Hashable], sample_rows: Sequence[int]) -> list[Request]:
    out = []
    for rid, row in zip(ids, sample_rows):
        if row >= 0:
            assert isinstance(rid, Request)
            out.append(rid)
    return out
