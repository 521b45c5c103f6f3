"""bench/serve_bench.py: at smoke size on the CPU it starts graphplan-serve as a subprocess, streams
the workload from two client processes and reports every figure; its arithmetic (TTFT, TPOT, ITL
with multi-token chunks, percentiles, counts, client CPU) is checked on hand-made timings; its
workloads are the ones its docstrings and anchors describe."""

import argparse
import math
import re

import pytest

from offline_throughput import ANCHORS
from serve_bench import main
from serve_stats import Outcome, client_bound, itl, percentile, summary, table, tpot, ttft
from serve_workload import chat_max_len, requests, send_offsets

SMOKE = ["--device", "cpu", "--shape", "tiny", "--requests", "16", "--max-len", "32"]


def drawn(workload: str, n: int, max_len: int, vocab: int):
    a = argparse.Namespace(workload=workload, seed=0, requests=n, min_len=4, max_len=max_len)
    return requests(a, vocab)


def first_row(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header))
    return lines[i + 2].strip("| ").split(" | ")


def test_the_smoke_run_serves_every_request_whole_and_reports_each_figure(tmp_path):
    out = tmp_path / "serve_bench.md"
    # 4 seats, so that the offline run has decode steps at full batch for the ITL bar's line
    assert main([*SMOKE, "--set", "scheduler.max_num_seqs=4", "--offline", "--out", str(out)]) == 0
    text = out.read_text()
    prompts, outputs = drawn("loguniform", 16, 32, 512)
    row = first_row(text, "| requests | whole |")
    want = ["16", "16", "0", "0", str(sum(map(len, prompts))), str(sum(outputs))]
    assert row[:6] == want  # every request whole; prompt and output tokens as drawn
    assert float(row[6]) > 0 and re.fullmatch(r"\*\*\d+\*\*", row[7]) and int(row[8]) > 0
    for name in ("TTFT", "TPOT", "ITL"):  # mean, p50, p99 ms
        cells = re.search(rf"^\| {name} \| (.+) \|$", text, re.M).group(1).split(" | ")
        mean, p50, p99 = map(float, cells)
        # a front end behind the tiny model's steps joins a stream's events into one write: its
        # tokens arrive together, gaps of 0.0 ms (serve_stats' arithmetic has its own test)
        assert 0 <= p50 <= p99 and mean >= 0 and (name != "TTFT" or p50 > 0)
    procs = re.findall(r"^\| (\d) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| (\d+)%", text, re.M)
    assert [p[:2] for p in procs] == [("0", "8"), ("1", "8")]  # two client processes, 8 each
    assert "graphplan-serve --plan " in text and " --random-weights " in text
    assert "2 client processes (httpx)" in text and "at request rate inf" in text
    assert re.search(r"\*\*served / offline \d+\.\d{3}\*\*", text)
    itl_p99 = float(re.search(r"^\| ITL \| (.+) \|$", text, re.M).group(1).split(" | ")[2])
    bar = re.search(r"- served ITL p99 ([\d.]+) ms against the offline engine's decode step at full "
                    r"batch, ([\d.]+) ms: \*\*([\d.]+)x\*\* \((met|MISSED): <= 2.0x\)", text)  # fmt: skip
    assert bar and float(bar[1]) == round(itl_p99, 1) and float(bar[2]) > 0
    assert bar[4] == ("met" if float(bar[3]) <= 2.0 else "MISSED")
    own = re.search(r"- the offline engine's own ITL p99 \(same plan, mixed steps included\) "
                    r"([\d.]+) ms: served / engine \*\*([\d.]+)x\*\*", text)  # fmt: skip
    assert own and float(own[1]) > 0
    assert abs(float(own[2]) - itl_p99 / float(own[1])) <= 0.01 * itl_p99 / float(own[1]) + 0.005
    assert all(f"- anchor: {x}" in text for x in ANCHORS)
    assert "not answered whole" not in text
    assert text.rstrip().endswith("**PASS**: every request finished whole")


def test_a_poisson_run_with_the_openai_client_appends_a_second_record(tmp_path):
    out = tmp_path / "serve_bench.md"
    out.write_text("# earlier\n")
    argv = ["--client", "openai", "--request-rate", "50", "--workload", "sharegpt"]
    assert main([*SMOKE[:-4], "--requests", "6", "--max-len", "16", *argv, "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# earlier\n\n## serve_bench (tiny, sharegpt), cpu, ")
    assert first_row(text, "| requests | whole |")[:4] == ["6", "6", "0", "0"]
    assert "2 client processes (openai)" in text and "at request rate 50/s" in text


def test_offline_needs_the_offline_workload(capsys):
    with pytest.raises(SystemExit) as e:
        main([*SMOKE, "--workload", "sharegpt", "--offline"])
    assert e.value.code == 2 and "--offline runs bench/offline_throughput.py's" in (
        capsys.readouterr().err
    )


def test_latencies_count_a_chunk_of_k_tokens_as_k_gaps():
    o = Outcome(prompt_len=7, max_tokens=5, sent=10.0, finish="length", done=True,
                chunks=((10.5, 1), (10.75, 1), (11.5, 3)))  # fmt: skip
    assert ttft(o) == 0.5 and o.tokens == 5 and o.whole
    assert tpot(o) == pytest.approx((1.5 - 0.5) / 4)
    assert itl(o) == pytest.approx([0.25, 0.25, 0.25, 0.25])  # 0.75 s over a 3-token chunk
    two = Outcome(prompt_len=1, max_tokens=2, sent=0.0, chunks=((1.0, 2),), done=True)
    assert itl(two) == [] and tpot(two) == 0.0  # one chunk: no gap; (e2e - ttft) / 1
    assert tpot(Outcome(prompt_len=1, max_tokens=1, sent=0.0, chunks=((1.0, 1),))) is None


def test_percentiles_interpolate_as_numpy_does():
    assert percentile([5.0, 1.0, 4.0, 2.0, 3.0], 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([1.0, 2.0], 25) == 1.25 and math.isnan(percentile([], 50))


def test_the_summary_counts_whole_short_and_failed_and_flags_a_busy_client():
    whole = Outcome(prompt_len=7, max_tokens=3, sent=1.0, finish="length", done=True,
                    chunks=((1.5, 1), (1.75, 1), (2.0, 1)))  # fmt: skip
    short = Outcome(prompt_len=4, max_tokens=3, sent=1.5, finish="length", done=True,
                    chunks=((2.0, 1), (3.0, 1)))  # fmt: skip
    failed = Outcome(prompt_len=9, max_tokens=3, sent=0.5, chunks=(), status=429, error="full")
    procs = [
        {"cpu_s": 0.5, "wall_s": 1.0, "requests": 2},
        {"cpu_s": 1.9, "wall_s": 2.0, "requests": 1},
    ]
    s = summary([whole, short, failed], procs)
    assert (s["requests"], s["whole"], s["short"], s["failed"]) == (3, 1, 1, 1)
    assert (s["prompt_tokens"], s["output_tokens"]) == (11, 5)  # the failed prompt not counted
    assert s["wall_s"] == 2.5  # first send 0.5 (the failed one) to the last token 3.0
    assert s["output_tok_s"] == 2.0 and s["total_tok_s"] == 16 / 2.5
    assert s["ttft_ms"] == {"mean": 500.0, "p50": 500.0, "p99": 500.0}
    assert s["tpot_ms"]["p50"] == pytest.approx(625.0)  # 250 and 1000 ms
    assert s["itl_ms"]["p50"] == pytest.approx(250.0) and s["itl_ms"]["mean"] == 500.0
    assert [p["busy"] for p in s["procs"]] == [0.5, 0.95] and client_bound(s)
    assert s["first_problem"] == "HTTP 200, 2 of 3 tokens, finish_reason length, stream ended True"
    rows = table(s)
    assert rows[2].startswith("| 3 | 1 | 1 | 1 | 11 | 5 | 2.50 | **2** | 6 |")
    assert rows[-1] == "| 1 | 1 | 1.90 | 2.00 | 95% **CLIENT-BOUND (> 90%)** |"
    assert rows[-2] == "| 0 | 2 | 0.50 | 1.00 | 50% |"


def test_the_loguniform_workload_is_offline_throughputs_and_its_longest_output_is_the_anchors():
    prompts, outputs = drawn("loguniform", 1000, 1024, 128256)
    assert (max(outputs), sum(outputs), sum(map(len, prompts))) == (1016, 197267, 180740)
    assert "1,016 tokens" in ANCHORS[2] and "197,267" in ANCHORS[2]


def test_the_sharegpt_workload_has_the_token_totals_its_docstring_gives():
    prompts, outputs = drawn("sharegpt", 1000, 1024, 128256)
    assert (sum(map(len, prompts)), sum(outputs)) == (215692, 195472)
    assert min(map(len, prompts)) >= 4 and max(outputs) <= 1024


def test_requests_go_all_at_once_at_rate_inf_else_as_a_poisson_process():
    assert send_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    t = send_offsets(2000, 50.0, 0)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)


def test_the_chat_workload_shares_its_system_prompt_and_each_turn_resends_the_earlier():
    a = argparse.Namespace(
        workload="chat",
        seed=0,
        requests=300,
        min_len=4,
        max_len=256,
        system_len=2000,
        turns=3,
        turn_len=60,
    )
    prompts, outputs = requests(a, 128256)
    assert len(prompts) == len(outputs) == 300 and 4 <= min(outputs) <= max(outputs) <= 256
    assert max(map(len, prompts)) + 256 <= chat_max_len(a) == 2000 + 3 * 4 * 160 + 256
    system = prompts[0][:2000]
    assert all(p[:2000] == system and len(p) > 2000 for p in prompts)
    # a later turn starts with an earlier request's whole prompt (its conversation so far)
    later = [p for p in prompts if any(len(q) < len(p) and p[: len(q)] == q for q in prompts)]
    assert len(later) > 50 and prompts[: len(prompts) - len(later)] != []


def test_prefix_caching_compare_runs_the_chat_workload_on_and_off(tmp_path):
    """The smoke size of the GPU step: both runs whole, the ratios, and the hit rate (> 0 with the
    cache on, none off)."""
    out = tmp_path / "prefix.md"
    argv = [*SMOKE[:-4], "--requests", "12", "--max-len", "8", "--workload", "chat"]
    argv += ["--system-len", "64", "--turn-len", "3", "--prefix-caching", "compare"]
    assert main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    assert "## serve_bench (prefix caching on, tiny, chat), cpu" in text
    assert "## serve_bench (prefix caching off, tiny, chat), cpu" in text
    assert "--no-enable-prefix-caching" in text and text.count("**PASS**") == 2
    assert re.search(r"TTFT p50 off / on \*\*\d+\.\d\dx\*\*", text)
    on = re.search(r"- on: prefix cache hit rate ([\d.]+)% \((\d+) of (\d+) tokens\)", text)
    off = re.search(r"- off: prefix cache hit rate 0\.0% \(0 of 0 tokens\)", text)
    assert on and float(on[1]) > 30 and off


def test_step_intervals_split_the_engines_step_gaps_by_kind_and_name_the_longest():
    from offline_throughput import step_intervals

    # (delivered at s, requests, longest query, tokens)
    steps = [
        (0.0, 4, 1, 4),
        (0.010, 4, 1, 4),
        (0.040, 3, 5, 20),
        (0.050, 4, 1, 4),
        (0.062, 2, 1, 2),
    ]
    got = step_intervals(steps)
    assert got["decode"][0] == 3 and got["mixed"] == (
        1,
        0.040 - 0.010,
        0.040 - 0.010,
        0.040 - 0.010,
    )
    assert got["decode"][1:] == pytest.approx((0.010, 0.012, 0.012))  # p50, p99, max
    assert [(round(t, 3), n, tok, k) for t, n, tok, k in got["longest"]] == [
        (0.03, 3, 20, "mixed"), (0.012, 2, 2, "decode"), (0.01, 4, 4, "decode"),
        (0.01, 4, 4, "decode"),
    ]  # fmt: skip


def test_the_step_mix_sums_every_engines_samples_of_a_data_parallel_server():
    """serve_bench's /metrics reading: one engine's page, and two engines' merged as a DP server
    serves them (each sample labelled engine="d"), give the counters' sums."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from serve_metrics import scrape_text

    from graphplan.server.wire.engines import merge_metrics

    def page(decode, mixed, tokens, hits, queries):
        reg = CollectorRegistry()
        steps = Counter("graphplan_server_steps", "Steps.", ["kind"], registry=reg)
        steps.labels(kind="decode").inc(decode)
        steps.labels(kind="mixed").inc(mixed)
        Counter("graphplan_server_step_tokens", "Tokens.", registry=reg).inc(tokens)
        Counter("graphplan_prefix_cache_hits", "Hits.", registry=reg).inc(hits)
        Counter("graphplan_prefix_cache_queries", "Queries.", registry=reg).inc(queries)
        return generate_latest(reg).decode()

    one, two = page(3, 2, 100, 16, 40), page(5, 1, 50, 0, 8)
    expect = dict(hits=16.0, queries=40.0, prompt_tokens=0.0, step_tokens=100.0)
    assert scrape_text(one) == {**expect, "steps_decode": 3.0, "steps_mixed": 2.0}
    merged = merge_metrics([one, two])
    assert 'graphplan_server_steps_total{engine="1",kind="decode"} 5.0' in merged
    assert scrape_text(merged) == dict(
        hits=16.0, queries=48.0, prompt_tokens=0.0, step_tokens=150.0, steps_decode=8.0,
        steps_mixed=3.0,
    )  # fmt: skip
