"""The step protocol between tensor-parallel ranks (docs/semantics.md §7.7): rank 0 schedules,
and before each step it broadcasts what the other ranks need to run the identical step (the
step's ``reqs``: seat, start and token ids per request; ``num_reqs``; ``max_query_len``; and,
with rank 0's KV pool, the blocks each request's seat got since the last step), and each seat it
releases. Rank 0's scheduler alone decides the blocks (prefix caching included: a request may
start on cached blocks): the followers' pools take the rows they are sent (``assign``). The other ranks (``follow``) run ``model.make_batch`` and
``runner.step`` on what they receive, so every rank runs the same collectives in the same
order. The first message is the table's fingerprint: a rank whose table differs stops with an
error naming both.

Messages are int64 tensors over a CPU (Gloo) process group: a header ``[op, length]``, then
``length`` integers. No objects are pickled. Steps are synchronous (a TP engine runs without
async scheduling: the tokens of a speculated step would have to reach the workers too).

With data parallelism (a DP x TP plan, server/core/dp_serving.py) rank 0 also sends ``DUMMY``
before each of its dummy steps (its engine is idle while a DP peer has work: the follower runs
``runner.step(None)``), and, inside every step, the DP group's ``DECISION`` (``encode_decision``),
which the follower's ``DPRunner`` takes in place of an exchange of its own, so it runs the same
route at the same padded size as rank 0."""

from __future__ import annotations

import torch
import torch.distributed as dist

HELLO, STEP, RELEASE, STOP, DUMMY, DECISION = 1, 2, 3, 4, 5, 6


class RankProtocolError(RuntimeError):
    """A rank received what it did not expect (another table, an unknown operation)."""


def _send(group, op: int, payload: list[int]) -> None:
    dist.broadcast(torch.tensor([op, len(payload)], dtype=torch.int64), 0, group=group)
    if payload:
        dist.broadcast(torch.tensor(payload, dtype=torch.int64), 0, group=group)


def _recv(group) -> tuple[int, list[int]]:
    head = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(head, 0, group=group)
    op, n = (int(v) for v in head.tolist())
    if not n:
        return op, []
    body = torch.zeros(n, dtype=torch.int64)
    dist.broadcast(body, 0, group=group)
    return op, body.tolist()


def encode_step(reqs, num_reqs: int, max_query_len: int, blocks=None) -> list[int]:
    """``blocks``: per request ``(first, block ids)``, the KV blocks of its seat's row from index
    ``first`` that rank 0's scheduler gave it since the last step (None: the followers allocate
    their own, in rank 0's order, as without prefix caching)."""
    out = [num_reqs, max_query_len, len(reqs)]
    for i, (seat, start, ids) in enumerate(reqs):
        first, row = blocks[i] if blocks is not None else (-1, ())
        out += [int(seat), int(start), len(ids), *(int(t) for t in ids)]
        out += [int(first), len(row), *(int(b) for b in row)]
    return out


def decode_step(body: list[int]):
    """``encode_step``'s integers back: (reqs, num_reqs, max_query_len, blocks or None)."""
    num_reqs, max_query_len, n = body[:3]
    reqs, blocks, i = [], [], 3
    for _ in range(n):
        seat, start, k = body[i : i + 3]
        reqs.append((seat, start, body[i + 3 : i + 3 + k]))
        i += 3 + k
        first, k = body[i : i + 2]
        blocks.append((first, body[i + 2 : i + 2 + k]))
        i += 2 + k
    return reqs, num_reqs, max_query_len, (blocks if n and blocks[0][0] >= 0 else None)


def encode_decision(d) -> list[int]:
    """A ``DPDecision`` as integers: mode, ubatch, pad_to (-1: None), aborted, size, the tokens
    and padded tokens per DP rank."""
    pad = -1 if d.pad_to is None else int(d.pad_to)
    head = [int(d.mode), int(d.ubatch), pad, int(d.ubatch_aborted), len(d.num_tokens)]
    return head + [int(t) for t in d.num_tokens] + [int(t) for t in d.padded_tokens]


def decode_decision(body: list[int]):
    from graphplan.compiler.records import RuntimeMode
    from graphplan.runtime.dp import DPDecision

    mode, ubatch, pad, aborted, n = body[:5]
    return DPDecision(
        RuntimeMode(mode),
        bool(ubatch),
        None if pad < 0 else pad,
        tuple(body[5 : 5 + n]),
        tuple(body[5 + n : 5 + 2 * n]),
        bool(aborted),
    )


def receive_decision(group=None):
    """A follower's side of a DP step: rank 0's ``DECISION``."""
    op, body = _recv(group)
    if op != DECISION:
        raise RankProtocolError(f"tensor-parallel rank: expected a DP decision, got operation {op}")
    return decode_decision(body)


class StepSender:
    """Rank 0's side: ``hello`` once, then ``step`` before each of its own steps, ``release``
    with each of its seat releases, ``stop`` at the end."""

    def __init__(self, group=None):
        self.group = group

    def hello(self, fingerprint: str) -> None:
        _send(self.group, HELLO, list(fingerprint.encode()))

    def step(self, reqs, num_reqs: int, max_query_len: int, blocks=None) -> None:
        _send(self.group, STEP, encode_step(reqs, num_reqs, max_query_len, blocks))

    def release(self, seat: int) -> None:
        _send(self.group, RELEASE, [int(seat)])

    def stop(self) -> None:
        _send(self.group, STOP, [])

    def dummy(self) -> None:
        _send(self.group, DUMMY, [])

    def decision(self, d) -> None:
        _send(self.group, DECISION, encode_decision(d))


def receive_hello(fingerprint: str, group=None) -> None:
    """Rank 0's first message: RankProtocolError unless it names this rank's table."""
    op, body = _recv(group)
    theirs = bytes(body).decode(errors="replace")
    if op != HELLO or theirs != fingerprint:
        raise RankProtocolError(
            f"tensor-parallel rank {dist.get_rank()}: rank 0 serves table {theirs!r}, this rank "
            f"loaded {fingerprint!r}; start every rank from the same plan and model"
        )


def follow(model, runner, fingerprint: str, group=None, *, greeted: bool = False) -> int:
    """A worker rank's loop: run every step rank 0 sends until ``stop``; the number of steps.
    ``greeted``: rank 0's hello was already received (``receive_hello``, before loading).
    RankProtocolError when rank 0's table is not this rank's, or when the model runs its LM head
    outside the graph (``logits="rows"``: rank 0 alone would gather its logits)."""
    if getattr(model, "logits_mode", "all") != "all":
        raise RankProtocolError(
            "tensor-parallel serving needs every token's logits from forward (logits='all'): "
            "the LM head's all-gather must run inside every rank's step"
        )
    if not greeted:
        receive_hello(fingerprint, group)
    steps = 0
    while True:
        op, body = _recv(group)
        if op == STOP:
            return steps
        if op == RELEASE:
            model.release(body[0])
        elif op == STEP:
            reqs, num_reqs, max_query_len, blocks = decode_step(body)
            if blocks is not None:  # rank 0's prefix-cached rows: this rank decides no block
                for (seat, _, _), (first, row) in zip(reqs, blocks):
                    model.kv_pool.assign(seat, first, row)
            with torch.no_grad():
                runner.step(model.make_batch(reqs), num_reqs, max_query_len)
            steps += 1
        elif op == DUMMY:  # a DP dummy step: the decision follows inside runner.step
            with torch.no_grad():
                runner.step(None)
        else:
            raise RankProtocolError(f"tensor-parallel rank: unknown operation {op} from rank 0")
