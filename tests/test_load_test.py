"""bench/load_test.py at smoke size on the CPU: the program starts a server, streams from
concurrent clients (some hanging up) beside one long prompt, and passes only when every request not cancelled finished
whole and the cancelled ones freed their seats and KV blocks."""

import re

import pytest

from load_test import main


def test_the_load_test_runs_at_smoke_size_and_passes(tmp_path):
    out = tmp_path / "load.md"
    args = [
        "--random-weights",
        "--device",
        "cpu",
        "--shape",
        "tiny",
        "--clients",
        "4",
        "--requests",
        "2",
        "--disconnect",
        "0.4",
        "--long-prompt",
        "40",
        "--long-max-tokens",
        "5",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    text = out.read_text()
    assert "**PASS**" in text and "| TTFT |" in text and "| ITL |" in text
    assert "KV blocks used 0" in text and "running requests 0" in text
    assert "the long request (40 prompt tokens, 5 out): finished whole, 5 tokens" in text


def test_serve_overhead_runs_at_smoke_size(tmp_path):
    """bench/serve_overhead.py: the served step's token gaps in the steady window and the replay
    of the same decode graph, in one report (on the CPU the numbers mean nothing)."""
    from serve_overhead import main as overhead

    out = tmp_path / "overhead.md"
    args = ["--random-weights", "--device", "cpu", "--shape", "tiny", "--clients", "3"]
    args += ["--prompt-len", "6", "--max-tokens", "32", "--out", str(out)]
    assert overhead([*args, "--variants", "greedy,sampled+async,greedy+engine"]) == 0
    text = out.read_text()
    assert "- 3 streaming clients, 6 prompt tokens, 32 output tokens each" in text
    assert (
        "replay (GraphRunner.step of the decode graph, then the LM head on its rows, as the server runs them; batch 3, context"
        in text
    )
    rows = [
        line for line in text.splitlines() if line.startswith("| greedy") or "| sampled" in line
    ]
    assert [r.split(" | ")[0] for r in rows] == ["| greedy", "| sampled+async", "| greedy+engine"]
    # clients with a token inside the steady window: all 3 on a quiet machine; on a loaded one the
    # front end can write a client's tokens of several steps at once, past the window
    for r in rows:
        window = re.search(r"\| ([123]) clients, (\d+) gaps, context \d+ \|", r)
        assert window and int(window[2]) >= 10 and " ms = " in r, r
    # replay + the variant's sampler, measured in the same run
    assert all(re.fullmatch(r"\d+\.\d\d \+ \d+\.\d\d ms", r.split(" | ")[3]) for r in rows), rows
    async_steps = [int(r.rstrip(" |").rsplit("| ", 1)[1]) for r in rows]  # from /metrics
    assert async_steps[0] == 0 and async_steps[1] > 0 and async_steps[2] == 0
    assert "--async-scheduling" in text.split("- sampled+async: server")[1]
    greedy_line = text.split("- greedy: server")[1].split("\n")[0]  # the server's defaults off
    assert "--no-async-scheduling --no-fused-sampler" in greedy_line
    engine = "- greedy+engine: server `bench/engine_steps.py '(no HTTP)' --no-async-scheduling "
    assert engine + "--no-fused-sampler`" in text


@pytest.mark.parametrize(
    "variants, message",
    [
        ("greedy+fast", "'greedy+fast': the options are +async, +fused and +engine"),
        ("beam", "'beam' must be greedy or sampled, then +async, +fused, +engine"),
        ("sampled+async+async", "'sampled+async+async' must be greedy or sampled"),
    ],
)
def test_serve_overhead_refuses_an_unknown_variant(variants, message, capsys):
    from serve_overhead import main as overhead

    with pytest.raises(SystemExit) as e:
        overhead(["--random-weights", "--device", "cpu", "--variants", variants])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_host_step_times_each_phase_of_a_steady_decode_step(tmp_path):
    from host_step import PHASES
    from host_step import main as host_step

    out = tmp_path / "host.md"
    assert host_step(["--device", "cpu", "--batch", "4", "--steps", "5", "--out", str(out)]) == 0
    text = out.read_text()
    assert "## host_step: 4 decodes a step, greedy, cpu" in text
    row = text.strip().splitlines()[-1]
    cells = [float(c) for c in row.strip("| ").split(" | ")]
    assert len(cells) == len(PHASES) + 1 and all(c > 0 for c in cells)
    assert cells[-1] == pytest.approx(sum(cells[:-1]) - cells[PHASES.index("read")], abs=3)
    # long prompts, prefilled in untimed steps, and make_batch as async scheduling calls it
    argv = ["--device", "cpu", "--batch", "3", "--steps", "3", "--context", "40", "--non-blocking"]
    assert host_step([*argv, "--out", str(out)]) == 0
    assert "## host_step: 3 decodes a step, greedy, cpu, 40-token prompts, non_blocking" in (
        out.read_text()
    )


def test_make_batch_bench_times_the_steady_decode_batch(tmp_path):
    from make_batch_bench import main as make_batch_bench

    out = tmp_path / "mb.md"
    argv = ["--device", "cpu", "--batch", "4", "--context", "20", "--steps", "3", "--repeats", "2"]
    assert make_batch_bench([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    assert "## make_batch: 4 decodes of 20-token contexts, cpu" in text
    best, median = (float(c) for c in text.strip().splitlines()[-1].strip("| ").split(" | "))
    assert 0 < best <= median


def test_thread_cpu_reads_each_threads_cpu_per_streamed_token(tmp_path):
    from thread_cpu import THREADS
    from thread_cpu import main as thread_cpu

    out = tmp_path / "threads.md"
    argv = ["--device", "cpu", "--clients", "4", "--tokens", "6", "--rounds", "2"]
    assert thread_cpu([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    assert "## thread_cpu: 4 streaming clients x 6 tokens, cpu" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2
    for row in rows:
        cells = [float(c) for c in row.strip("| ").split(" | ")[1:]]
        assert len(cells) == len(THREADS) and all(c >= 0 for c in cells)
