"""graphplan's server and the runtime against hostile clients: admin routes locked by a token
(off without one), reloads confined to a directory, JSON 4xx for every client error, timeouts on
idle sockets, a slow template that cannot wedge reloads, and an interrupted capture that releases
everything."""

from __future__ import annotations

import hmac
import json
import os
import socket
import time
from pathlib import Path

import pytest
from test_server import SPEC, exchange, plan_text

from graphplan.compiler import template as T
from graphplan.server import Server
from graphplan.server.frontend.security import TOKEN_ENV, admin_token

ROOT = Path(__file__).resolve().parents[1]

TOKEN = "trust-test-token-abcdefghijkl"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def call(server, method, path, body=None, headers=None, raw: bytes | None = None):
    resp, text = exchange(server, method, path, body, headers, raw, timeout=30)
    assert resp.getheader("Content-Type") == "application/json", (method, path, text[:200])
    return resp.status, json.loads(text), resp


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("plans")
    (d / "plan.yaml").write_text(plan_text())
    (d / "other.yaml").write_text(plan_text(name="t2", sizes=(1, 2)))
    return d


@pytest.fixture(scope="module")
def server(plans):
    s = Server(
        plans / "plan.yaml", spec=SPEC, progress=False, max_body_bytes=1 << 16, admin_token=TOKEN
    ).start()
    assert s.wait_ready(30)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_server(plans):
    """Started without a token: the admin routes are off."""
    s = Server(plans / "plan.yaml", spec=SPEC, progress=False).start()
    assert s.wait_ready(30)
    yield s
    s.stop()


# -- the admin token ------------------------------------------------------------------------------


def test_admin_routes_are_off_without_a_token(open_server, plans):
    fp = open_server.engine.table.fingerprint
    for method, path in (
        ("POST", "/admin/reload"),
        ("GET", "/admin/reload"),
        ("POST", "/admin/other"),
        ("DELETE", "/admin/reload"),
    ):
        status, body, _ = call(
            open_server, method, path, {"path": str(plans / "other.yaml")}, ADMIN
        )
        assert status == 403 and TOKEN_ENV in body["error"]["message"], body
    assert open_server.engine.table.fingerprint == fp


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-xxxxxxxxxxxx"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
    ],
)
def test_admin_routes_refuse_a_missing_or_wrong_token(server, plans, headers):
    fp = server.engine.table.fingerprint
    status, body, resp = call(
        server, "POST", "/admin/reload", {"path": str(plans / "other.yaml")}, headers
    )
    assert status == 401 and resp.getheader("WWW-Authenticate") == "Bearer"
    assert body["error"]["type"] == "authentication_error"
    assert server.engine.table.fingerprint == fp


def test_the_token_is_compared_in_constant_time(server, monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    status, body, _ = call(server, "POST", "/admin/reload", {}, ADMIN)
    assert status == 200 and body["unchanged"], body
    assert calls == [(TOKEN.encode(), TOKEN.encode())]


def test_the_token_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert admin_token(None) is None and admin_token("x" * 20) == "x" * 20
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment-123")
    assert admin_token(None) == "from-the-environment-123"
    assert admin_token("from-the-flag-1234567890") == "from-the-flag-1234567890"


def test_a_short_token_is_refused_at_start_up(plans, capsys):
    from graphplan.server.cli import main

    code = main(
        [
            "--plan",
            str(plans / "plan.yaml"),
            "--port",
            "0",
            "--device",
            "cpu",
            "--admin-token",
            "short",
        ]
    )
    assert code == 1 and "at least 16 characters" in capsys.readouterr().err


# -- the reload directory -------------------------------------------------------------------------


def test_reload_paths_outside_the_reload_directory_are_refused(server, plans, tmp_path):
    outside = tmp_path / "outside.yaml"
    outside.write_text(plan_text(name="evil"))
    link = plans / "link.yaml"
    link.symlink_to(outside)
    fp = server.engine.table.fingerprint
    try:
        for path in (
            str(outside),
            "/etc/passwd",
            "../" + outside.name,
            str(link),
            "link.yaml",
            str(plans / ".." / plans.name / ".." / "x.yaml"),
        ):
            status, body, _ = call(server, "POST", "/admin/reload", {"path": path}, ADMIN)
            assert status == 403 and "outside the reload directory" in body["error"]["message"], (
                path,
                body,
            )
            assert server.engine.table.fingerprint == fp
    finally:
        link.unlink()
    status, body, _ = call(server, "POST", "/admin/reload", {"path": "other.yaml"}, ADMIN)
    assert status == 200 and body["plan"] == "t2", body  # relative to the directory
    status, body, _ = call(
        server, "POST", "/admin/reload", {"path": str(plans / "plan.yaml")}, ADMIN
    )
    assert status == 200 and body["plan"] == "t"


def test_the_reload_directory_can_be_given_at_start_up(plans, tmp_path):
    elsewhere = tmp_path / "reloads"
    elsewhere.mkdir()
    (elsewhere / "p.yaml").write_text(plan_text(name="t3", sizes=(1, 4)))
    s = Server(
        plans / "plan.yaml", spec=SPEC, progress=False, admin_token=TOKEN, reload_dir=elsewhere
    ).start()
    try:
        assert s.wait_ready(30)
        assert (
            call(s, "POST", "/admin/reload", {"path": str(plans / "other.yaml")}, ADMIN)[0] == 403
        )
        status, body, _ = call(s, "POST", "/admin/reload", {"path": "p.yaml"}, ADMIN)
        assert status == 200 and body["plan"] == "t3"
        assert call(s, "POST", "/admin/reload", {}, ADMIN)[0] == 200  # the start-up plan
    finally:
        s.stop()


# -- every client error is a JSON 4xx -------------------------------------------------------------


def test_bad_reload_bodies_and_paths_answer_4xx(server, plans):
    fifo, fifo_table = plans / "fifo.yaml", plans / "fifo.json"
    os.mkfifo(fifo)
    os.mkfifo(fifo_table)
    cases = [
        (b"[" * 5000 + b"]" * 5000, 400, "nested too deeply"),
        (json.dumps({"path": "a\x00b.yaml"}).encode(), 400, "not a usable file name"),
        (json.dumps({"path": str(plans)}).encode(), 422, "is a directory"),
        (json.dumps({"path": "fifo.yaml"}).encode(), 422, "is a FIFO"),
        (json.dumps({"path": "fifo.json"}).encode(), 422, "is a FIFO"),
        (
            json.dumps(
                {
                    "path": "plan.yaml",
                    "set": {
                        "lora": [
                            [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
                        ]
                    },
                }
            ).encode(),
            422,
            "too-deep",
        ),
        (
            json.dumps({"path": "plan.yaml", "set": {"parallel.sync_timeout_s": 1e400}}).encode(),
            422,
            "not-finite",
        ),
        (
            json.dumps({"path": "plan.yaml", "set": {"scheduler.max_num_seqs": 8.0}}).encode(),
            422,
            "expected integer",
        ),
    ]
    try:
        for raw, want, message in cases:
            status, body, _ = call(server, "POST", "/admin/reload", headers=ADMIN, raw=raw)
            assert status == want and message in body["error"]["message"], (
                raw[:60],
                body,
            )
    finally:
        fifo.unlink()
        fifo_table.unlink()


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("PUT", "/generate", 405),
        ("DELETE", "/generate", 405),
        ("PATCH", "/healthz", 405),
        ("GET", "/generate", 405),
        ("POST", "/healthz", 405),
        ("POST", "/metrics", 405),
        ("GET", "/v1/completions", 405),
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
        ("FOO", "/generate", 405),
        ("PUT", "/nope", 404),
        ("DELETE", "/nope", 404),
        ("GET", "/nope", 404),
        ("PATCH", "/", 404),
        # a method no route takes: 405 where the path is a route, 501 where it is none
        *[
            (m, p, 405)
            for m in ("TRACE", "CONNECT", "OPTIONS")
            for p in ("/generate", "/v1/models")
        ],
        *[(m, p, 501) for m in ("TRACE", "CONNECT", "OPTIONS", "FOO") for p in ("/", "/nope")],
    ],
)
def test_wrong_and_unknown_methods_answer_json(server, method, path, status):
    got, body, resp = call(server, method, path, {})
    assert got == status and set(body["error"]) == {"message", "type", "param", "code"}, body
    if status == 405:
        assert resp.getheader("Allow") in ("GET", "POST") and method in body["error"]["message"]
    if status == 501:
        assert body["error"]["message"] == (
            f"{method} is not implemented by this server; its routes take GET and POST"
        )


@pytest.mark.parametrize(
    "head, status",
    [
        (b"GET /" + b"a" * 40_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /healthz?" + b"a" * 9_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"A" * 9_000 + b" /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 40_000 + b"\r\n\r\n", 431),
        (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
            + (b"X-A: " + b"b" * 6000 + b"\r\n") * 3
            + b"\r\n",
            431,
        ),
    ],
    ids=["40KB-path", "9KB-query", "9KB-method", "40KB-header", "18KB-headers"],
)
@pytest.mark.parametrize("arrival", ["whole", "unended"])
def test_an_oversized_request_line_is_414_and_oversized_headers_431(server, head, status, arrival):
    """A whole head (one send) is parsed by h11, then refused by the app (http_app.Guard); one
    that has not ended within h11's 16 KiB buffer (sent in pieces) is refused by the protocol
    (http_protocol). Either way: the one error shape, and no echo of the input."""
    if arrival == "unended":  # 17,000 bytes in pieces, all read by the server before it answers
        head = head.replace(b"\r\n\r\n", b"\r\n")[:17_000].ljust(17_000, b"a")
        pieces = [head[i : i + 1000] for i in range(0, len(head), 1000)]
    else:
        pieces = [head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")]
    with socket.create_connection(server.address, timeout=10) as sock:
        for piece in pieces:
            sock.sendall(piece)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    top, _, body = reply.decode().partition("\r\n\r\n")
    assert top.split("\r\n")[0].split(" ")[1] == str(status), top
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and len(reply) < 1000
    assert error["message"] == (
        "the request line is over 8192 bytes; send a shorter URL (a request's data goes in its "
        "body)"
        if status == 414
        else "the request headers are over 16384 bytes"
    )


def test_a_head_just_within_the_bounds_is_served(server):
    path = "/healthz?" + "a" * 8000
    status, body, _ = call(server, "GET", path, headers={"X-A": "b" * 7000})
    assert status == 200 and body["status"] == "ready"


def test_echoed_paths_and_methods_are_cut_and_escaped(server):
    status, body, _ = call(server, "GET", "/%1b[2J" + "a" * 5000)
    message = body["error"]["message"]
    assert status == 404 and "\x1b" not in message and "\\x1b[2J" in message
    assert " characters]..." in message and len(message) < 400
    status, body, _ = call(server, "M" * 5000, "/healthz")
    assert status == 405 and "[5000 characters]" in body["error"]["message"]


def _raw(server, data: bytes) -> tuple[str, str]:
    with socket.create_connection(server.address, timeout=10) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.decode().partition("\r\n\r\n")
    return head, body


def test_malformed_requests_answer_json_not_html(server):
    head, body = _raw(server, b"GARBAGE\r\n\r\n")
    assert " 400 " in head.splitlines()[0] and "application/json" in head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    head, body = _raw(
        server,
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + b"X: y\r\n" * 99 + b"\r\n",
    )
    assert " 431 " in head.splitlines()[0] and "application/json" in head
    assert "more than 100 request headers" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/completions",
            b'{"model": "tiny-llama", "prompt": [1], "seed": 1' + b"9" * 5000 + b"}",
            None,
        ),
        (
            "/v1/completions",
            b'{"model": "tiny-llama", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
            None,
        ),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": [1], "user": 3}', "user"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": [1], "seed": "7"}', "seed"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": [1], "seed": 1.5}', "seed"),
        (
            "/v1/completions",
            b'{"model": "tiny-llama", "prompt": [1], "max_tokens": 1e400}',
            "max_tokens",
        ),
        (
            "/v1/completions",
            b'{"model": "tiny-llama", "prompt": [1], "temperature": 1e400}',
            "temperature",
        ),
        (
            "/v1/completions",
            b'{"model": "tiny-llama", "prompt": [1], "stream": true, '
            b'"stream_options": {"include_usage": "false"}}',
            "stream_options.include_usage",
        ),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": [1], "stream": "true"}', "stream"),
        ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": "hi"}', "messages"),
        (
            "/v1/chat/completions",
            b'{"model": "tiny-llama", "messages": [{"role": "x"}]}',
            "messages[0].role",
        ),
        ("/generate", b'{"prompt": [1' + b"0" * 5000 + b"]}", None),
        ("/generate", b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}", None),
    ],
)
def test_huge_numbers_deep_nesting_and_wrong_types_are_400_never_500(server, path, body, param):
    """(The ids of these cases are the bodies: long.)"""
    status, reply, _ = call(server, "POST", path, raw=body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert reply["error"]["type"] == "invalid_request_error"


def test_a_body_that_stops_half_way_gets_408_after_the_idle_timeout(plans):
    s = Server(plans / "plan.yaml", spec=SPEC, progress=False, idle_timeout=0.5).start()
    try:
        assert s.wait_ready(30)
        with socket.create_connection(s.address, timeout=10) as sock:
            sock.sendall(
                b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt"'
            )
            reply = b""
            while chunk := sock.recv(65536):  # the server closes: the body was not read
                reply += chunk
        head, _, body = reply.decode().partition("\r\n\r\n")
        assert " 408 " in head.splitlines()[0], reply
        assert "did not arrive within 0.5 s (9 of 100 bytes received)" in body
    finally:
        s.stop()


# -- timeouts and the reload lock -----------------------------------------------------------------


def test_an_idle_connection_is_closed_after_the_idle_timeout(plans):
    s = Server(plans / "plan.yaml", spec=SPEC, progress=False, idle_timeout=0.3).start()
    try:
        assert s.wait_ready(30)
        with socket.create_connection(s.address, timeout=10) as sock:
            t0 = time.monotonic()
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # a request that never finishes
            assert sock.recv(1024) == b""  # the server hung up
            assert time.monotonic() - t0 < 5
    finally:
        s.stop()


def test_a_slow_template_cannot_wedge_the_reload_lock(server, plans, monkeypatch):
    monkeypatch.setattr(T, "MAX_RENDER_SECONDS", 0.3)
    slow = plans / "slow.yaml.j2"
    slow.write_text(
        plan_text() + "{% for i in range(9999) %}{% for j in range(9999) %}"
        "{% endfor %}{% endfor %}\n"
    )
    fp = server.engine.table.fingerprint
    t0 = time.monotonic()
    status, body, _ = call(server, "POST", "/admin/reload", {"path": "slow.yaml.j2"}, ADMIN)
    assert status == 422 and "took more than 0.3 s" in body["error"]["message"], body
    assert time.monotonic() - t0 < 10 and server.engine.table.fingerprint == fp
    status, body, _ = call(server, "POST", "/admin/reload", {"path": "other.yaml"}, ADMIN)
    assert status == 200, body  # not 409: the lock was released
    assert call(server, "POST", "/admin/reload", {"path": "plan.yaml"}, ADMIN)[0] == 200
    assert not server.engine.reload_lock.locked()


def test_a_template_cannot_run_code_through_a_reload(server, plans, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = plans / "evil.yaml.j2"
    evil.write_text(
        "version: 1\nname: t{{ cycler.__init__.__globals__.os.system('touch PWNED') }}\n"
    )
    status, body, _ = call(server, "POST", "/admin/reload", {"path": "evil.yaml.j2"}, ADMIN)
    assert status == 422 and not (tmp_path / "PWNED").exists(), body


# -- an interrupted capture -----------------------------------------------------------------------


def test_an_interrupt_during_capture_releases_everything_and_the_runner_stays_usable():
    import torch

    from graphplan.compiler import compile_plan
    from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig, make_batch, static_inputs
    from graphplan.runtime import GraphRunner

    cfg = TinyLlamaConfig(
        vocab_size=128,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=96,
        max_model_len=32,
        num_cache_rows=8,
    )
    model = TinyLlama(cfg, seed=0)

    class InterruptedAt:
        def __init__(self, calls):
            self.left = calls

        def __call__(self, **kw):
            self.left -= 1
            if self.left == 0:
                raise KeyboardInterrupt
            return model(**kw)

    plan = {
        "version": 1,
        "name": "t",
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
        "cudagraph": {"mode": "FULL", "attention_support": "ALWAYS", "capture_sizes": [1, 2, 4, 8]},
    }
    runner = GraphRunner(
        InterruptedAt(3), compile_plan(plan), static_inputs(model), progress=False, device="cpu"
    )
    with pytest.raises(KeyboardInterrupt):
        runner.capture()
    assert runner.captured_graph_ids() == [] and not runner.captured
    batch = make_batch(model, [(0, 3, [5]), (1, 3, [6])])
    out = runner.step(batch, num_reqs=2, max_query_len=1)  # eager, still works
    assert out.shape == (2, cfg.vocab_size) and torch.isfinite(out).all()
    runner.model = model
    runner.capture()  # and it can capture again
    assert len(runner.captured_graph_ids()) == 4


def test_fuzzed_plans_through_reload_answer_200_or_422_and_the_server_keeps_serving(
    server, plans, tmp_path, monkeypatch
):
    import random

    from test_fuzz import _hostile, mutate_text
    from test_server import _reference

    monkeypatch.setattr(T, "MAX_RENDER_SECONDS", 0.2)
    monkeypatch.chdir(tmp_path)
    base = plan_text()
    seen = {200: 0, 422: 0}
    for seed in range(30):
        rnd = random.Random(f"reload:{seed}")
        name = f"fuzz{seed}.yaml" + (".j2" if seed % 3 == 0 else "")
        data = (
            _hostile(base, name.endswith(".j2"), rnd).encode()
            if seed % 2
            else mutate_text(base, rnd)
        )
        (plans / name).write_bytes(data)
        status, body, _ = call(server, "POST", "/admin/reload", {"path": name}, ADMIN)
        assert status in (200, 422) and body["error" if status != 200 else "plan"], (seed, body)
        seen[status] += 1
        assert not (tmp_path / "PWNED").exists()
        (plans / name).unlink()
    assert seen[422] > 0, seen
    assert call(server, "POST", "/admin/reload", {"path": "plan.yaml"}, ADMIN)[0] == 200
    status, body, _ = call(server, "POST", "/generate", {"prompt": [3, 1, 4], "max_tokens": 5})
    assert status == 200 and body["tokens"] == _reference((3, 1, 4), 5)
    assert server.engine.metrics.value("graphplan_server_step_errors_total") == 0


def test_tampered_tables_through_reload_answer_422_and_the_server_keeps_serving_right_tokens(
    server, plans
):
    """Resealed tables with random edits (routes re-aimed, settings, graphs, the embedded plan)
    through /admin/reload: each is refused (422) or, if it still means what its plan compiles
    to, accepted; the server then serves the tokens offline greedy decoding gives."""
    import copy
    import random

    from test_server import _reference
    from test_table_trust import mutate, resealed

    from graphplan.compiler import compile_plan

    base = json.loads(compile_plan(plans / "plan.yaml").dumps())
    rnd = random.Random("reload-tables")
    seen = {200: 0, 422: 0}
    for i in range(25):
        data = copy.deepcopy(base)
        mutate(data, rnd)
        try:
            data = resealed(data)
        except (TypeError, KeyError, AttributeError, ValueError):
            pass
        name = f"tampered{i}.json"
        (plans / name).write_text(json.dumps(data))
        status, body, _ = call(server, "POST", "/admin/reload", {"path": name}, ADMIN)
        assert status in (200, 422), (i, body)
        seen[status] += 1
        (plans / name).unlink()
        status, body, _ = call(server, "POST", "/generate", {"prompt": [3, 1, 4], "max_tokens": 5})
        assert status == 200 and body["tokens"] == _reference((3, 1, 4), 5), i
    assert seen[422] >= 15, seen
    assert call(server, "POST", "/admin/reload", {"path": "plan.yaml"}, ADMIN)[0] == 200
    assert server.engine.metrics.value("graphplan_server_step_errors_total") == 0


@pytest.mark.parametrize(
    "prompt, where, shown",
    [
        ([1, 10**30], "prompt[1]", "1000000000000000000000000000000"),
        ([[1], [2, 3, -(10**30)]], "prompt[1][2]", "-1000000000000000000000000000000"),
        ([5, 10**1000], "prompt[1]", "of 3322 bits"),
        ([128], "prompt[0]", "128"),
    ],
)
def test_a_token_id_outside_the_vocabulary_is_named_with_the_vocabulary(
    server, prompt, where, shown
):
    status, body, _ = call(
        server, "POST", "/v1/completions", {"model": "tiny-llama", "prompt": prompt}
    )
    assert status == 400 and body["error"]["param"] == "prompt"
    assert body["error"]["message"] == (
        f"{where}: token id {shown} is outside the vocabulary 0..127 of model 'tiny-llama'"
    )


@pytest.mark.parametrize(
    "prompt, param, message",
    [
        ([1.5], "prompt[0]", "Input should be a valid integer, not 1.5"),
        ([[1, 2], [3, True]], "prompt[1][1]", "Input should be a valid integer, not True"),
    ],
)
def test_a_prompt_of_the_wrong_type_names_the_id_not_the_text_form(server, prompt, param, message):
    status, body, _ = call(
        server, "POST", "/v1/completions", {"model": "tiny-llama", "prompt": prompt}
    )
    assert status == 400 and body["error"]["param"] == param
    assert body["error"]["message"] == f"'{param}': {message}"
