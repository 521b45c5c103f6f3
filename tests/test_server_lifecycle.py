"""The serving process's life: every CLI value checked with a usage error (exit 2), SIGTERM and
SIGINT at any moment (capture included) ending the process within 2 s with a message, and one
access-log line per request."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_server import SPEC, SPEC_ARGS, exchange, plan_text

from graphplan.server import Server
from graphplan.server.cli import main

from served import alive

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--port", "70000"], "--port: '70000' must be at least 0 and at most 65535"),
        (["--port", "-1"], "--port: '-1' must be at least 0"),
        (["--port", "http"], "--port: 'http' is not a port number"),
        (["--idle-timeout", "-1"], "--idle-timeout: '-1' must be above 0"),
        (["--idle-timeout", "0"], "--idle-timeout: '0' must be above 0"),
        (["--idle-timeout", "nan"], "--idle-timeout: 'nan' must be above 0"),
        (["--drain-timeout", "-5"], "--drain-timeout: '-5' must be at least 0"),
        (["--max-body-bytes", "0"], "--max-body-bytes: '0' must be at least 1"),
        (["--max-waiting", "0"], "--max-waiting: '0' must be at least 1"),
        (["--kv-memory-fraction", "1.5"], "--kv-memory-fraction: '1.5' must be above 0"),
        (["--kv-cache-tokens", "0"], "--kv-cache-tokens: '0' must be at least 1"),
        (["--layers", "0"], "--layers: '0' must be at least 1"),
        (["--max-model-len", "x"], "--max-model-len: 'x' is not an integer"),
        (["--log-level", "LOUD"], "--log-level: invalid choice: 'LOUD'"),
        (["--device", "gpu0"], "--device 'gpu0' is not a torch device: use cpu, cuda or cuda:N"),
        (
            ["--device", "cpu", "--fused-sampler"],
            "--fused-sampler runs a Triton kernel on the GPU: it needs --device cuda, not cpu",
        ),
    ],
)
def test_every_bad_cli_value_is_a_usage_error(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--plan", "plans/tiny-llama.yaml", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: graphplan-serve" in err and message in err, err


@pytest.mark.parametrize("flags", [["--version"], ["--plan", "x.yaml", "--version"]])
def test_version_needs_no_plan(flags, capsys):
    from graphplan.compiler import __version__

    with pytest.raises(SystemExit) as e:
        main(flags)
    assert e.value.code == 0
    assert capsys.readouterr().out == f"graphplan-serve (graphplan) {__version__}\n"


@pytest.mark.parametrize(
    "flags, want",
    [
        ([], (True, None)),  # the defaults: async scheduling on, the fused sampler on with CUDA
        (["--no-async-scheduling", "--no-fused-sampler"], (False, False)),
        (["--async-scheduling", "--no-fused-sampler"], (True, False)),
    ],
)
def test_async_scheduling_is_on_unless_turned_off(flags, want, monkeypatch):
    """What the CLI hands the server: Engine(fused_sampler=None) turns the kernel on where the
    model is on CUDA (server/core/engine.py)."""
    import graphplan.server.cli as cli

    seen = {}

    class Stop(Exception):
        pass

    def fake_server(*a, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(cli, "Server", fake_server)
    with pytest.raises(Stop):
        main(["--plan", "plans/tiny-llama.yaml", "--device", "cpu", *flags])
    assert (seen["async_scheduling"], seen["fused_sampler"]) == want


SLOW_CAPTURE = (
    "import sys, time\n"
    "from graphplan.runtime import GraphRunner\n"
    "real = GraphRunner.capture\n"
    "def slow(self, *a, **k):\n"
    "    print('CAPTURING', file=sys.stderr, flush=True)\n"
    "    time.sleep(120)\n"
    "    return real(self, *a, **k)\n"
    "GraphRunner.capture = slow\n"  # module level: the engine process (spawned) runs it too
    "if __name__ == '__main__':\n"
    "    from graphplan.server.cli import main\n"
    "    sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize("mode", [[], ["--single-process"]], ids=["engine-process", "one-process"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_capture_ends_the_process_within_2_s_with_a_message(tmp_path, sig, mode):
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text())
    script = tmp_path / "slow_capture.py"
    script.write_text(SLOW_CAPTURE)
    cmd = [
        sys.executable,
        str(script),
        "--plan",
        str(plan),
        "--port",
        "0",
        "--device",
        "cpu",
        "--no-progress",
        *SPEC_ARGS,
        *mode,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "CAPTURING" in line or (not line and proc.poll() is not None):
                break
        assert "CAPTURING" in lines[-1], "".join(lines)
        engine = [int(m.group(1)) for m in map(ENGINE_PID.search, lines) if m]
        assert len(engine) == (0 if mode else 1), lines
        t0 = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(5)
        elapsed = time.monotonic() - t0
        err = proc.stderr.read()
        name = signal.Signals(sig).name
        assert code == 128 + sig and elapsed < 2, (code, elapsed)
        assert f"{name} while capturing graphs: exiting now" in err and "Traceback" not in err
        time.sleep(0.5)  # the engine process ends with the server (parent-death signal)
        assert not [pid for pid in engine if alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


ENGINE_PID = re.compile(r"engine process (\d+)")


def test_a_second_signal_while_draining_exits_at_once(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text())
    cmd = [
        sys.executable,
        "-m",
        "graphplan.server",
        "--plan",
        str(plan),
        "--port",
        "0",
        "--device",
        "cpu",
        "--no-progress",
        "--drain-timeout",
        "60",
        *SPEC_ARGS,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", proc.stderr.readline())
            port = int(m.group(1)) if m else None
        while exchange(("127.0.0.1", port), "GET", "/healthz")[0].status != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(
            "POST",
            "/generate",
            json.dumps({"prompt": [1] * 8, "max_tokens": 40, "stream": True}).encode(),
        )
        resp = conn.getresponse()
        assert resp.readline()  # a token: the request is running
        proc.send_signal(signal.SIGTERM)  # drains: up to 60 s
        while "stopping (SIGTERM)" not in proc.stderr.readline():
            assert time.monotonic() < deadline
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 128 + signal.SIGTERM and time.monotonic() - t0 < 2
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_each_request_writes_one_access_log_line(tmp_path, caplog):
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text())
    s = Server(plan, spec=SPEC, progress=False).start()
    try:
        assert s.wait_ready(30)
        with caplog.at_level(logging.INFO, logger="graphplan.server.access"):
            exchange(s, "GET", "/healthz")
            exchange(s, "POST", "/generate", {"prompt": [1, 2], "max_tokens": 2})
            exchange(s, "GET", "/nope")
            t0 = time.monotonic()  # a line is written just after its response is sent
            while len(_access(caplog)) < 3 and time.monotonic() - t0 < 5:
                time.sleep(0.01)
        lines = _access(caplog)
        assert len(lines) == 3, lines
        assert re.match(r'127\.0\.0\.1 "GET /healthz" 200 \d+ [\d.]+ms$', lines[0])
        assert '"POST /generate" 200' in lines[1] and '"GET /nope" 404' in lines[2]
    finally:
        s.stop()


def _access(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "graphplan.server.access"]
