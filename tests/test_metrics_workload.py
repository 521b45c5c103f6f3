"""plan workload --from-metrics: workloads from engines' Prometheus scrapes (exact steps for each
engine's real format, every hostile scrape refused with its line), budgets of graphs, capture
time and memory (exact sizes, against brute force), and the tuned plan back to its engine.

The fixtures in tests/data/metrics are in the exact text format each engine serves (prometheus
client's exposition: HELP/TYPE lines, sorted labels, float values, buckets then _count, _sum and,
where the engine leaves them on, _created), with the names, labels and bucket edges of:

- vllm-v0-fixed-buckets.prom: vLLM's V0 engine, vllm/engine/metrics.py (0.6.x; later V0 releases
  with --enforce-eager): ``vllm:iteration_tokens_total`` buckets [1, 8, 16, ..., 4096, 8096],
  label ``model_name``, ``prometheus_client.disable_created_metrics()`` (no _created);
- vllm-v0-capture-buckets.prom: the same file in 0.7.x, whose buckets are the sorted
  ``cudagraph_capture_sizes`` (the default [1, 2, 4] + range(8, 257, 8) for max_num_seqs 256);
- vllm-v1-t0.prom, vllm-v1-t1.prom: the V1 engine, vllm/v1/metrics/loggers.py (0.8 on): labels
  ``engine`` and ``model_name`` (two data-parallel engines here), buckets [1, 8, ..., 8192,
  16384], counters renamed ``vllm:prompt_tokens`` (served as ``_total``, with ``_created``);
- sglang-t0/t1/t2.prom: SGLang, python/sglang/srt/metrics/collector.py: the gauge
  ``sglang:num_running_reqs`` with labels engine_type, model_name, pp_rank, tp_rank (two TP ranks
  report the same batch), counters of the tokenizer manager (model_name only);
- graphplan.prom: graphplan's own series as docs/workload.md defines them.
"""

import http.server
import itertools
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphplan.compiler import compile_plan
from graphplan.compiler.cli import main
from graphplan.compiler.errors import GraphplanError
from graphplan.compiler.tools import prom_text
from graphplan.compiler.tools.memory import FORMAT, MIB
from graphplan.compiler.tools.metrics import Options, workload_from_scrapes
from graphplan.compiler.tools.optimize import OptimizeError, optimize
from graphplan.compiler.tools.trace import Trace, TraceError, aggregate, load_trace, padding
from graphplan.compiler.tools.trace_file import MAX_STEPS

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "metrics"
H100 = ROOT / "plans" / "llama3-8b-h100.yaml"
V0 = DATA / "vllm-v0-fixed-buckets.prom"
V0_SIZES = DATA / "vllm-v0-capture-buckets.prom"
V1 = [DATA / "vllm-v1-t0.prom", DATA / "vllm-v1-t1.prom"]
SGLANG = [DATA / f"sglang-t{i}.prom" for i in range(3)]
M = "meta-llama/Llama-3.1-8B-Instruct"


def work_of(*paths, text=None, **kw):
    scrapes = [prom_text.read(str(p)) for p in paths]
    if text is not None:
        scrapes.append(prom_text.parse(text.encode(), "s.prom"))
    return workload_from_scrapes(scrapes, Options(**kw))


def decode(n, c):
    return (n, n, 1, c)


def mixed(n, c):
    return (n, 1, n, c)


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# -- each engine's real format -------------------------------------------------------------------
def test_vllm_v0_buckets_spread_evenly_over_their_token_counts():
    w = work_of(V0)
    assert w.rows == (
        decode(1, 4),  # le=1: 4 steps
        *(decode(n, 2) for n in range(2, 9)),  # (1, 8]: 14 steps over 7 counts
        *(decode(n, 1) for n in range(9, 17)),  # (8, 16]: 8 over 8
        *(decode(n, 1) for n in range(33, 65)),  # (32, 64]: 32 over 32
        decode(256, 1),  # (128, 256]: 1 step: at the top of its bucket
        mixed(384, 1),  # (256, 512]: 2 steps: one per half, above max_num_seqs: mixed
        mixed(512, 1),
        mixed(1024, 1),
        mixed(2048, 1),
    )
    assert w.steps == 63 and w.header["left_out"]["above_steps"] == 1
    assert "1 step above 8096 tokens" in w.notes[0]
    assert (w.header["engine"], w.header["metric"]) == ("vllm", "vllm:iteration_tokens_total")
    assert w.header["window"] == "since the engine started"


def test_a_bucket_spread_is_exact_and_even_and_upper_puts_it_at_the_edge():
    edges = "\n".join(
        f'vllm:iteration_tokens_total_bucket{{le="{e}"}} {c}'
        for e, c in (("100.0", 0), ("200.0", 37), ("+Inf", 37))
    )
    rows = work_of(text=edges).rows
    counts = [c for *_, c in rows]
    assert sum(counts) == 37 and set(counts) == {1}  # 37 steps over 100 counts: one each at most
    assert [n for n, *_ in rows][:3] == [103, 106, 109] and rows[-1][0] == 200
    assert work_of(text=edges, spread="upper").rows == (decode(200, 37),)
    many = edges.replace("} 37", "} 250")
    counts = [c for *_, c in work_of(text=many).rows]
    assert sum(counts) == 250 and sorted(set(counts)) == [2, 3] and len(counts) == 100


def test_vllm_v0_upper_spread_puts_each_bucket_at_its_edge():
    assert work_of(V0, spread="upper").rows == (
        decode(1, 4),
        decode(8, 14),
        decode(16, 8),
        decode(64, 32),
        decode(256, 1),
        mixed(512, 2),
        mixed(1024, 1),
        mixed(2048, 1),
    )


def test_vllm_capture_size_buckets_price_the_engines_own_list_at_zero_padding_upper():
    w = work_of(V0_SIZES, spread="upper")
    assert w.rows == (decode(1, 10), decode(4, 6), decode(16, 8), decode(256, 6))
    plan = {
        "version": 1,
        "name": "vllm-0.7",
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 2048},
        "cudagraph": {"mode": "FULL_AND_PIECEWISE", "attention_support": "ALWAYS"},
    }
    sizes = [1, 2, 4, *range(8, 257, 8)]
    table = compile_plan({**plan, "cudagraph": {**plan["cudagraph"], "capture_sizes": sizes}})
    n, r, m, c = (np.array(x) for x in zip(*w.rows))
    trace = Trace(source="w", num_tokens=n, num_reqs=r, max_query_len=m, line=n, count=c)
    assert padding(table, aggregate(trace, 1)).padded_tokens == 0


def test_steps_above_the_largest_edge_are_spread_up_to_max_tokens():
    w = work_of(V0_SIZES, max_tokens=2048)
    above = [row for row in w.rows if row[0] > 256]
    assert above == [mixed(n, 1) for n in (436, 615, 794, 973, 1152, 1332, 1511, 1690, 1869, 2048)]
    assert w.steps == 40 and not w.notes


def test_vllm_v1_two_scrapes_give_the_last_minus_the_first_per_engine():
    w = work_of(*V1, labels=(("engine", "0"),))
    assert w.rows == (
        decode(1, 2),
        *(decode(n, 1) for n in range(2, 17)),
        *(decode(n, 1) for n in range(65, 129)),
        mixed(1024, 1),
    )
    assert w.header["window"] == "last scrape minus first"
    assert w.header["series"] == [{"engine": "0", "model_name": M}]


def test_vllm_v1_data_parallel_engines_of_one_model_add_up_with_a_note():
    w = work_of(*V1)
    assert w.steps == 82 + 136 and w.header["merged"] == 2
    assert w.rows[:3] == (decode(1, 3), decode(2, 2), decode(3, 2))
    assert decode(200, 1) in w.rows and decode(9, 1) in w.rows
    assert w.notes[0].startswith(
        "2 vllm:iteration_tokens_total series of one model added up (they differ in engine: "
        "the data-parallel engines of one deployment run one plan)"
    )
    assert work_of(*V1, merge=True).rows == w.rows
    with pytest.raises(GraphplanError, match=r"--label gpu=...: no vllm:iteration_tokens_total "):
        work_of(*V1, labels=(("gpu", "0"),))


def test_a_counter_reset_between_scrapes_is_refused_naming_both_lines():
    with pytest.raises(GraphplanError) as e:
        work_of(V1[1], V1[0], merge=True)
    assert str(e.value).startswith(
        f'{V1[0]}:21: vllm:iteration_tokens_total_bucket{{le="1"}} went down from 102 '
        f"({V1[1]}:21) to 100: a counter reset"
    )


def test_sglang_decode_batches_are_sampled_from_its_running_gauge():
    w = work_of(*SGLANG, labels=(("tp_rank", "0"),))
    assert w.rows == (decode(12, 1), decode(30, 1))  # the idle scrape adds nothing
    assert w.header["engine"] == "sglang" and w.header["spread"] is None
    assert "sglang:num_running_reqs" in w.notes[0]
    q2 = work_of(*SGLANG, labels=(("tp_rank", "0"),), decode_query_len=2)
    assert q2.rows == ((24, 12, 2, 1), (60, 30, 2, 1))
    ranks = work_of(*SGLANG)  # TP ranks report the same batches: rank 0 is read
    assert ranks.rows == w.rows and ranks.header["series"] == w.header["series"]
    assert any(
        n.startswith("1 sglang:num_running_reqs series left out as replicas of another")
        for n in ranks.notes
    )
    with pytest.raises(GraphplanError, match="is 0 in every scrape: the engine was idle"):
        work_of(SGLANG[2], labels=(("tp_rank", "0"),))


def test_graphplan_series_say_which_steps_are_decode():
    w = work_of(DATA / "graphplan.prom")
    assert w.rows == (
        decode(1, 3),
        decode(2, 2),
        decode(3, 4),
        decode(5, 3),
        decode(8, 8),
        *(mixed(n, 1) for n in range(17, 65)),  # mixed steps of <= 256 tokens stay mixed
        mixed(1024, 1),
    )
    assert w.header["merged"] == 1 and w.header["left_out"]["above_steps"] == 2


def test_vllm_without_the_histogram_falls_back_to_the_running_gauge():
    text = "\n".join(line for line in V0.read_text().splitlines() if "iteration" not in line)
    w = work_of(text=text)
    assert w.rows == (decode(12, 1),) and w.header["metric"] == "vllm:num_requests_running"
    assert "no vllm:iteration_tokens_total histogram" in w.notes[0]


# -- the workload file -----------------------------------------------------------------------------
def test_the_workload_file_reads_back_with_its_header_and_counts(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    code, text, _ = cli(capsys, "workload", "--from-metrics", *V1, "--label", "engine=0", "-o", out)
    assert code == 0 and "82 steps: 81 uniform decode, 1 mixed" in text
    trace = load_trace(out)
    assert trace.header["engine"] == "vllm" and trace.steps == 82
    assert trace.line[0] == 2 and trace.count[0] == 2  # the header is line 1
    work = aggregate(trace, 1)
    assert work.steps == 82 and work.header["engine"] == "vllm"
    one_per_line = tmp_path / "steps.jsonl"  # the same steps, one line each, no header
    one_per_line.write_text(
        "".join(
            json.dumps({"num_tokens": int(n), "num_reqs": int(r), "max_query_len": int(m)}) + "\n"
            for n, r, m, c in zip(
                trace.num_tokens, trace.num_reqs, trace.max_query_len, trace.count
            )
            for _ in range(c)
        )
    )
    table = compile_plan(H100)
    a = optimize(table, work, 40)
    b = optimize(table, aggregate(load_trace(one_per_line), 1), 40)
    assert (a.sizes, a.padded_tokens, a.before.padded_tokens) == (
        b.sizes,
        b.padded_tokens,
        b.before.padded_tokens,
    )


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"graphplan_workload": {"version": 2}}\n', r"w.jsonl:1: workload header version 2"),
        ('{"graphplan_workload": {"version": 1, "engine": "tgi"}}\n', "engine 'tgi' is not"),
        ('{"graphplan_workload": [1]}\n', "must be an object"),
        (
            '{"num_tokens": 4, "num_reqs": 4, "max_query_len": 1, "count": 0}\n',
            r"w.jsonl:1: count 0 must be in 1\.\.",
        ),
        (
            '{"num_tokens": 4, "num_reqs": 4, "max_query_len": 1}\n{"graphplan_workload": {}}\n',
            "w.jsonl:2: a workload header belongs on the first line only",
        ),
        (
            f'{{"num_tokens": 4, "num_reqs": 4, "max_query_len": 1, "count": {MAX_STEPS}}}\n' * 2,
            f"{2 * MAX_STEPS + 1} steps in all; a workload holds at most {MAX_STEPS}",
        ),
    ],
)
def test_a_bad_workload_file_is_an_error_naming_its_line(tmp_path, text, match):
    path = tmp_path / "w.jsonl"
    path.write_text(text + '{"num_tokens": 4, "num_reqs": 4, "max_query_len": 1}\n')
    with pytest.raises(TraceError, match=match):
        load_trace(path)


# -- hostile and broken scrapes ------------------------------------------------------------------
LINES = V0.read_text().splitlines()  # lines 24..36: the buckets le=1 .. le=+Inf, 37: _count


def edited(**lines) -> str:
    """The v0 scrape with some lines (``l24=...``) replaced; None drops a line."""
    out = []
    for i, line in enumerate(LINES, 1):
        new = lines.get(f"l{i}", line)
        if new is not None:
            out.append(new)
    return "\n".join(out) + "\n"


def bucket(le, value, extra=""):
    return f'vllm:iteration_tokens_total_bucket{{le="{le}",model_name="{M}"{extra}}} {value}'


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "\n".join(LINES[:25]) + "\n" + LINES[25][:70],
            r"s\.prom:26: bad label at column 46 of vllm:iteration_tokens_total_bucket",
        ),
        ("\n".join(LINES[:30]) + "\n", r's\.prom:30: .* has no le="\+Inf" bucket'),
        (
            "\n".join(LINES[:30]) + "\n" + LINES[30][:-3],
            r"s\.prom:31: bucket le=512 holds 6, fewer than le=256 \(line 30: 59\)",
        ),
        (edited(l27=LINES[25]), r"s\.prom:27: .*le=\"16\.0\".* repeats line 26"),
        (edited(l27=bucket("16", 26.0)), r"s\.prom:27: bucket le=16 repeats line 26"),
        (edited(l25=bucket("8.0", -3.0)), r"s\.prom:25: .* is -3\.0; a count is a whole number"),
        (edited(l25=bucket("8.0", "NaN")), r"s\.prom:25: .* is nan; a count is a whole"),
        (edited(l25=bucket("8.0", "+Inf")), r"s\.prom:25: .* is inf; a count is a whole"),
        (edited(l25=bucket("8.0", 17.5)), r"s\.prom:25: .* is 17\.5; a count is a whole"),
        (edited(l25=bucket("2.5", 17.0)), r's\.prom:25: bucket le="2\.5" is not a whole token'),
        (edited(l25=bucket("eight", 17.0)), r's\.prom:25: bucket le="eight" is not a whole'),
        (edited(l28=bucket("64.0", 20.0)), r"s\.prom:28: bucket le=64 holds 20, fewer than le=32"),
        (edited(l37=LINES[36].replace("64.0", "65.0")), r"s\.prom:37: .*_count is 65 but .*"),
        (edited(l25=bucket("8.0", "1_8")), r"s\.prom:25: .*'1_8' is not a number"),
        (edited(l25=LINES[24] + " 12 13"), r"s\.prom:25: expected a value after"),
        (edited(l25=LINES[24].replace('le="8.0",', 'le="8.0",le="9",')), "label 'le' given twice"),
        (edited(l25=LINES[24].replace('{le="8.0",', '{le="8.0" ')), r"expected ',' or '}'"),
        (edited(l25="1vllm 3"), r"s\.prom:25: expected a metric name"),
        (edited(l23="# TYPE vllm:iteration_tokens_total counter"), r":23: .* typed counter"),
        (edited(l23=None, l24="# TYPE vllm:gpu_cache_usage_perc gauge"), r"typed twice"),
        (edited(l23="# TYPE vllm:iteration_tokens_total exotic"), r"s\.prom:23: bad TYPE line"),
        ("# HELP nothing here\nprocess_cpu_seconds_total 12.0\n", "no vLLM, SGLang or graphplan"),
        (
            "vllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n",
            "no vllm:iteration_tokens_total or vllm:num_requests_running series",
        ),
        ("vllm:num_requests_running 3\nsglang:num_running_reqs 4\n", "say which with --engine"),
        ("vllm:num_requests_running 3000000\n", "is 3000000: more than any plan runs"),
    ],
)
def test_a_broken_or_hostile_scrape_is_refused_naming_the_line(text, match):
    with pytest.raises(prom_text.ScrapeError, match=match):
        work_of(text=text)


def test_label_values_with_quotes_braces_and_escapes_parse():
    text = "\n".join(
        line.replace(M, 'a \\"quoted\\" }{ model\\\\x\\n')
        for line in LINES
        if "iteration" in line or line.startswith("#")
    )
    w = work_of(text=text)
    assert w.steps == 63 and w.header["series"] == [{"model_name": 'a "quoted" }{ model\\x\n'}]


def test_huge_edges_and_counts_stay_bounded():
    text = "\n".join(
        [
            bucket("1.0", 1e18),
            bucket("1000000000000000.0", 2e18),  # a bucket far above any plan: left out
            bucket("+Inf", 2e18),
        ]
    )
    t0 = time.perf_counter()
    w = work_of(text=text)
    assert w.rows == (decode(1, MAX_STEPS // 2),) and time.perf_counter() - t0 < 5
    assert "scaled down" in w.notes[0] and w.header["left_out"]["above_steps"] == MAX_STEPS // 2


def test_huge_scrapes_lines_and_series_counts_are_refused(tmp_path, monkeypatch):
    big = tmp_path / "big.prom"
    big.write_bytes(b"# padding\n" * (prom_text.MAX_SCRAPE_BYTES // 10 + 1))
    with pytest.raises(prom_text.ScrapeError, match="a scrape is at most 16777216 bytes"):
        prom_text.read(str(big))
    with pytest.raises(prom_text.ScrapeError, match=r"s\.prom:2: line of 70000 bytes"):
        prom_text.parse(b"x 1\n" + b"#" * 70000 + b"\n", "s.prom")
    monkeypatch.setattr(prom_text, "MAX_SAMPLES", 100)
    many = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1\n' for i in range(101))
    with pytest.raises(prom_text.ScrapeError, match=r"s\.prom:101: more than 100 samples"):
        prom_text.parse(many.encode(), "s.prom")
    with pytest.raises(prom_text.ScrapeError, match=r"s\.prom:2: not UTF-8"):
        prom_text.parse(b"x 1\n\xff\xfe 2\n", "s.prom")


def test_the_cli_exits_2_without_a_traceback_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.prom"
    bad.write_text(edited(l25=bucket("8.0", -3.0)))
    out = tmp_path / "w.jsonl"
    code, stdout, err = cli(
        capsys, "workload", "--from-metrics", bad, "-o", out, "--format", "json"
    )
    assert code == 2 and "Traceback" not in err and not out.exists()
    e = json.loads(stdout)["error"]
    assert e["kind"] == "ScrapeError" and e["message"].startswith(f"{bad}:25: ")
    code, _, err = cli(capsys, "workload", "--from-metrics", tmp_path / "none.prom")
    assert code == 2 and "no such file" in err
    code, _, err = cli(capsys, "workload", "--from-metrics", V0, "--label", "bad label")
    assert code == 1 and "expected NAME=VALUE" in err
    code, _, err = cli(capsys, "workload", "--from-metrics", "ftp://host/metrics")
    assert code == 1 and "only files and http:// or https:// URLs" in err


# -- scraping over HTTP --------------------------------------------------------------------------
class _Metrics(http.server.BaseHTTPRequestHandler):
    routes: dict = {}
    seen: list = []

    def do_GET(self):
        self.seen.append((self.path, self.headers.get("Authorization")))
        status, headers, body, delay = self.routes.get(self.path, (404, {}, b"nope", 0))
        time.sleep(delay)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    port = httpd.server_address[1]
    _Metrics.routes = {
        "/metrics": (200, {}, V0.read_bytes(), 0),
        "/moved": (302, {"Location": "/metrics"}, b"", 0),
        "/elsewhere": (302, {"Location": f"http://localhost:{port}/metrics"}, b"", 0),
        "/huge": (200, {}, b"#" * (prom_text.MAX_SCRAPE_BYTES + 1), 0),
        "/slow": (200, {}, b"x 1\n", 3),
        "/gzip": (200, {"Content-Encoding": "gzip"}, b"\x1f\x8b", 0),
    }
    yield f"http://127.0.0.1:{port}"
    httpd.shutdown()
    httpd.server_close()


def test_a_url_is_scraped_and_same_host_redirects_followed(server, tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    url = server.replace("http://", "http://user:secret@") + "/moved"
    code, _, _ = cli(capsys, "workload", "--from-metrics", url, "-o", out)
    assert code == 0 and load_trace(out).steps == 63
    assert load_trace(out).header["sources"] == [f"{server}/moved"]  # no credentials kept
    auth = "Basic dXNlcjpzZWNyZXQ="  # user:secret, sent as a header, to the redirect as well
    assert _Metrics.seen[-2:] == [("/moved", auth), ("/metrics", auth)]


@pytest.mark.parametrize(
    "path, match",
    [
        ("/elsewhere", r"redirected \(302\) to http://localhost:.*another host or scheme"),
        ("/huge", "more than 16777216 bytes"),
        ("/slow", "cannot fetch|not read in 0.5 s"),
        ("/gzip", "gzip-compressed"),
        ("/missing", "HTTP 404"),
    ],
)
def test_a_url_that_misbehaves_is_refused(server, capsys, path, match):
    code, _, err = cli(capsys, "workload", "--from-metrics", server + path, "--timeout", "0.5")
    assert code == 1 and "Traceback" not in err and re.search(match, err), err


# -- sizes under a budget --------------------------------------------------------------------------
SMALL = {
    "version": 1,
    "name": "small",
    "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 16},
    "cudagraph": {"mode": "PIECEWISE", "capture_sizes": [1, 2, 4, 8, 16]},
}
STEPS = {3: 5, 5: 2, 7: 4, 12: 1, 16: 1}  # num_tokens: steps (mixed: one request each)


def small_work():
    n = np.array(list(STEPS))
    return aggregate(
        Trace(
            source="w",
            num_tokens=n,
            num_reqs=np.ones_like(n),
            max_query_len=n,
            line=np.arange(1, len(n) + 1),
            count=np.array(list(STEPS.values())),
        ),
        1,
    )


def brute_force(graphs: int):
    """Least padded tokens over every size set holding 16 with at most ``graphs`` sizes
    (PIECEWISE: one graph per size), ties to the fewest sizes."""
    best = None
    for k in range(0, graphs):
        for rest in itertools.combinations(range(1, 16), k):
            sizes = sorted((*rest, 16))
            pad = sum(c * (next(s for s in sizes if s >= n) - n) for n, c in STEPS.items())
            best = min(best or (pad, len(sizes), sizes), (pad, len(sizes), sizes))
    return best


def test_the_optimum_under_each_budget_matches_brute_force_and_the_curve():
    table = compile_plan(SMALL)
    work = small_work()
    res = optimize(table, work, 5, curve_graphs=6)
    assert [(g, c) for g, c in res.curve] == [(g, brute_force(g)[0]) for g in range(1, 7)]
    assert dict(res.curve)[3] == 8 and dict(res.curve)[1] == 127
    for k in range(1, 6):
        got = optimize(table, work, k)
        assert (got.padded_tokens, got.graphs) == brute_force(k)[:2]
    assert optimize(table, work, 3).sizes == (3, 7, 16)  # the one set of 3 at 8 padded tokens


PROFILE = {
    "format": FORMAT,
    "version": 1,
    "model_fingerprint": "m",
    "device": "d",
    "per_graph_bytes": 1.0 * MIB,
    "per_token_bytes": 0.0,
    "per_graph_capture_seconds": 0.25,
    "base_capture_seconds": 0.5,
    "samples": [],
}


def test_capture_seconds_and_memory_budgets_are_graph_budgets_by_their_models():
    table, work = compile_plan(SMALL), small_work()
    by_time = optimize(table, work, 99, capture_budget=1.25, profile=PROFILE)  # (1.25-0.5)/0.25
    assert by_time.limits == {"--max-graphs": 99, "--budget-capture-seconds": 3}
    assert (by_time.budget_graphs, by_time.sizes, by_time.padded_tokens) == (3, (3, 7, 16), 8)
    by_memory = optimize(table, work, 99, memory_budget=4.5 * MIB, profile=PROFILE)
    assert by_memory.limits["--memory-budget"] == 4  # 4.5 MiB at 1 MiB a graph
    assert (by_memory.padded_tokens, by_memory.graphs) == brute_force(4)[:2] == (4, 4)
    default = optimize(table, work, 99, capture_budget=0.35)  # 0.1 s per graph, nothing measured
    assert default.limits["--budget-capture-seconds"] == 3 and default.sizes == (3, 7, 16)
    with pytest.raises(OptimizeError, match="--budget-capture-seconds allows 0 graphs"):
        optimize(table, work, 99, capture_budget=0.6, profile=PROFILE)
    with pytest.raises(OptimizeError, match="capturing anything takes 0.5 s"):
        optimize(table, work, 99, capture_budget=0.4, profile=PROFILE)
    with pytest.raises(OptimizeError, match="give a number of seconds > 0"):
        optimize(table, work, 99, capture_budget=float("nan"))


def test_the_cli_budgets_report_and_export_close_the_loop(tmp_path, capsys):
    work = tmp_path / "w.jsonl"
    assert cli(capsys, "workload", "--from-metrics", *V1, "--merge", "-o", work)[0] == 0
    tuned, page, profile = tmp_path / "tuned.yaml", tmp_path / "r.html", tmp_path / "p.json"
    profile.write_text(json.dumps({**PROFILE, "per_graph_bytes": 4 * MIB, "per_token_bytes": 0}))
    code, out, _ = cli(
        capsys,
        "optimize",
        H100,
        "--trace",
        work,
        "--budget-graphs",
        "60",
        "--budget-capture-seconds",
        "10.5",  # 0.5 s once + 0.25 s a graph: 40 graphs
        "--profile",
        profile,
        "-o",
        tuned,
        "--report",
        page,
        "--format",
        "json",
    )
    res = json.loads(out)
    assert code == 0 and res["budget_graphs"] == 40 and res["after"]["graphs"] <= 40
    assert res["limits"] == {"--max-graphs": 60, "--budget-capture-seconds": 40}
    assert res["after"]["capture_seconds"] == 0.5 + 0.25 * res["after"]["graphs"]
    assert res["before"]["capture_seconds"] == 0.5 + 0.25 * 86 and res["engine"] == "vllm"
    assert res["curve"][0][0] == 3 and res["curve"][-1][0] == 129  # fewest graphs .. 1.5 x 86
    html = page.read_text()
    assert '<svg id="tradeoff-chart"' in html and 'class="point tuned"' in html
    row = html[html.index('data-list="tuned"') :]
    assert f'<td class="num graphs">{res["after"]["graphs"]}</td>' in row
    assert f"{res['after']['padded_tokens']}</td>" in row
    # plan export takes the engine from the tuned plan and prints the saving beside the flags
    code, flags, err = cli(capsys, "export", tuned)
    flag = next(ln for ln in flags.splitlines() if ln.startswith("--compilation-config "))
    sizes = json.loads(flag.removeprefix("--compilation-config ").strip("'"))
    assert code == 0 and sizes["cudagraph_capture_sizes"] == res["after"]["sizes"]
    before, after = res["before"]["per_step"], res["after"]["per_step"]
    assert f"vLLM: predicted by plan optimize on {work}: padding {before:.3f} -> {after:.3f}" in err
    assert cli(capsys, "export", tuned, "--engine", "sglang")[2].startswith("SGLang: predicted")
    code, _, err = cli(capsys, "export", H100)
    assert code == 1 and "the plan records no engine" in err


def test_the_tuning_report_renders_its_chart_in_headless_chromium(tmp_path, capsys):
    import os
    import subprocess

    from test_report import CHROMIUM, FLAGS

    if not CHROMIUM:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing on CI; .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    work, page = tmp_path / "w.jsonl", tmp_path / "r.html"
    assert cli(capsys, "workload", "--from-metrics", V0, "-o", work)[0] == 0
    assert cli(capsys, "optimize", H100, "--trace", work, "--report", page)[0] == 0
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    chart = dom[dom.index('<svg id="tradeoff-chart"') :]
    chart = chart[: chart.index("</svg>")]
    assert '<polyline class="curve" points="' in chart and chart.count("<circle") == 2
    assert '<table id="tuning-sizes">' in dom


# -- fuzz: any scrape gives a workload or a GraphplanError, never another exception --------------
SEEDS = [p.read_bytes() for p in (V0, V0_SIZES, *V1, SGLANG[0], DATA / "graphplan.prom")]


@st.composite
def mangled(draw):
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["cut", "insert", "replace", "repeat"]))
        if kind == "cut":
            del data[at : at + draw(st.integers(1, 200))]
        elif kind == "insert":
            data[at:at] = draw(st.binary(max_size=20) | st.sampled_from([b"{", b"}", b'"', b"\n"]))
        elif kind == "replace" and at < len(data):
            data[at] = draw(st.sampled_from(b'0123456789-+.e{}",= \n#NaIf'))
        else:
            line = bytes(data).split(b"\n")[draw(st.integers(0, data.count(b"\n")))]
            data[at:at] = line + b"\n"
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mangled(), st.sampled_from(["uniform", "upper"]), st.booleans())
def test_a_mangled_scrape_gives_a_workload_or_an_error_never_a_crash(raw, spread, merge):
    try:
        scrape = prom_text.parse(raw, "s.prom")
        w = workload_from_scrapes([scrape], Options(spread=spread, merge=merge))
    except GraphplanError as e:
        assert str(e).startswith("s.prom")
        return
    assert w.steps == sum(c for *_, c in w.rows) and all(c > 0 for *_, c in w.rows)
    assert all(1 <= r <= n and m * r >= n for n, r, m, _ in w.rows)


def test_optimize_warns_that_an_upper_spread_workload_is_not_one_to_tune_on(tmp_path, capsys):
    work = tmp_path / "w.jsonl"
    assert cli(capsys, "workload", "--from-metrics", V0, "--spread", "upper", "-o", work)[0] == 0
    code, out, _ = cli(capsys, "optimize", H100, "--trace", work)
    assert code == 0 and "note: the workload puts each histogram bucket's steps at its upper" in out
    uniform = tmp_path / "u.jsonl"
    assert cli(capsys, "workload", "--from-metrics", V0, "-o", uniform)[0] == 0
    assert "upper edge" not in cli(capsys, "optimize", H100, "--trace", uniform)[1]
