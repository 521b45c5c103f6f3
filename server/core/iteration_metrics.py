"""``graphplan:iteration_tokens`` and ``graphplan:iteration_requests``: histograms of tokens and
requests per engine step, label ``routine`` = ``decode`` (every request of the step has
``decode_query_len`` tokens) or ``mixed``, with the buckets docs/workload.md fixes, so that
``plan workload --from-metrics`` reads this server's scrape exactly (compiler/tools/metrics.py).

The buckets differ per routine (one per whole token count for decode steps; for mixed steps one
per whole token count up to the largest capture size, at most ``FINE_TOKENS``, then the capture
sizes, powers of two and max_num_batched_tokens), which prometheus_client's Histogram (one bucket
list per metric) cannot express: this is a custom collector. Mixed steps need the fine buckets as
much as decode ones: ``plan optimize`` can only move a size to a token count it can tell apart,
and above the largest capture size a step runs eager and pads nothing. Its buckets come from the
start-up table and stay fixed for the server's life, so scrapes over time subtract."""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Any, Iterator

from prometheus_client.core import HistogramMetricFamily

from graphplan.compiler.records import decode_token_range, is_uniform_decode

MAX_EDGE = 1 << 20
"""Powers of two up to this (the largest max_num_batched_tokens a plan may have): a plan reloaded
with a larger token budget still lands its mixed steps in finite buckets."""
ROUTINES = ("decode", "mixed")
FINE_TOKENS = 4096
"""Mixed steps get one bucket per token count up to the largest capture size, but no more than
this many (a scrape line each: about 230 KiB of text at most)."""


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


class IterationHistograms:
    def __init__(self, table: Any, max_num_seqs: int):
        decode_tokens = list(range(1, decode_token_range(table.q, max_num_seqs)[-1] + 1))
        fine = min(max(table.capture_sizes, default=0), FINE_TOKENS)
        mixed_tokens = sorted(
            {*range(1, fine + 1), *table.capture_sizes, *_powers(MAX_EDGE), table.max_tokens}
        )
        decode_reqs = list(range(1, max_num_seqs + 1))
        mixed_reqs = sorted({*_powers(max_num_seqs), max_num_seqs})
        self._edges = {
            "tokens": {"decode": decode_tokens, "mixed": mixed_tokens},
            "requests": {"decode": decode_reqs, "mixed": mixed_reqs},
        }
        self._counts = {
            kind: {r: [0] * (len(e) + 1) for r, e in edges.items()}
            for kind, edges in self._edges.items()
        }
        self._sums = {kind: dict.fromkeys(ROUTINES, 0) for kind in self._edges}
        self._lock = threading.Lock()

    def observe(self, batch: Any, decode_query_len: int) -> None:
        """One engine step (a StepBatch)."""
        uniform = is_uniform_decode(
            batch.num_tokens, batch.num_reqs, batch.max_query_len, decode_query_len
        )
        routine = "decode" if uniform else "mixed"
        with self._lock:
            for kind, value in (("tokens", batch.num_tokens), ("requests", batch.num_reqs)):
                edges = self._edges[kind][routine]
                self._counts[kind][routine][bisect_left(edges, value)] += 1
                self._sums[kind][routine] += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        docs = {
            "tokens": "Tokens per engine step (every request's query tokens), by routine.",
            "requests": "Requests per engine step, by routine.",
        }
        with self._lock:
            counts = {k: {r: list(c) for r, c in v.items()} for k, v in self._counts.items()}
            sums = {k: dict(v) for k, v in self._sums.items()}
        for kind, doc in docs.items():
            family = HistogramMetricFamily(f"graphplan:iteration_{kind}", doc, labels=["routine"])
            for routine in ROUTINES:
                edges, cs = self._edges[kind][routine], counts[kind][routine]
                acc, buckets = 0, []
                for edge, c in zip(edges, cs):
                    acc += c
                    buckets.append((f"{float(edge)}", acc))
                buckets.append(("+Inf", acc + cs[-1]))
                family.add_metric([routine], buckets, sums[kind][routine])
            yield family
