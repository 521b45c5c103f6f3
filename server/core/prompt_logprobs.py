"""Prompt logprobs: what /v1/completions returns for the prompt's tokens with ``echo`` and
``logprobs`` (vLLM's ``prompt_logprobs``; OpenAI's legacy completions did the same).

Prompt token j (j >= 1) gets log p(prompt[j] | prompt[:j]): row j - 1 of the logits, the row of the
token before it, in the sampler's ``logprobs_mode="raw"`` convention (log_softmax of the model's
float32 logits, before penalties and temperature), with the request's top ``k`` alternatives.
Token 0 has none (its entry is null). A prompt prefilled in chunks over several steps gets, each
step, the positions its chunk's rows predict: a chunk at positions [start, start + n) predicts
tokens start + 1 .. start + n, of which those inside the prompt count; the prompt's last row
predicts the first generated token, which the sampler handles.

Each position is computed and sent once: ``Request.prompt_logprobs_sent`` is the next position to
send, so a preempted request that recomputes its prompt sends nothing twice. The work is on the
device: a gather of the rows of every request that asks, then log_softmax, the prompt token's
logprob and top-k per row, in blocks of rows (bounded temporaries), with one host read per step
for all requests together. ``launch`` before the step's sampling, ``read`` after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..requests import Request, Sampled
from .batching import StepBatch
from .outbox import Outbox
from .step_logits import StepLogits, step_logits

ROWS_PER_BLOCK = 256
"""log_softmax temporaries are [ROWS_PER_BLOCK, vocab] float32 at most."""


@dataclass(frozen=True, slots=True)
class Span:
    """One request's prompt positions this step: tokens ``first .. first + count - 1`` of its
    prompt, predicted by logits rows ``row .. row + count - 1``."""

    request: Request
    row: int
    first: int
    count: int


def spans(batch: StepBatch) -> list[Span]:
    """The prompt positions each request asking for prompt logprobs gets this step (not sent yet;
    batch order). Pure: no torch."""
    out, offset = [], 0
    for r, (_, start, toks) in zip(batch.request_ids, batch.reqs):
        if isinstance(r, Request) and r.prompt_logprobs is not None:
            first = max(start + 1, r.prompt_logprobs_sent)
            last = min(start + len(toks), len(r.prompt) - 1)
            if last >= first:
                out.append(Span(r, offset + first - 1 - start, first, last - first + 1))
        offset += len(toks)
    return out


@dataclass(frozen=True, slots=True)
class Pending:
    """A step's prompt logprobs, launched on the device, not read yet."""

    spans: list[Span]
    table: torch.Tensor
    """[rows, 1 + 2k] float64: the prompt token's logprob, the top-k logprobs, their ids."""
    k: int

    def read(self) -> dict[Request, list[Sampled]]:
        """Per request, its new prompt entries (positions in order); marks them sent."""
        rows = self.table.tolist()  # the one host read
        out, i, k = {}, 0, self.k
        for s in self.spans:
            r, kr = s.request, s.request.prompt_logprobs or 0
            entries = []
            for j in range(s.count):
                row = rows[i + j]
                top = tuple(zip((int(t) for t in row[1 + k : 1 + k + kr]), row[1 : 1 + kr]))
                entries.append(Sampled(r.prompt[s.first + j], row[0], top))
            i += s.count
            r.prompt_logprobs_sent = s.first + s.count
            out[r] = entries
        return out


def launch(batch: StepBatch, logits: StepLogits | torch.Tensor) -> Pending | None:
    """Start the step's prompt logprobs on the step's ``logits`` (server/core/step_logits.py; a tensor:
    every token row's), read at the prompt positions' rows; None when no request in ``batch``
    has prompt positions to send."""
    todo = spans(batch)
    if not todo:
        return None
    logits = step_logits(logits)
    dev, vocab = logits.device, logits.vocab
    rows: list[int] = []
    targets: list[int] = []
    for s in todo:
        rows += range(s.row, s.row + s.count)
        targets += s.request.prompt[s.first : s.first + s.count]
    k = min(max(s.request.prompt_logprobs or 0 for s in todo), vocab)
    index = torch.tensor([rows, targets], dtype=torch.int64).to(dev, non_blocking=True)
    parts = []
    for b in range(0, len(rows), ROWS_PER_BLOCK):
        block = index[:, b : b + ROWS_PER_BLOCK]
        lp = torch.log_softmax(logits.rows(block[0]), dim=-1)
        part = [lp.gather(1, block[1][:, None]).double()]
        if k:
            top = lp.topk(k, dim=-1)
            part += [top.values.double(), top.indices.double()]  # ids < 2**24: exact
        parts.append(torch.cat(part, dim=1))
    return Pending(todo, torch.cat(parts), k)


def merge_into(outbox: Outbox, found: dict[Request, list[Sampled]]) -> None:
    """Queue each request's ``(tag, "prompt_logprobs", entries)`` event in the engine's
    ``outbox`` (server/core/outbox.py), before the step's token events."""
    for r, entries in found.items():
        outbox.events(r.events).append((r.tag, "prompt_logprobs", entries))
