"""Prefix caching in the served engine (issue 38): greedy tokens identical with the cache on and
off, synchronously and with async scheduling, through arrivals, cancellations and the preemptions
a small KV pool forces, the block accounting checked before every step; the official ``openai``
client against the server (one process and the engine process) gets the same greedy answers and
``usage.prompt_tokens_details.cached_tokens`` exact for a second request sharing a prompt's start;
/metrics counts the queries and hits."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_async_scheduling import _engine as started
from test_async_scheduling import prompt, run
from test_openai_sampling import NAME, PLAN, TEMPLATE
from test_server import plan_text

from graphplan.server import Engine
from graphplan.server.core.hf_model import HFSpec
from graphplan.server.requests import GREEDY

from hf_models import write_model_dir
from served import openai_client, start_server, with_chat_template


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("hf") / "m")


def _engine(hf_dir, async_scheduling: bool, cache: bool, spec=None, device="cpu") -> Engine:
    spec = spec or HFSpec(model=str(hf_dir), max_model_len=64, kv_cache_tokens=96, block_size=4)
    plan = plan_text(mode="FULL_DECODE_ONLY", sizes=(1, 2, 4), seqs=4)
    e = started(spec, plan, async_scheduling, device, enable_prefix_caching=cache)
    make_batch, pool = e.model.make_batch, e.model.kv_pool

    def checked(reqs, **kw):  # the accounting holds before every step's blocks are taken
        pool.check_accounting()
        return make_batch(reqs, **kw)

    e.model.make_batch = checked
    return e


@pytest.fixture(scope="module")
def engines(hf_dir):
    four = {(a, c): _engine(hf_dir, a, c) for a in (False, True) for c in (False, True)}
    yield four
    for e in four.values():
        e.stop(5)


SYSTEM = [prompt(100 + k, 30) for k in range(2)]
_lock = threading.Lock()


@st.composite
def workloads(draw):
    """Waves of requests: a shared prefix (one of two, cut anywhere) or none, then their own
    tokens; a later wave starts once the first request of the one before has 2 tokens."""
    reqs = []
    for _ in range(draw(st.integers(1, 8))):
        k, n = draw(st.integers(0, 2)), draw(st.integers(0, 30))
        own = prompt(draw(st.integers(0, 40)), draw(st.integers(0 if k < 2 else 1, 6)))
        head = SYSTEM[k][:n] if k < 2 else []
        reqs.append(((head + own) or [3], draw(st.integers(1, 12)), (), GREEDY))
    cuts = (
        sorted(set(draw(st.lists(st.integers(1, len(reqs) - 1), max_size=2))))
        if len(reqs) > 1
        else []
    )
    waves, last = [], 0
    for c in [*cuts, len(reqs)]:
        waves.append(reqs[last:c])
        last = c
    return waves


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(waves=workloads(), cancel=st.none() | st.tuples(st.integers(0, 7), st.integers(1, 3)))
def test_greedy_tokens_are_the_same_with_and_without_the_cache(engines, waves, cancel):
    n = sum(map(len, waves))
    cancel_after = {cancel[0]: cancel[1]} if cancel and cancel[0] < n else {}
    with _lock:
        got = {k: run(e, waves, cancel_after) for k, e in engines.items()}
    want = got[False, False]
    for k, res in got.items():
        for tag, (toks, end) in res.items():
            if tag in cancel_after:  # its tokens until the cancellation took effect, either way
                m = min(len(toks), len(want[tag][0]))
                assert toks[:m] == want[tag][0][:m], k
            else:
                assert (toks, end) == want[tag], (k, tag)


def test_a_second_wave_sharing_a_prefix_hits_and_preemption_keeps_working(engines):
    """Two requests with a 30-token shared start, then four more in a 24-block pool of 4 tokens:
    the later ones find 28 of the shared tokens cached (7 whole blocks before their own), the
    pool preempts, and the tokens equal the cache-off engine's."""
    waves = [
        [(SYSTEM[0] + prompt(1, 2), 10, (), GREEDY)],
        [(SYSTEM[0] + prompt(i, 3), 20, (), GREEDY) for i in range(2, 6)],
    ]
    with _lock:
        on, off = engines[True, True], engines[True, False]
        hits, queries = (
            on.metrics.value(f"graphplan_prefix_cache_{s}_total") for s in ("hits", "queries")
        )
        pre = on.metrics.value("graphplan_server_preemptions_total")
        assert run(on, waves) == run(off, waves)
        assert on.metrics.value("graphplan_prefix_cache_hits_total") - hits >= 4 * 28
        assert on.metrics.value("graphplan_prefix_cache_queries_total") - queries >= 32 + 4 * 33
        assert on.metrics.value("graphplan_server_preemptions_total") > pre
        assert off.metrics.value("graphplan_prefix_cache_queries_total") == 0


# -- the OpenAI API ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return with_chat_template(write_model_dir(tmp_path_factory.mktemp("hf") / NAME), TEMPLATE)


@pytest.fixture(scope="module")
def servers(chat_dir, tmp_path_factory):
    """Cache on in one process, on behind the engine process (the wire), and off."""
    kw = dict(max_model_len=128, idle_timeout=5)
    out = {
        "one": start_server(tmp_path_factory, chat_dir, PLAN, **kw),
        "procs": start_server(tmp_path_factory, chat_dir, PLAN, processes=True, **kw),
        "off": start_server(tmp_path_factory, chat_dir, PLAN, enable_prefix_caching=False, **kw),
    }
    yield out
    for s in out.values():
        s.stop()


SHARED = " ".join(f"w{10 + i % 50}" for i in range(40))  # 40 words: 40 tokens


def _chat(client, question: str, **kw):
    return client.chat.completions.create(
        model=NAME,
        messages=[
            {"role": "user", "content": SHARED},
            {"role": "assistant", "content": "w7"},
            {"role": "user", "content": question},
        ],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


@pytest.mark.parametrize("mode", ["one", "procs"])
def test_cached_tokens_are_exact_in_the_usage_and_answers_equal_the_cache_off(servers, mode):
    """The shared start renders as w1 + 40 words + w2 w7 w1 (44 tokens): a second request finds
    its first two 16-token blocks cached, 32 tokens; the first found none."""
    client, off = openai_client(servers[mode]), openai_client(servers["off"])
    q = {"one": ("w3 w4", "w5 w6 w8"), "procs": ("w9 w4", "w5 w61")}[mode]
    first, second = _chat(client, q[0]), _chat(client, q[1])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert second.usage.prompt_tokens == 44 + len(q[1].split()) + 1
    for question, res in zip(q, (first, second)):
        plain = _chat(off, question)
        assert res.choices[0].message.content == plain.choices[0].message.content
        assert plain.usage.prompt_tokens_details.cached_tokens == 0
    # streamed usage, and completions: the same count
    chunks = list(_chat(client, "w70", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    done = client.completions.create(
        model=NAME, prompt="w1 " + SHARED + " w2", max_tokens=2, temperature=0
    )
    assert done.usage.prompt_tokens_details.cached_tokens == 32
    text = servers[mode].url
    assert text  # the metrics: queries and hits counted, in tokens
    import httpx

    metrics = httpx.get(text + "/metrics").text
    hits = [ln for ln in metrics.splitlines() if ln.startswith("graphplan_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 3 * 32


# -- the plan side ----------------------------------------------------------------------------------
def _scrape(server) -> str:
    import httpx

    return httpx.get(server.url + "/metrics").text


def _step_tokens(text: str) -> float:
    """Tokens run by every engine step so far (graphplan:iteration_tokens, both routines)."""
    sums = [ln for ln in text.splitlines() if ln.startswith("graphplan:iteration_tokens_sum")]
    assert len(sums) == 2, sums
    return sum(float(ln.split()[-1]) for ln in sums)


def test_plan_workload_and_optimize_read_a_cached_servers_shorter_prefill_steps(
    servers, tmp_path, capsys
):
    """Six requests one after the other sharing a 44-token start: with the cache the steps run
    exactly 5 x 32 tokens fewer (the prefill chunks are shorter, the decodes the same) than
    without it; ``plan workload`` and ``plan optimize`` read the cached server's scrape."""
    from graphplan.compiler.cli import main

    shared = " ".join(f"w{70 + i % 40}" for i in range(40))
    ran = {}
    for mode in ("one", "off"):
        client, before = openai_client(servers[mode]), _step_tokens(_scrape(servers[mode]))
        for i in range(6):
            client.completions.create(
                model=NAME, prompt=f"w1 {shared} w2 w{i + 3}", max_tokens=3, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        ran[mode] = _step_tokens(_scrape(servers[mode])) - before
    assert ran["off"] - ran["one"] == 5 * 32
    scrape, work = tmp_path / "cached.prom", tmp_path / "w.jsonl"
    scrape.write_text(_scrape(servers["one"]))
    plan = servers["one"].source
    assert main(["workload", "--from-metrics", str(scrape), "--plan", plan, "-o", str(work)]) == 0
    assert work.read_text().strip()
    capsys.readouterr()
    assert main(["optimize", plan, "--trace", str(work), "--format", "json"]) == 0
    assert '"after"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, on",
    [([], True), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)],
)
def test_serve_turns_prefix_caching_on_by_default_and_off_by_flag(flags, on, monkeypatch):
    """What graphplan-serve hands the Server (and so the engine)."""
    import graphplan.server.cli as cli

    seen: dict = {}

    def server(*a, **kw):  # records the arguments, starts nothing
        seen.update(kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "Server", server)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--plan", "plans/tiny-llama.yaml", "--device", "cpu", *flags])
    assert seen["enable_prefix_caching"] is on
