"""The server's metrics tell the truth (issue 34): a request a stop string ends is served (200, in
the latency histograms), not cancelled (499); queue time ends when a request is first scheduled,
not at its first token; running totals are counters; and the per-token latency histograms,
observed a step at a time, render exactly as prometheus_client's own Histogram."""

from __future__ import annotations

import asyncio
import re
import time

import prometheus_client
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from graphplan.server.core.metrics import TOKEN_BUCKETS, BatchHistogram

from hf_models import write_model_dir
from served import openai_client, start_server

PLAN = (
    "version: 1\nname: m\nscheduler: {max_num_seqs: 4, max_num_batched_tokens: 16}\n"
    "cudagraph: {mode: FULL_DECODE_ONLY, attention_support: ALWAYS, capture_sizes: [1, 2, 4]}\n"
)


@settings(max_examples=50, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.floats(0, 5, allow_nan=False) | st.sampled_from(TOKEN_BUCKETS), max_size=30),
        max_size=6,
    )
)
def test_a_batch_histogram_renders_as_prometheus_clients_histogram(batches):
    prometheus_client.disable_created_metrics()  # as the server does
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    b = BatchHistogram("x_seconds", "doc", TOKEN_BUCKETS)
    ours.register(b)
    h = Histogram("x_seconds", "doc", buckets=TOKEN_BUCKETS, registry=theirs)
    for values in batches:
        b.observe_many(values)
        for v in values:
            h.observe(v)

    def lines(reg):  # the sum as a float within rounding (numpy adds in another order)
        text = generate_latest(reg).decode()
        total = float(re.search(r"^x_seconds_sum (\S+)$", text, re.M).group(1))
        return re.sub(r"^x_seconds_sum .*$", "", text, flags=re.M), total

    (a, sa), (c, sc) = lines(ours), lines(theirs)
    assert a == c and abs(sa - sc) <= 1e-9 * max(1.0, abs(sc))


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_stop_string_is_served_and_queue_time_ends_at_scheduling(tmp_path_factory):
    model_dir = write_model_dir(tmp_path_factory.mktemp("hf") / "tiny-qwen3")
    s = start_server(tmp_path_factory, model_dir, PLAN, max_model_len=64)
    try:
        c = openai_client(s)
        full = c.completions.create(model="tiny-qwen3", prompt="w1 w2", max_tokens=8, temperature=0)
        words = full.choices[0].text.split()
        assert len(words) >= 4
        stop = f" {words[2]}"  # ends the text after two words
        res = c.completions.create(
            model="tiny-qwen3", prompt="w1 w2", max_tokens=8, temperature=0, stop=[stop]
        )
        assert res.choices[0].finish_reason == "stop" and stop not in res.choices[0].text
        # a long prompt in 16-token chunks: its first token comes steps after it was scheduled
        c.completions.create(model="tiny-qwen3", prompt=[5] * 60, max_tokens=1, temperature=0)
        deadline = time.monotonic() + 10
        while True:
            text = asyncio.run(s.engine.scrape())
            if _value(text, 'graphplan_server_requests_total{code="200"}') == 3:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.02)
        assert _value(text, 'graphplan_server_requests_total{code="499"}') == 0
        assert _value(text, "graphplan_server_request_seconds_count") == 3
        assert _value(text, "graphplan_server_time_to_first_token_seconds_count") == 3
        # the stopped request's tokens up to its cancellation count too (the engine made them)
        generated = _value(text, "graphplan_server_generated_tokens_total")
        assert 8 + len(res.choices[0].token_ids) + 1 <= generated <= 8 + 8 + 1
        queue = _value(text, "graphplan_server_queue_seconds_sum")
        ttft = _value(text, "graphplan_server_time_to_first_token_seconds_sum")
        assert 0 < queue < ttft
        assert "# TYPE graphplan_server_async_steps_total counter" in text
    finally:
        s.stop()
