"""plan report: a self-contained page whose figures are the compiler's, rendered by a real browser."""

import html
import json
import os
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

from graphplan.compiler import RuntimeMode, compile_plan
from graphplan.compiler.cli import main
from graphplan.compiler.tools.memory import estimate
from graphplan.compiler.tools.report_charts import X0, X1, Y0, Y1
from graphplan.compiler.tools.summary import coverage
from graphplan.compiler.tools.trace import step_route

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"
H100 = PLANS / "llama3-8b-h100.yaml"
CHAT = ROOT / "bench" / "traces" / "chat.jsonl"
ALL_PLANS = sorted(p.name for p in PLANS.glob("*.yaml"))


def report(tmp_path, plan, *args) -> str:
    out = tmp_path / "report.html"
    assert main(["report", str(plan), "-o", str(out), *args]) == 0
    return out.read_text(encoding="utf-8")


def svg(page: str, svg_id: str) -> str:
    m = re.search(rf'<svg id="{svg_id}"[^>]*>.*?</svg>', page, re.S)
    assert m, f"no <svg id={svg_id}>"
    return m.group(0)


def routine_row(page: str, routine: str) -> dict:
    row = re.search(rf'<tr data-routine="{routine}">(.*?)</tr>', page, re.S).group(1)
    cell = lambda cls: re.search(rf'class="num {cls}">([^<]*)<', row).group(1)
    return {
        "worst_pad": int(cell("worst-pad")),
        "worst_at": int(cell("worst-at")),
        "mean_pad": float(cell("mean-pad")),
    }


def padding_of(table, routine: str, n: int) -> int:
    """Padding a batch of n tokens gets, straight from the table's router."""
    route = step_route(table, n, n // table.q, table.q) if routine == "decode" else table.route(n)
    return route.padded_tokens - n


@pytest.mark.parametrize("plan", ALL_PLANS + ["sweep.yaml.j2"])
def test_every_plan_reports_to_a_self_contained_page(tmp_path, plan):
    extra = ["--set", "max_num_seqs=64", "--set", "spec_tokens=2"] if plan.endswith(".j2") else []
    page = report(tmp_path, PLANS / plan, *extra)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for forbidden in ("<script", " src=", " href=", "url(", "@import", "<link", "<iframe"):
        assert forbidden not in page.lower()
    assert re.findall(r"https?://[^\s\"'<]+", page) in (
        [],
        ["http://www.w3.org/2000/svg"] * page.count("<svg"),
    )


@pytest.mark.parametrize("plan", [p for p in ALL_PLANS if p != "eager.yaml"])
def test_routine_figures_and_curves_are_the_routers(tmp_path, plan):
    table = compile_plan(PLANS / plan)
    page = report(tmp_path, PLANS / plan)
    for c in coverage(table):
        step = table.q if c.routine == "decode" else 1
        batches = range(step, c.sizes[-1] + 1, step)
        pads = [padding_of(table, c.routine, n) for n in batches]
        row = routine_row(page, c.routine)
        assert (row["worst_pad"], row["worst_at"]) == (c.worst_pad, c.worst_at)
        assert row["worst_pad"] == max(pads)
        assert row["mean_pad"] == pytest.approx(sum(pads) / len(pads), abs=5e-4)
        chart = svg(page, f"padding-{c.routine}")
        x_max = float(re.search(r'data-x-max="([\d.]+)"', chart).group(1))
        y_max = float(re.search(r'data-y-max="([\d.]+)"', chart).group(1))
        points = re.search(r'<polyline class="curve" points="([^"]+)"', chart).group(1).split()
        assert len(points) >= 2 * len(c.sizes) - 2
        for p in points:  # every vertex of the sawtooth, mapped back to (num_tokens, padding)
            px, py = map(float, p.split(","))
            n = round((px - X0) / (X1 - X0) * x_max)
            pad = round((Y1 - py) / (Y1 - Y0) * y_max)
            assert pad == padding_of(table, c.routine, n), (c.routine, n)
        if c.worst_pad:
            assert f">worst {c.worst_pad} @ {c.worst_at}<" in chart


def test_graph_counts_and_memory_match_the_table(tmp_path):
    table = compile_plan(PLANS / "deepseek-v3-dp8-dbo.yaml")
    page = report(tmp_path, PLANS / "deepseek-v3-dp8-dbo.yaml")
    assert re.search(r'id="num-graphs">(\d+)<', page).group(1) == str(len(table.graphs))
    chart = svg(page, "graphs-chart")
    bars = dict(re.findall(r'data-bar="([^"]+)"[^>]*>(\d+)<', chart))
    assert bars == {
        "FULL decode": str(sum(g.routine == "full_decode" for g in table.graphs)),
        "FULL decode, ubatched": str(
            sum(g.routine == "full_decode_ubatched" for g in table.graphs)
        ),
    }
    assert int(re.search(r'id="graphs-FULL">(\d+)<', page).group(1)) == len(table.graphs)
    mem = estimate(table)
    assert f'data-bytes="{mem["total_bytes"]}"' in page
    assert html.escape(mem["explanation"]) in page
    rows = re.findall(
        r'<tr><td class="num">(\d+)</td><td>(\w+)</td><td>(\w+)</td>'
        r'<td class="num">(\d+)</td>',
        page,
    )
    assert [(int(i), m, r, int(n)) for i, m, r, n in rows] == [
        (g.id, g.mode.name, g.routine, g.key.num_tokens) for g in table.graphs
    ]


def test_every_diagnostic_and_downgrade_is_listed_with_its_place(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text(
        "version: 1\nname: downgraded\n"
        "scheduler: {max_num_seqs: 16, max_num_batched_tokens: 64}\n"
        "cudagraph:\n  mode: FULL\n  attention_support: UNIFORM_BATCH\n"
        "  capture_sizes: [1, 8, 8, 100]\n"
    )
    table = compile_plan(plan)
    assert len(table.diagnostics) == 3
    page = report(tmp_path, plan)
    for d in table.diagnostics:
        assert html.escape(d["message"]) in page and f"<code>{d['code']}</code>" in page
    row = re.search(r'<tr class="downgrade">(.*?)</tr>', page, re.S).group(1)
    assert "mode-downgrade" in row and f"{plan}:5:" in row
    assert re.search(r'id="num-diagnostics" class="warning">3<', page)


def test_trace_section_shows_the_padding_the_router_gives_each_step(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = CHAT.read_text().splitlines()[:3000]
    trace.write_text("\n".join(lines) + "\n")
    table = compile_plan(H100)
    padded = graphed = eager = 0
    for line in lines:
        n, r, m = (int(v) for v in re.findall(r"\d+", line))
        route = table.route(n, r, m)
        if route.mode is RuntimeMode.NONE:
            eager += 1
        else:
            graphed, padded = graphed + 1, padded + route.padded_tokens - n
    page = report(tmp_path, H100, "--trace", str(trace))
    assert re.search(r'id="trace-steps">(\d+)<', page).group(1) == "3000"
    assert re.search(r'id="trace-padded">(\d+)<', page).group(1) == str(padded)
    assert re.search(r'id="trace-graphed">(\d+)<', page).group(1) == str(graphed)
    assert re.search(r'id="trace-eager">(\d+)<', page).group(1) == str(eager)
    assert f'id="trace-per-graph-step">{padded / graphed:.3f}<' in page
    assert f'id="trace-graphed-share">{100 * graphed / 3000:.1f} %<' in page
    by_size = svg(page, "trace-by-size")
    assert len(re.findall(r'<rect class="spike"', by_size)) >= 10


def test_the_trace_headline_does_not_reward_running_eager(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(CHAT.read_text().splitlines()[:3000]) + "\n")
    page = report(tmp_path, PLANS / "eager.yaml", "--trace", str(trace))
    assert 'id="trace-graphed-share">0.0 %<' in page
    assert 'id="trace-eager-steps" class="warning">3000<' in page
    assert "padding tokens per step (trace)" not in page and "trace-per-step" not in page
    assert "0.0 % of all 3000 steps on graphs" in capsys.readouterr().out


def test_a_trace_that_does_not_fit_the_plan_gets_warnings(tmp_path, capsys):
    # the chat trace has steps of 130+ requests and was recorded without speculative decoding;
    # the eagle3 plan allows 128 requests and has decode_query_len 3
    out = tmp_path / "r.html"
    assert (
        main(
            [
                "report",
                str(PLANS / "llama3-8b-eagle3.yaml"),
                "-o",
                str(out),
                "--trace",
                str(CHAT),
                "--format",
                "json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out)["trace"]
    w = got["warnings"]
    assert len(w) == 2 and got["steps"] == 20000 and got["priced_steps"] < 20000
    assert re.search(r"chat.jsonl:\d+: num_reqs 130 exceeds scheduler.max_num_seqs=128", w[0])
    assert "every request at 1 token (0 at 3)" in w[1] and "decode_query_len=1" in w[1]
    page = out.read_text()
    assert page.count('class="warning trace-warning"') == 2


def test_the_trace_histogram_covers_every_step(tmp_path):
    long = ROOT / "bench" / "traces" / "long_prompt.jsonl"  # steps up to 8192 tokens
    page = report(tmp_path, H100, "--trace", str(long))
    hist = svg(page, "trace-histogram")
    x_max = float(re.search(r'data-x-max="([\d.]+)"', hist).group(1))
    assert x_max >= 8192
    assert "above 512: eager" in hist


def test_a_report_from_a_compiled_table_matches_the_plans(tmp_path):
    table_path = tmp_path / "table.json"
    assert main(["compile", str(H100), "-o", str(table_path)]) == 0
    a = report(tmp_path, H100)
    b = report(tmp_path, table_path)
    strip = lambda s: re.sub(r"report of <code>[^<]*</code>", "", s)
    assert strip(a) == strip(b)


def test_failures_exit_1_without_traceback_and_leave_the_old_report(tmp_path, capsys):
    out = tmp_path / "report.html"
    out.write_text("old")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"num_tokens": 99999, "num_reqs": 1, "max_query_len": 99999}\n')
    assert main(["report", str(H100), "-o", str(out), "--trace", str(bad)]) == 1
    assert main(["report", str(H100), "-o", str(tmp_path / "no" / "r.html")]) == 1
    assert main(["report", str(H100), "-o", str(out), "--profile", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:1: num_tokens 99999 exceeds" in err and "cannot write here" in err
    assert "not a graphplan memory profile" in err and "Traceback" not in err
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "bad.jsonl",
        "report.html",
    ]


# -- a real browser --------------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def png_rows(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, decompressed scanlines) of a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


def test_the_report_renders_in_headless_chromium(tmp_path):
    if not CHROMIUM:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing on CI; .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    page = tmp_path / "report.html"
    assert main(["report", str(H100), "-o", str(page), "--trace", str(CHAT)]) == 0
    shot = tmp_path / "shot.png"
    common = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    run = subprocess.run(
        [*common, f"--screenshot={shot}", "--window-size=1280,2000", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), run.stderr[-2000:]
    data = shot.read_bytes()
    width, height, rows = png_rows(data)
    assert (width, height) == (1280, 2000) and len(data) > 50_000
    # a blank page filters to (nearly) all zero bytes; text, tables and charts do not
    assert sum(b != 0 for b in rows[::7]) > 0.02 * len(rows[::7])
    assert len(set(rows)) > 100
    dom = subprocess.run(
        [*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    for element in (
        '<svg id="padding-decode"',
        '<svg id="padding-mixed"',
        '<svg id="graphs-chart"',
        '<svg id="trace-by-size"',
        '<table id="graphs">',
        '<polyline class="curve"',
    ):
        assert element in dom


def test_the_trace_headline_counts_every_step_and_says_how_many_were_left_out(tmp_path, capsys):
    # 19,995 of 20,000 steps are above the plan's max_num_batched_tokens: the 5 left are on
    # graphs, but the headline is over every step (0.0 %, not 100 %) and says why the rest is out
    plan = tmp_path / "p.yaml"
    plan.write_text(
        "version: 1\nname: small\nscheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}\n"
        "cudagraph: {capture_sizes: [1, 2, 4, 8]}\n"
    )
    trace = tmp_path / "t.jsonl"
    fits = '{"num_tokens": 4, "num_reqs": 4, "max_query_len": 1}\n'
    over = '{"num_tokens": 100, "num_reqs": 4, "max_query_len": 97}\n'
    trace.write_text(fits * 5 + over * 19_995)
    out = tmp_path / "r.html"
    assert main(["report", str(plan), "--trace", str(trace), "-o", str(out)]) == 0
    line = capsys.readouterr().out
    assert "trace: 0.0 % of all 20000 steps on graphs; 19995 of 20000 steps left out" in line
    assert "19995 with num_tokens above scheduler.max_num_batched_tokens=64" in line
    page = out.read_text()
    assert 'id="trace-graphed-share">0.0 %<' in page and "of all 20000 trace steps" in page
    assert 'id="trace-left-out" class="warning">19995<' in page
    assert 'id="trace-all-steps">20000<' in page and 'id="trace-steps">5<' in page
    assert "this plan's scheduler never runs them" in page
    args = ["report", str(plan), "--trace", str(trace), "-o", str(out), "--format", "json"]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)["trace"]
    assert (got["steps"], got["priced_steps"], got["left_out_steps"]) == (20000, 5, 19995)
    assert got["graphed_share"] == 5 / 20000 and got["graphed_steps"] == 5
    assert got["left_out"] == {"num_tokens above scheduler.max_num_batched_tokens=64": 19995}
