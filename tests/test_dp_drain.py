"""Data-parallel engines drain together (server/core/dp_serving.py, "Leaving"): the race where a
request reaches engine 1 after engine 0 has already stopped for a drain, made deterministic by
running both engine cores (server/wire/engine_proc.py's ``EngineCore``, their inboxes, their Gloo
DP group, their waves) in this process and sending the drain to engine 0 alone. Engine 0 may not
leave while a peer can still start a wave: the request is served with engine 0's dummy steps (the
ids of one engine without DP), and both engines leave once both drained. Before the fix engine 0
left at once and the request failed after ``parallel.sync_timeout_s`` with a 500."""

from __future__ import annotations

import threading
import time

import zmq
from test_engine_process import PROMPTS
from test_engine_process import plan as plan
from test_server import SPEC

from graphplan.server.core.dp_serving import DPWave, store
from graphplan.server.core.engine import Engine
from graphplan.server.core.model import load_table, parse_sets
from graphplan.server.errors import not_serving
from graphplan.server.requests import greedy_requests
from graphplan.server.wire import messages as m
from graphplan.server.wire.engine_proc import EngineConfig, EngineCore
from graphplan.server.wire.procs import Addresses


def _generate(engine: Engine, prompt: list[int], n: int, timeout: float) -> tuple[list[int], str]:
    """One greedy request on ``engine``: (its tokens, "length"/"stop" or the error's status)."""
    sink, reqs = greedy_requests([prompt], n)
    engine.enqueue(reqs)
    out: list[int] = []
    end = time.monotonic() + timeout
    while True:
        _tag, kind, value = sink.get(timeout=max(0.0, end - time.monotonic()))
        if kind == "token":
            out.append(value.token)
        elif kind == "done":
            return out, value
        elif kind == "error":
            return out, f"error {value.status}: {value.message}"


def _until(what, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_request_reaching_an_engine_after_its_peer_stopped_is_served_before_both_leave(plan):
    one = Engine(load_table(str(plan)), str(plan), spec=SPEC, device="cpu", progress=False)
    one.start()
    assert one.wait_ready(120), one.error
    want = _generate(one, PROMPTS[0], 9, 60)
    one.stop(5)
    assert want[1] == "length" and len(want[0]) == 9

    sets = parse_sets(["parallel.data_parallel_size=2", "parallel.sync_timeout_s=20"])
    table = load_table(str(plan), sets)
    group, addresses = store(2), Addresses.new(0, 2)
    peers = tuple(addresses.engine_at(d) for d in range(2))
    cores, waves = [], []
    for d in range(2):
        engine = Engine(table, str(plan), sets, spec=SPEC, device="cpu", progress=False)
        waves.append(DPWave(table, d, group.port, list(peers)))
        waves[-1].attach(engine)
        config = EngineConfig(
            source=str(plan), overrides=sets, engine_kwargs={}, address=peers[d], frontends=[],
            dp_rank=d, dp_port=group.port, peers=peers,
        )  # fmt: skip
        cores.append(EngineCore(engine, config))
    codes: list[int] = []
    threads = [threading.Thread(target=lambda c=c: codes.append(c.run())) for c in cores]
    for t in threads:
        t.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        for c in cores:
            assert c.engine.wait_ready(120), c.engine.error
        push.connect(peers[0])
        push.send(m.encoder.encode(m.Drain(300)))  # engine 1 has not heard of the drain yet
        _until(lambda: waves[0].announced == 0 or cores[0].done.is_set())  # at its leaving point
        assert _generate(cores[1].engine, PROMPTS[0], 9, 60) == want  # served, not stranded
        assert not cores[0].done.is_set() and cores[0].engine.state == "draining"
        push.disconnect(peers[0])
        push.connect(peers[1])
        push.send(m.encoder.encode(m.Drain(300)))
        for t in threads:
            t.join(30)
        assert codes == [0, 0] and [c.engine.state for c in cores] == ["stopped"] * 2
        counts = [w.runner.counts for w in waves]
        assert counts[0]["steps"] == counts[1]["steps"]  # every step together, to the end
        work = counts[1]["steps"] - counts[1]["dummy_steps"] - counts[1]["idle_steps"]
        assert counts[0]["dummy_steps"] == work >= 9  # engine 0 stepped with each of them
        assert counts[0]["idle_steps"] == counts[1]["idle_steps"] == 1  # one wave, ended together
    finally:
        push.close(linger=0)
        for c in cores:
            c.done.set()
        for t in threads:
            t.join(30)
        for c in cores:
            c.close()
        addresses.remove()


def test_a_refusal_while_draining_keeps_its_retry_after_across_the_wire():
    err = not_serving("draining")
    wire = m.encoder.encode(m.Step([m.event_out(7, "error", err)]))
    rid, kind, back = m.event_in(m.to_frontend.decode(wire).events[0])
    assert (rid, kind, back.status, back.message) == (7, "error", 503, err.message)
    assert back.headers == {"Retry-After": "5"}
    gone = m.event_in([8, m.ERROR, 503, "the engine failed", [None, None]])[2]
    assert gone.status == 503 and gone.headers == {}
