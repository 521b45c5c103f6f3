"""bench/serve_bench.py's arithmetic, pure and tested on hand-made timings: what each request saw
(``Outcome``), its latencies, and the run's summary and markdown table.

- TTFT: first token chunk's arrival - send. E2E: last token chunk's arrival - send.
- TPOT, per request of ``out`` > 1 tokens: (E2E - TTFT) / (out - 1), as vLLM's
  ``vllm/benchmarks/serve.py`` and SGLang's ``python/sglang/bench_serving.py`` compute it.
- ITL: the gaps between a request's token chunks, a chunk of k tokens counting as k gaps of gap / k:
  SGLang's ``bench_serving.py`` convention (``adjust_itl = chunk_gap / num_new_tokens``).
  vLLM's benchmark (``vllm/benchmarks/lib/endpoint_request_func.py``) appends one gap per chunk
  whatever its token count; the two agree when every chunk carries one token, and the k-gap rule
  keeps a server that batches its stream from looking slower per token than it is.
- Percentiles interpolate linearly (``numpy.percentile``), as both benchmarks report them.
- Throughput: tokens over the wall time from the first send to the last token's arrival, across
  every client process; output tokens are those received, prompt tokens those of the requests
  answered (HTTP 200).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BUSY = 0.9  # a client process busier than this is the bottleneck: the run measures the client


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """One request as its client saw it (times in seconds, one monotonic clock)."""

    prompt_len: int
    max_tokens: int
    sent: float
    chunks: tuple[tuple[float, int], ...]
    """(arrival time, tokens) of each streamed chunk that carried tokens"""
    finish: str | None = None
    done: bool = False
    """the stream ended with ``data: [DONE]``"""
    status: int = 200
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(k for _, k in self.chunks)

    @property
    def failed(self) -> bool:
        return self.status != 200 or bool(self.error)

    @property
    def whole(self) -> bool:
        """Answered in full: every token asked for, finish_reason "length", the stream ended."""
        return (
            not self.failed
            and self.done
            and self.finish == "length"
            and self.tokens == self.max_tokens
        )


def ttft(o: Outcome) -> float:
    return o.chunks[0][0] - o.sent


def e2e(o: Outcome) -> float:
    return o.chunks[-1][0] - o.sent


def tpot(o: Outcome) -> float | None:
    return (e2e(o) - ttft(o)) / (o.tokens - 1) if o.tokens > 1 else None


def itl(o: Outcome) -> list[float]:
    out: list[float] = []
    for (t0, _), (t1, k) in zip(o.chunks, o.chunks[1:]):
        out += [(t1 - t0) / k] * k
    return out


def describe(o: Outcome) -> str:
    """What went wrong with a request that was not answered whole."""
    return (
        f"HTTP {o.status}, {o.tokens} of {o.max_tokens} tokens, finish_reason {o.finish}, "
        f"stream ended {o.done}" + (f", error {o.error[:300]!r}" if o.error else "")
    )


def percentile(xs: list[float], p: float) -> float:
    return float(np.percentile(xs, p)) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else float("nan")


def summary(outcomes: list[Outcome], procs: list[dict]) -> dict:
    """The run's figures (latencies in ms); ``procs``: each client process's ``cpu_s``,
    ``wall_s`` and ``requests``."""
    answered = [o for o in outcomes if o.chunks]
    ttfts = [1e3 * ttft(o) for o in answered]
    tpots = [1e3 * t for o in answered if (t := tpot(o)) is not None]
    itls = [1e3 * g for o in answered for g in itl(o)]
    wall = max((e2e(o) + o.sent for o in answered), default=0.0) - min(o.sent for o in outcomes)
    out_tok = sum(o.tokens for o in outcomes)
    in_tok = sum(o.prompt_len for o in outcomes if not o.failed)
    failed = sum(o.failed for o in outcomes)
    whole = sum(o.whole for o in outcomes)
    return {
        "requests": len(outcomes),
        "whole": whole,
        "short": len(outcomes) - whole - failed,
        "failed": failed,
        "prompt_tokens": in_tok,
        "output_tokens": out_tok,
        "wall_s": wall,
        "output_tok_s": out_tok / wall if wall > 0 else float("nan"),
        "total_tok_s": (in_tok + out_tok) / wall if wall > 0 else float("nan"),
        "ttft_ms": {"mean": mean(ttfts), "p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
        "tpot_ms": {"mean": mean(tpots), "p50": percentile(tpots, 50), "p99": percentile(tpots, 99)},
        "itl_ms": {"mean": mean(itls), "p50": percentile(itls, 50), "p99": percentile(itls, 99)},
        "first_problem": next((describe(o) for o in outcomes if not o.whole), ""),
        "procs": [{**p, "busy": p["cpu_s"] / p["wall_s"] if p["wall_s"] > 0 else 0.0} for p in procs],
    }  # fmt: skip


def table(s: dict) -> list[str]:
    """The summary as markdown: throughput and answers, latencies, then the client processes."""
    lat = lambda k: f"{s[k]['mean']:.1f} | {s[k]['p50']:.1f} | {s[k]['p99']:.1f}"
    lines = [
        "| requests | whole | short | failed | prompt tokens | output tokens | wall s "
        "| output tok/s | total tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['requests']} | {s['whole']} | {s['short']} | {s['failed']} | {s['prompt_tokens']} "
        f"| {s['output_tokens']} | {s['wall_s']:.2f} | **{s['output_tok_s']:.0f}** "
        f"| {s['total_tok_s']:.0f} |",
        "",
        "| ms | mean | p50 | p99 |",
        "|---|---:|---:|---:|",
        f"| TTFT | {lat('ttft_ms')} |",
        f"| TPOT | {lat('tpot_ms')} |",
        f"| ITL | {lat('itl_ms')} |",
        "",
        "| client process | requests | CPU s | wall s | busy |",
        "|---:|---:|---:|---:|---:|",
    ]
    for i, p in enumerate(s["procs"]):
        flag = f" **CLIENT-BOUND (> {BUSY:.0%})**" if p["busy"] > BUSY else ""
        lines.append(
            f"| {i} | {p['requests']} | {p['cpu_s']:.2f} | {p['wall_s']:.2f} "
            f"| {p['busy']:.0%}{flag} |"
        )
    return lines


def client_bound(s: dict) -> bool:
    return any(p["busy"] > BUSY for p in s["procs"])
