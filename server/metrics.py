"""Server metrics (requests, tokens, queue depth, step and request latency histograms, reloads),
rendered in the Prometheus text format after the runner's own series (runtime.render_prometheus).

Counters are plain ints bumped by the engine thread; /metrics reads them from a handler thread
(a torn read shows one step's lag, never a wrong total)."""

from __future__ import annotations

import threading
from bisect import bisect_left

from graphplan.runtime import render_prometheus

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "graphplan_server"


class Histogram:
    """Prometheus histogram: counts[i] holds observations in (buckets[i-1], buckets[i]]."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def samples(self, name: str) -> list[str]:
        out, acc = [], 0
        for le, n in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            acc += n
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


ENDPOINTS = ("/healthz", "/metrics", "/generate", "/admin/reload")  # others: endpoint="other"


class ServerMetrics:
    def __init__(self):
        self.lock = threading.Lock()  # HTTP threads count responses; runner swaps vs. /metrics
        self.responses: dict[tuple[int, str], int] = {}  # every HTTP response by code, endpoint
        self.retired: dict[str, dict] = {}  # fingerprint -> counters of runners swapped out
        self.requests: dict[int, int] = {}  # finished generate requests by HTTP status
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.steps = {"decode": 0, "mixed": 0}  # mixed: at least one prefill in the step
        self.step_tokens = 0  # real tokens run (padding is in graphplan_graph_padding_*)
        self.step_errors = 0
        self.reloads: dict[str, int] = {}
        self.step_seconds = Histogram(STEP_BUCKETS)
        self.request_seconds = Histogram(REQUEST_BUCKETS)

    def step(self, seconds: float, tokens: int, mixed: bool) -> None:
        self.step_seconds.observe(seconds)
        self.steps["mixed" if mixed else "decode"] += 1
        self.step_tokens += tokens

    def finished(self, status: int, seconds: float, generated: int) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1
        self.generated_tokens += generated
        if status == 200:
            self.request_seconds.observe(seconds)

    def reload(self, result: str) -> None:
        self.reloads[result] = self.reloads.get(result, 0) + 1

    def response(self, code: int, path: str) -> None:
        """One HTTP response (any endpoint, any code: 2xx, 4xx, 5xx); called by every handler
        thread."""
        key = (int(code), path if path in ENDPOINTS else "other")
        with self.lock:
            self.responses[key] = self.responses.get(key, 0) + 1

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
        out = (
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
        graphs, eager = {}, {}
        for fp, r in self.retired.items():
            for gid, g in r["graphs"].items():
                graphs[fp, gid] = {**g, "fingerprint": fp}
            for reason, n in r["eager"].items():
                eager[reason] = eager.get(reason, 0) + n
        for g in (stats or {}).get("graphs", ()):
            acc = graphs.setdefault(
                (stats["fingerprint"], g["id"]),
                {**g, "fingerprint": stats["fingerprint"], "replays": 0, "padding_tokens": 0},
            )
            acc["replays"] += g["replays"]
            acc["padding_tokens"] += g["padding_tokens"]
        for reason, n in (stats or {}).get("eager_steps", {}).items():
            eager[reason] = eager.get(reason, 0) + n
        out["graphs"] = [graphs[k] for k in sorted(graphs)]
        out["eager_steps"] = eager
        return out


def render_metrics(engine) -> str:
    """The runner's series (plan fingerprint, replays per graph, eager steps by reason, padding,
    capture time and memory) followed by the server's."""
    m: ServerMetrics = engine.metrics
    with m.lock:  # the running runner and the retired counters of one moment
        runner = engine.runner
        stats = m.cumulative(runner.stats() if runner is not None else None)
        responses = sorted(m.responses.items())
    text = render_prometheus(stats) if stats is not None and runner is not None else ""
    lines: list[str] = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP {PREFIX}_{name} {help_}")
        lines.append(f"# TYPE {PREFIX}_{name} {kind}")
        lines.extend(f"{PREFIX}_{name}{s}" for s in samples)

    metric(
        "ready",
        "gauge",
        "1 once the graphs are captured and the server serves.",
        [f" {int(engine.state == 'ready')}"],
    )
    metric(
        "http_responses_total",
        "counter",
        "Every HTTP response, by status code and endpoint.",
        [f'{{code="{c}",endpoint="{p}"}} {n}' for (c, p), n in responses],
    )
    metric(
        "requests_total",
        "counter",
        "Finished generate requests by HTTP status.",
        [f'{{code="{c}"}} {n}' for c, n in sorted(m.requests.items())],
    )
    metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [f" {m.prompt_tokens}"])
    metric("generated_tokens_total", "counter", "Tokens generated.", [f" {m.generated_tokens}"])
    metric(
        "steps_total",
        "counter",
        "Engine steps by kind (mixed: with a prefill).",
        [f'{{kind="{k}"}} {n}' for k, n in m.steps.items()],
    )
    metric(
        "step_tokens_total",
        "counter",
        "Real (unpadded) tokens run by engine steps.",
        [f" {m.step_tokens}"],
    )
    metric(
        "step_errors_total",
        "counter",
        "Steps that raised (their requests got 500).",
        [f" {m.step_errors}"],
    )
    metric(
        "queue_depth", "gauge", "Requests waiting for a KV-cache row.", [f" {engine.queue_depth()}"]
    )
    metric(
        "running_requests",
        "gauge",
        "Requests holding a KV-cache row.",
        [f" {engine.num_running()}"],
    )
    metric(
        "reloads_total",
        "counter",
        "Plan reloads by result.",
        [f'{{result="{r}"}} {n}' for r, n in sorted(m.reloads.items())],
    )
    lines.append(f"# HELP {PREFIX}_step_seconds Engine step latency (batch build to argmax).")
    lines.append(f"# TYPE {PREFIX}_step_seconds histogram")
    lines.extend(m.step_seconds.samples(f"{PREFIX}_step_seconds"))
    lines.append(f"# HELP {PREFIX}_request_seconds Latency of successful requests, queue included.")
    lines.append(f"# TYPE {PREFIX}_request_seconds histogram")
    lines.extend(m.request_seconds.samples(f"{PREFIX}_request_seconds"))
    return text + "\n".join(lines) + "\n"
