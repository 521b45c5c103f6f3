"""Micro-batching (DBO, docs/semantics.md §8): ubatch slices as pure functions, and a scheduler that
runs the ubatches on their own compute streams with one communication stream, so one ubatch's
collectives overlap another's compute.

A model takes part in the overlap by offering ``forward_stages(**inputs)``: a generator that yields
``Collective(fn, args)`` at each communication point and gets ``fn(*args)`` sent back (``drive``
runs such a generator inline, which is what the model's plain ``forward`` does). A model without it
runs each ubatch as one stage. On CUDA the schedule is, per stage s and ubatch i:

    compute[i]:  wait comm_done[i] (s-1), wait compute_done[i-1] (s)  ->  compute  -> record
    comm:        wait compute_done[i] (s)  ->  fn(*args)  ->  record comm_done[i] (s)

so comm of ubatch 0 runs while ubatch 1 computes, every rank issues its collectives in the same
order (stage-major, ubatch-minor), and ubatch i never overtakes ubatch i-1 within a stage (a request
split across ubatches reads the K/V its first part wrote). The schedule forks from and joins back
to the caller's stream, so it records into a CUDA graph as it runs. On the CPU the same loop runs
with no streams: sequential.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

# -- slicing (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class UbatchSlice:
    """One micro-batch: tokens [token_start, token_stop) and requests [req_start, req_stop) of
    the real batch; only the last slice is padded, to ``padded_token_stop`` / ``padded_req_stop``."""

    token_start: int
    token_stop: int
    """Real tokens end here (the real token count for the last slice)."""
    padded_token_stop: int
    """The slice runs up to here (= token_stop except for the last slice)."""
    req_start: int
    req_stop: int
    """Requests whose tokens meet the slice; a request crossing a split point is in both."""
    padded_req_stop: int

    @property
    def num_tokens(self) -> int:
        return self.padded_token_stop - self.token_start

    @property
    def num_reqs(self) -> int:
        return self.padded_req_stop - self.req_start


def last_ubatch_empty(padded_tokens: int, unpadded_min: int, num_ubatches: int) -> bool:
    """True when the agreed padded size would leave the last ubatch of the smallest rank empty."""
    return (padded_tokens // num_ubatches) * (num_ubatches - 1) >= unpadded_min


def ubatch_slices(
    query_lens: Sequence[int], padded_tokens: int, num_ubatches: int, padded_reqs: int | None = None
) -> tuple[UbatchSlice, ...]:
    """Split a batch (``query_lens``: tokens per request) padded to ``padded_tokens`` tokens and
    ``padded_reqs`` requests (default: the real count) into ``num_ubatches`` slices at multiples
    of ``padded_tokens // num_ubatches``. The real tokens must reach into the last slice."""
    k, total, n_reqs = num_ubatches, int(sum(query_lens)), len(query_lens)
    reqs_pad = n_reqs if padded_reqs is None else padded_reqs
    split = padded_tokens // k
    if k < 2 or split < 1:
        raise ValueError(f"cannot split {padded_tokens} tokens into {k} ubatches")
    if not split * (k - 1) < total <= padded_tokens or reqs_pad < n_reqs:
        raise ValueError(
            f"{total} real tokens in {n_reqs} requests do not fit {k} ubatches of "
            f"{padded_tokens} tokens / {reqs_pad} requests (last ubatch empty?)"
        )
    if any(q < 1 for q in query_lens):
        raise ValueError("every real request needs at least one token")
    ends, acc = [], 0  # [num_reqs] token offset where each request ends
    for q in query_lens:
        acc += q
        ends.append(acc)
    out, req = [], 0
    for i in range(k):
        start, last = i * split, i == k - 1
        stop = total if last else start + split
        while ends[req] <= start:  # first request with a token at or after start
            req += 1
        first = req
        while req < n_reqs - 1 and ends[req] < stop:  # last request with a token before stop
            req += 1
        out.append(
            UbatchSlice(
                token_start=start,
                token_stop=stop,
                padded_token_stop=padded_tokens if last else stop,
                req_start=first,
                req_stop=req + 1,
                padded_req_stop=reqs_pad if last else req + 1,
            )
        )
    return tuple(out)


def uniform_query_lens(num_tokens: int, q: int) -> list[int]:
    """Requests of a uniform-decode batch of ``num_tokens`` tokens (a multiple of q)."""
    return [q] * (num_tokens // q)


def slice_inputs(
    specs, inputs: dict[str, torch.Tensor], sl: UbatchSlice
) -> dict[str, torch.Tensor]:
    """One ubatch's inputs from a padded batch: per-token and per-request rows are views;
    ``req+1`` inputs are cumulative token offsets (query_start_loc), clipped to the slice and
    rebased to 0 (a few kernels, recorded into a graph like the rest)."""
    out = {}
    for s in specs:
        t = inputs[s.name]
        if s.per == "token":
            out[s.name] = t[sl.token_start : sl.padded_token_stop]
        elif s.per == "req":
            out[s.name] = t[sl.req_start : sl.padded_req_stop]
        else:
            offsets = t[sl.req_start : sl.padded_req_stop + 1]
            out[s.name] = offsets.clamp(sl.token_start, sl.padded_token_stop) - sl.token_start
    return out


# -- running ubatches ---------------------------------------------------------------------------


class Collective(NamedTuple):
    """What a staged forward yields: run ``fn(*args)`` on the comm stream, send the result back."""

    fn: Callable
    args: tuple


def drive(stages):
    """Run a staged forward inline (no overlap): every Collective runs where it is yielded."""
    try:
        req = next(stages)
        while True:
            req = stages.send(req.fn(*req.args))
    except StopIteration as stop:
        return stop.value


def _single_stage(model, kw):
    return model(**kw)
    yield  # unreachable: makes this a generator with no communication point


class UbatchStreams:
    """Per-ubatch compute streams and one comm stream on a CUDA device; None-like on the CPU."""

    def __init__(self, device: torch.device | str, num_ubatches: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.compute = [torch.cuda.Stream(self.device) for _ in range(num_ubatches)]
            self.comm = torch.cuda.Stream(self.device, priority=-1)  # comm first: it gates overlap


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)


@contextlib.contextmanager
def sm_carveout(comm_sms: int | None):
    """Inside: cuBLASLt matmuls target all SMs but ``comm_sms``, so the other ubatch's NCCL kernel
    finds SMs free and runs beside them instead of after them (vLLM's ``comm_sms``; PyTorch's
    experimental carveout, baked into kernels captured inside). A no-op when None/0 or when this
    torch lacks the switch."""
    set_ = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if not comm_sms or set_ is None:
        yield
        return
    previous = torch._C._get_sm_carveout_experimental()
    set_(comm_sms)
    try:
        yield
    finally:
        set_(previous)


def run_ubatches(model, ubatch_inputs: list[dict], streams: UbatchStreams | None = None) -> list:
    """Run ``model`` on each ubatch's inputs with the interleaved schedule (module docstring).
    Returns each ubatch's output, in order. On CUDA, outputs are ready on the caller's stream."""
    stages = getattr(model, "forward_stages", None)
    gens = [
        stages(**kw) if stages is not None else _single_stage(model, kw) for kw in ubatch_inputs
    ]
    k = len(gens)
    out: list = [None] * k
    done = [False] * k
    send: list = [None] * k
    if streams is None or not streams.cuda:  # the same schedule, sequential
        while not all(done):
            for i in range(k):
                if done[i]:
                    continue
                try:
                    req = gens[i].send(send[i])
                except StopIteration as stop:
                    out[i], done[i] = stop.value, True
                    continue
                send[i] = req.fn(*req.args)
        return out
    assert streams is not None  # cuda above
    caller = torch.cuda.current_stream(streams.device)
    compute, comm = streams.compute, streams.comm
    fork = caller.record_event()
    for s in (*compute, comm):
        s.wait_event(fork)
    comm_done: list = [None] * k
    finished: list = [None] * k
    while not all(done):
        prev = None  # ubatch i-1 finished this stage's compute
        for i in range(k):
            if done[i]:
                continue
            s = compute[i]
            with torch.cuda.stream(s):
                if comm_done[i] is not None:
                    s.wait_event(comm_done[i])
                if prev is not None:
                    s.wait_event(prev)
                try:
                    req = gens[i].send(send[i])
                except StopIteration as stop:
                    out[i], done[i] = stop.value, True
                    finished[i] = prev = s.record_event()
                    continue
                prev = s.record_event()
            for t in _tensors(req.args):
                t.record_stream(comm)  # freed by compute[i] before comm ran: keep the block
            with torch.cuda.stream(comm):
                comm.wait_event(prev)
                send[i] = req.fn(*req.args)
                comm_done[i] = comm.record_event()
            for t in _tensors(send[i]):
                t.record_stream(s)
    for i in range(k):
        caller.wait_event(finished[i])
        for t in _tensors(out[i]):
            t.record_stream(caller)
    caller.wait_stream(comm)
    return out
