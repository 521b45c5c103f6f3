"""bench/load_test.py at smoke size on the CPU: the program starts a server, streams from
concurrent clients (some hanging up), and passes only when every request not cancelled finished
whole and the cancelled ones freed their seats and KV blocks."""

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
        "--out",
        str(out),
    ]
    assert main(args) == 0
    text = out.read_text()
    assert "**PASS**" in text and "| TTFT |" in text and "| ITL |" in text
    assert "KV blocks used 0" in text and "running requests 0" in text
