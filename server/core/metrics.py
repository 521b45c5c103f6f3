"""The server's Prometheus metrics (prometheus_client, one registry per server), served by /metrics
after the runner's own series (runtime.render_prometheus: plan fingerprint, replays per graph, eager
steps by reason, padding, capture time and memory; cumulative per plan across reloads).

Series, all ``graphplan_server_*`` unless named:
    http_responses_total{code,endpoint}   every HTTP response (endpoint: the route, or "other")
    requests_total{code}                   finished generation requests by status
    prompt_tokens_total, generated_tokens_total, preemptions_total, step_errors_total
    steps_total{kind}, step_tokens_total   engine steps (mixed: with a prefill), real tokens run
    reloads_total{result}
    step_seconds, request_seconds (end to end), time_to_first_token_seconds,
    inter_token_latency_seconds, queue_seconds                          histograms
    async_steps_total                      steps launched before the previous one's tokens were read
    ready, queue_depth (waiting), running_requests, kv_blocks_used, kv_blocks_free   gauges
    graphplan:iteration_tokens{routine}, graphplan:iteration_requests{routine}   docs/workload.md
    graphplan_prefix_cache_queries_total, graphplan_prefix_cache_hits_total   prompt tokens looked
        up in the prefix cache at admission, and those found cached (vLLM's prefix_cache_*)
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from graphplan.runtime import render_prometheus

from .iteration_metrics import IterationHistograms

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "graphplan_server_"
ENDPOINTS = (
    "/healthz",
    "/metrics",
    "/generate",
    "/admin/reload",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
)
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


def endpoint_label(path: str) -> str:
    """A bounded label for a request path: a known route, or "other"."""
    if path in ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class ServerMetrics:
    def __init__(self) -> None:
        prometheus_client.disable_created_metrics()  # no *_created series (as vLLM)
        self.registry = r = CollectorRegistry()
        self.lock = threading.Lock()  # runner swaps vs. /metrics
        self.retired: dict[str, dict] = {}  # fingerprint -> counters of runners swapped out
        self.responses = Counter(
            PREFIX + "http_responses",
            "Every HTTP response, by status code and endpoint.",
            ["code", "endpoint"],
            registry=r,
        )
        self.requests = Counter(
            PREFIX + "requests",
            "Finished generation requests by HTTP status.",
            ["code"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens admitted.", registry=r
        )
        self.generated_tokens = Counter(
            PREFIX + "generated_tokens", "Tokens generated.", registry=r
        )
        self.preemptions = Counter(
            PREFIX + "preemptions", "Requests preempted for KV blocks (recomputed).", registry=r
        )
        self.steps = Counter(
            PREFIX + "steps", "Engine steps by kind (mixed: with a prefill).", ["kind"], registry=r
        )
        self.step_tokens = Counter(
            PREFIX + "step_tokens", "Real (unpadded) tokens run by engine steps.", registry=r
        )
        self.step_errors = Counter(
            PREFIX + "step_errors", "Steps that raised (their requests got 500).", registry=r
        )
        self.reloads = Counter(
            PREFIX + "reloads", "Plan reloads by result.", ["result"], registry=r
        )
        self.step_seconds = Histogram(
            PREFIX + "step_seconds",
            "Engine step latency (batch build to sampled tokens).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            PREFIX + "request_seconds",
            "End-to-end latency of successful requests, queue included.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.ttft = BatchHistogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = BatchHistogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            TOKEN_BUCKETS,
        )
        r.register(self.ttft)
        r.register(self.itl)
        self.queue_seconds = Histogram(
            PREFIX + "queue_seconds",
            "Arrival to the first step a request is in.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.iterations: IterationHistograms | None = None
        self.prefix_queries = Counter(
            "graphplan_prefix_cache_queries",
            "Tokens looked up in the prefix cache when a request is admitted.",
            registry=r,
        )
        self.prefix_hits = Counter(
            "graphplan_prefix_cache_hits",
            "Tokens of those found cached (their K/V is not computed again).",
            registry=r,
        )
        self._prefix_seen = (0, 0)

    def prefix_cache(self, batcher: Any) -> None:
        """Count the batcher's prefix-cache lookups since the last call (engine thread)."""
        q, h = batcher.prefix.queries, batcher.prefix.hits
        q0, h0 = self._prefix_seen
        if q > q0:
            self.prefix_queries.inc(q - q0)
        if h > h0:
            self.prefix_hits.inc(h - h0)
        self._prefix_seen = (q, h)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when it has none yet): ``value("graphplan_server_steps_total",
        kind="decode")``."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def attach(self, engine: Any) -> None:
        """Gauges read from the engine at scrape time; the iteration histograms' buckets from its
        start-up table (fixed for the server's life, so scrapes over time subtract)."""
        r = self.registry
        gauges = {
            "ready": ("1 once the graphs are captured and the server serves.", engine.is_ready),
            "queue_depth": ("Requests waiting for a KV-cache row.", engine.queue_depth),
            "running_requests": ("Requests holding a KV-cache row.", engine.num_running),
            "kv_blocks_used": ("KV-cache blocks held by requests.", engine.kv_blocks_used),
            "kv_blocks_free": ("KV-cache blocks free.", engine.kv_blocks_free),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(PREFIX + name, doc, registry=r).set_function(fn)
        r.register(
            CountedBy(
                PREFIX + "async_steps",
                "Steps launched before the previous step's tokens were read (async scheduling).",
                lambda: engine.pipeline.speculated,
            )
        )
        self.iterations = IterationHistograms(engine.table, engine.model.cfg.num_cache_rows)
        r.register(self.iterations)

    def step(self, seconds: float, batch: Any, decode_query_len: int) -> None:
        self.step_seconds.observe(seconds)
        mixed = batch.max_query_len > 1
        self.steps.labels("mixed" if mixed else "decode").inc()
        self.step_tokens.inc(batch.num_tokens)
        if self.iterations is not None:
            self.iterations.observe(batch, decode_query_len)

    def tokens(self, got: list[tuple[Any, float]]) -> None:
        """New tokens: (request, when) each, in order; a request's first is its time to first
        token, each later one an inter-token latency. Observed in bulk (a step's hundreds of
        tokens cost one numpy call per histogram, not a locked Python call each)."""
        first, gaps = [], []
        for r, now in got:
            if r.last_token_at is None:
                first.append(now - r.arrived)
            else:
                gaps.append(now - r.last_token_at)
            r.last_token_at = now
        self.ttft.observe_many(first)
        self.itl.observe_many(gaps)
        self.generated_tokens.inc(len(got))

    def finished(self, r: Any, status: int, now: float) -> None:
        self.requests.labels(str(status)).inc()
        if status == 200:
            self.request_seconds.observe(now - r.arrived)

    def reload(self, result: str) -> None:
        self.reloads.labels(result).inc()

    def response(self, code: int, path: str) -> None:
        """One HTTP response (any endpoint, any code)."""
        self.responses.labels(str(int(code)), endpoint_label(path)).inc()

    def retire(self, stats: dict) -> None:
        """Keep a swapped-out runner's replay, padding and eager counters (call under ``lock``,
        with the swap), so /metrics stays cumulative per plan fingerprint across reloads."""
        r = self.retired.setdefault(stats["fingerprint"], {"graphs": {}, "eager": {}})
        for g in stats["graphs"]:
            acc = r["graphs"].setdefault(g["id"], {**g, "replays": 0, "padding_tokens": 0})
            acc["replays"] += g["replays"]
            acc["padding_tokens"] += g["padding_tokens"]
        for reason, n in stats["eager_steps"].items():
            r["eager"][reason] = r["eager"].get(reason, 0) + n

    def cumulative(self, stats: dict | None) -> dict | None:
        """``stats`` (the running runner's) with every retired runner's counters added: graphs of
        every plan this server ran, labelled by fingerprint; eager steps summed over them."""
        if stats is None and not self.retired:
            return None
        out: dict = (
            dict(stats)
            if stats
            else {
                "plan": "",
                "fingerprint": "",
                "backend": "",
                "capture": {},
                "graphs": [],
                "eager_steps": {},
            }
        )
        graphs: dict = {}
        eager: dict = {}
        for fp, r in self.retired.items():
            for gid, g in r["graphs"].items():
                graphs[fp, gid] = {**g, "fingerprint": fp}
            for reason, n in r["eager"].items():
                eager[reason] = eager.get(reason, 0) + n
        for g in (stats or {}).get("graphs", ()):
            acc = graphs.setdefault(
                (stats["fingerprint"], g["id"]),  # type: ignore[index]
                {**g, "fingerprint": stats["fingerprint"], "replays": 0, "padding_tokens": 0},  # type: ignore[index]
            )
            acc["replays"] += g["replays"]
            acc["padding_tokens"] += g["padding_tokens"]
        for reason, n in (stats or {}).get("eager_steps", {}).items():
            eager[reason] = eager.get(reason, 0) + n
        out["graphs"] = [graphs[k] for k in sorted(graphs)]
        out["eager_steps"] = eager
        return out


class BatchHistogram:
    """A Prometheus histogram observed a batch at a time (numpy bucket counts), for the per-token
    latencies; it renders as prometheus_client's Histogram does."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc = name, doc
        self.edges = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # the last: +Inf
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe_many(self, values: list[float]) -> None:
        if not values:
            return
        v = np.asarray(values, dtype=np.float64)
        idx = np.searchsorted(self.edges, v, side="left")  # value <= le: that bucket
        with self.lock:
            self.counts += np.bincount(idx, minlength=len(self.counts))
            self.sum += float(v.sum())

    def value(self) -> tuple[list[tuple[str, float]], float]:
        with self.lock:
            cum, total = np.cumsum(self.counts), self.sum
        les = [*(floatToGoString(e) for e in self.edges), "+Inf"]
        return [(le, float(c)) for le, c in zip(les, cum)], total

    def collect(self):
        buckets, total = self.value()
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc)]


class CountedBy:
    """A counter (``NAME_total``) whose value a function reads at scrape time: a running total the
    engine keeps itself."""

    def __init__(self, name: str, doc: str, read: Any):
        self.name, self.doc, self.read = name, doc, read

    def collect(self):
        yield CounterMetricFamily(self.name, self.doc, value=self.read())

    def describe(self):
        return [CounterMetricFamily(self.name, self.doc)]


def render_metrics(engine: Any) -> str:
    """The runner's series followed by the server's (Prometheus text format 0.0.4)."""
    m: ServerMetrics = engine.metrics
    with m.lock:  # the running runner and the retired counters of one moment
        runner = engine.runner
        stats = m.cumulative(runner.stats() if runner is not None else None)
    text = render_prometheus(stats) if stats is not None and runner is not None else ""
    dp = getattr(getattr(engine, "pipeline", None), "dp", None)  # data parallelism's counters
    return text + (dp.metrics() if dp is not None else "") + generate_latest(m.registry).decode()
