"""serve_bench's reading of the server's /metrics: the prefix cache's hit rate and the step mix
(engine steps, those with a prefill, tokens a step), summed over every engine's samples."""

from __future__ import annotations

import httpx

SCRAPED = {  # key: (sample name, labels the sample must carry); every engine's samples summed
    "hits": ("graphplan_prefix_cache_hits_total", {}),
    "queries": ("graphplan_prefix_cache_queries_total", {}),
    "prompt_tokens": ("graphplan_server_prompt_tokens_total", {}),
    "step_tokens": ("graphplan_server_step_tokens_total", {}),
    "steps_decode": ("graphplan_server_steps_total", {"kind": "decode"}),
    "steps_mixed": ("graphplan_server_steps_total", {"kind": "mixed"}),
}


def scrape_text(text: str) -> dict:
    """The prefix-cache counters and step mix of a /metrics page (0 where absent), summed over
    the samples of every engine (a data-parallel server labels each engine's ``engine="d"``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(SCRAPED, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for k, (name, labels) in SCRAPED.items():
                if sample.name == name and labels.items() <= sample.labels.items():
                    out[k] += sample.value
    return out


def scrape(url: str) -> dict:
    """``scrape_text`` of the server's /metrics."""
    return scrape_text(httpx.get(f"{url}/metrics", timeout=30).text)


def mix(m: dict) -> str:
    """The cache's hit rate and the step mix, in one line."""
    steps = m["steps_decode"] + m["steps_mixed"]
    rate = m["hits"] / m["queries"] if m["queries"] else 0.0
    per = m["step_tokens"] / steps if steps else 0.0
    return (
        f"prefix cache hit rate {rate:.1%} ({m['hits']:.0f} of {m['queries']:.0f} tokens); "
        f"steps {steps:.0f} ({m['steps_mixed']:.0f} with a prefill), {m['step_tokens']:.0f} "
        f"tokens computed, {per:.1f} per step"
    )
