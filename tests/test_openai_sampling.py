"""The OpenAI API end to end with the official ``openai`` client, on loopback, over a small Qwen3
checkpoint saved with ``save_pretrained`` and a word-level tokenizer built with ``tokenizers`` (no
network) with a chat template: chat, sampling reproduced exactly from a seed alone and in a batch,
``n``, logprobs equal to the model's own, stop strings across token boundaries, errors as the
client's exceptions, a disconnect freeing its seat, and /metrics read back by ``plan workload``."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import openai
import pytest
import torch

from graphplan.server import Server
from graphplan.server.core.hf_model import HFSpec

from hf_models import generated, reference_logits, reference_model, write_model_dir
from served import openai_client, start_server, with_chat_template

NAME = "tiny-chat"
PLAN = (
    "version: 1\nname: chat-t\nscheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}\n"
    "cudagraph: {mode: FULL_DECODE_ONLY, attention_support: ALWAYS, capture_sizes: [1, 2, 4, 8]}\n"
)
# words of the test tokenizer: user turns start with w1, assistant turns with w2, the prompt for
# the answer is w3; a message's words are its content
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}w1 {% elif m['role'] == 'assistant' %}"
    "w2 {% else %}{{ raise_exception('only user and assistant turns') }}{% endif %}"
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return with_chat_template(write_model_dir(tmp_path_factory.mktemp("hf") / NAME), TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(tmp_path_factory, model_dir, PLAN, max_model_len=64, idle_timeout=5)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def aclient(server):
    return openai_client(server, openai.AsyncOpenAI)


@pytest.fixture(scope="module")
def ref(server):
    return reference_model(server.engine.model)


def words(ids: list[int]) -> str:
    """The text the server streams for ``ids``: ids 0 ([UNK]) and 1 (<eos>) are special tokens,
    skipped in the text as transformers' ``skip_special_tokens`` does."""
    return " ".join(f"w{t - 2}" for t in ids if t >= 2)


# -- chat ------------------------------------------------------------------------------------------
def test_chat_renders_the_models_template_and_answers_greedily(client, ref):
    res = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt = [3, 7, 8, 4, 9, 5]  # w1 w5 w6 w2 w7 w3
    want = generated(ref, prompt, 5)
    msg = res.choices[0].message
    assert res.object == "chat.completion" and res.id.startswith("chatcmpl-")
    assert msg.role == "assistant" and msg.content == words(want)
    assert res.choices[0].finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (6, 5)


def test_chat_streams_deltas_and_a_final_usage_chunk(client, ref):
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "w9 w9 w9"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    want = generated(ref, [3, 11, 11, 11, 5], 6)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == words(want).split()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_a_template_that_refuses_the_messages_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="only user and assistant turns"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "system", "content": "w1"}], max_tokens=2
        )


def test_chat_without_a_template_is_a_clear_400(tmp_path):
    from graphplan.server import ModelSpec

    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    spec = ModelSpec(layers=1, hidden=64, vocab_size=128, max_model_len=32)
    s = Server(plan, spec=spec, progress=False).start()
    try:
        assert s.wait_ready(30)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has no chat template") as e:
            c.chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "hi"}]
            )
        assert e.value.body["code"] == "no_chat_template"
    finally:
        s.stop()


# -- sampling --------------------------------------------------------------------------------------
SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, presence_penalty=0.3)


def _completion(client, prompt, seed, n=1, **kw):
    extra = {"ignore_eos": True, "top_k": kw.pop("top_k", 0), "min_p": kw.pop("min_p", 0.0)}
    return client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, seed=seed, n=n, extra_body=extra, **kw
    )


def test_a_seeded_request_gets_the_same_tokens_alone_and_in_a_busy_batch(client, aclient):
    prompt = [5, 9, 2, 77, 40]
    alone = _completion(client, prompt, seed=1234, **SAMPLED).choices[0].token_ids

    async def busy():
        others = [
            aclient.completions.create(
                model=NAME,
                prompt=[7 + i] * (3 + i),
                max_tokens=10 + i,
                temperature=0 if i % 2 else 1.3,
                seed=i,
                extra_body={"ignore_eos": True, "repetition_penalty": 1.2},
            )
            for i in range(6)
        ]
        mine = aclient.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=12,
            seed=1234,
            extra_body={"ignore_eos": True, "top_k": 40, "min_p": 0.01},
            **{k: v for k, v in SAMPLED.items() if k not in ("top_k", "min_p")},
        )
        results = await asyncio.gather(*others[:3], mine, *others[3:])
        return results[3].choices[0].token_ids

    assert asyncio.run(busy()) == alone
    again = _completion(client, prompt, seed=1234, **SAMPLED).choices[0].token_ids
    assert again == alone
    other = _completion(client, prompt, seed=1235, **SAMPLED).choices[0].token_ids
    assert other != alone  # 12 tokens at temperature 0.9 over 128 words


def test_n_choices_are_the_requests_of_seed_plus_their_index(client):
    prompt = [11, 12, 13]
    res = _completion(client, prompt, seed=50, n=3, temperature=1.0)
    assert [c.index for c in res.choices] == [0, 1, 2]
    for i, c in enumerate(res.choices):
        single = _completion(client, prompt, seed=50 + i, temperature=1.0).choices[0]
        assert c.token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in res.choices}) == 3
    assert res.usage.completion_tokens == 36 and res.usage.prompt_tokens == 3


def test_logprobs_are_the_models_own_and_greedy_picks_the_top_one(client, ref):
    prompt = [4, 8, 15, 16]
    res = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    c = res.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    truth = torch.log_softmax(reference_logits(ref, prompt + c.token_ids), dim=-1)
    for i, tok in enumerate(c.token_ids):
        row = truth[len(prompt) - 1 + i]
        assert lp.token_logprobs[i] == pytest.approx(row[tok].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) == 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        assert lp.tokens[i] == f"w{tok - 2}"
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "w1"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].token == content[0].top_logprobs[0].token


def test_stop_strings_end_the_text_across_token_boundaries_and_are_never_sent(client, ref):
    prompt = [20, 21, 22]
    full = generated(ref, prompt, 10)
    text = words(full)
    # a stop string that starts inside the 3rd word and ends inside the 4th
    third = text.split()[2]
    stop = third[1:] + " " + text.split()[3][:2]
    cut = text.index(stop)
    res = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        stop=[stop, "zzz"],
        extra_body={"ignore_eos": True},
    )
    c = res.choices[0]
    assert c.text == text[:cut] and c.finish_reason == "stop"
    assert c.token_ids == full[:4]  # the token that completed the match is the last one counted
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == text[:cut] and chunks[-1].choices[0].finish_reason == "stop"


def test_echo_puts_the_prompt_text_first(client):
    res = client.completions.create(
        model=NAME,
        prompt="w1 w2",
        max_tokens=2,
        temperature=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert res.choices[0].text.startswith("w1 w2")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"stop": [""]}, "BadRequestError", "'stop' strings must have 1..256 characters"),
        (
            {"n": 200, "prompt": [[1], [2]]},
            "BadRequestError",
            "'n' must be at least 1 and at most 128",
        ),
        ({"max_tokens": 0}, "BadRequestError", "'max_tokens' 0 generates nothing"),
        (
            {"extra_body": {"stop_token_ids": [500]}},
            "BadRequestError",
            "500 is outside the vocabulary",
        ),
        ({"extra_body": {"ignore_eos": "false"}}, "BadRequestError", "'ignore_eos'"),
        ({"model": "nope"}, "NotFoundError", "'nope' does not exist"),
        ({"extra_body": {"top_k": 1.5}}, "BadRequestError", "'top_k'"),
    ],
)
def test_bad_sampling_requests_are_the_clients_exceptions(client, kwargs, error, match):
    args = {"model": NAME, "prompt": [1, 2], "max_tokens": 2, **kwargs}
    with pytest.raises(getattr(openai, error), match=match):
        client.completions.create(**args)


def test_a_chat_without_messages_or_with_a_bad_role_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[])
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role"):
        client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}])


# -- lifecycle -------------------------------------------------------------------------------------
def _wait_idle(server, timeout=10.0) -> float:
    t0 = time.monotonic()
    e = server.engine
    while e.num_running() or e.queue_depth() or e.batcher.has_work() or e.kv_blocks_used():
        assert time.monotonic() - t0 < timeout, (e.num_running(), e.kv_blocks_used())
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_seat_and_blocks(server, stream):
    _wait_idle(server)
    cancelled = server.engine.metrics.value("graphplan_server_requests_total", code="499")
    body = json.dumps(
        {
            "model": NAME,
            "prompt": [3] * 8,
            "max_tokens": 50,
            "stream": stream,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(server.address, timeout=10) as sock:
        sock.sendall(head + body)
        t0 = time.monotonic()
        while server.engine.num_running() == 0:
            assert time.monotonic() - t0 < 10
            time.sleep(0.005)
        if stream:  # tokens are flowing (the headers may come alone, before them)
            got = b""
            while b"data: " not in got:
                got += sock.recv(4096)
    _wait_idle(server, 10)
    after = server.engine.metrics.value("graphplan_server_requests_total", code="499")
    assert after == cancelled + 1  # aborted, not finished: 50 tokens take longer


# -- metrics ---------------------------------------------------------------------------------------
def test_metrics_have_latency_histograms_kv_gauges_and_per_route_counts(server, client):
    client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    text = client.with_options(max_retries=0)._client.get(server.url + "/metrics").text
    for series in (
        "graphplan_server_time_to_first_token_seconds_bucket",
        "graphplan_server_inter_token_latency_seconds_bucket",
        "graphplan_server_request_seconds_bucket",
        "graphplan_server_queue_seconds_bucket",
        "graphplan_server_kv_blocks_used ",
        "graphplan_server_kv_blocks_free ",
        "graphplan_server_running_requests ",
        "graphplan_server_queue_depth ",
        "graphplan_server_preemptions_total ",
        'graphplan_server_http_responses_total{code="200",endpoint="/v1/completions"}',
        'graphplan:iteration_tokens_bucket{le="1.0",routine="decode"}',
        'graphplan:iteration_requests_bucket{le="8.0",routine="decode"}',
    ):
        assert series in text, series


def test_plan_workload_reads_the_live_servers_metrics(server, client, tmp_path, capsys):
    from graphplan.compiler.cli import main
    from graphplan.compiler.tools import prom_text
    from graphplan.compiler.tools.metrics import Options, workload_from_scrapes

    for i in range(3):
        client.completions.create(
            model=NAME,
            prompt=[2] * (5 + i),
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    m = server.engine.metrics
    text = client._client.get(server.url + "/metrics").text
    w = workload_from_scrapes([prom_text.parse(text.encode(), "live")], Options(max_num_seqs=8))
    decode = m.value("graphplan:iteration_tokens_count", routine="decode")
    mixed = m.value("graphplan:iteration_tokens_count", routine="mixed")
    assert w.steps == decode + mixed > 0
    assert sum(r[3] for r in w.rows if r[1] == r[0]) >= decode  # decode rows: n requests of 1
    out = tmp_path / "w.jsonl"
    assert main(["workload", "--from-metrics", server.url + "/metrics", "-o", str(out)]) == 0
    header = json.loads(out.read_text().splitlines()[0])["graphplan_workload"]
    assert header["engine"] == "graphplan" and header["steps"] >= w.steps
    capsys.readouterr()


def test_seeded_requests_keep_their_tokens_across_preemptions(model_dir, tmp_path):
    """A KV pool too small for four requests at once: some are preempted and recomputed, and each
    still gets the tokens it gets alone (its sampler slot is rebuilt from what it generated)."""
    from graphplan.server import Engine, load_table
    from graphplan.server.requests import QueueSink, Request
    from graphplan.server.sampling_params import SamplingParams

    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    spec = HFSpec(model=str(model_dir), max_model_len=64, kv_cache_tokens=96, block_size=16)
    engine = Engine(load_table(str(plan)), str(plan), spec=spec, progress=False)
    engine.start()
    try:
        assert engine.wait_ready(60), engine.error

        def run(prompts):
            sink = QueueSink()
            reqs = [
                Request(
                    p,
                    40,
                    sink,
                    SamplingParams(temperature=1.0, seed=i, presence_penalty=0.5),
                    tag=i,
                )
                for i, p in prompts
            ]
            engine.enqueue(reqs)
            left = len(reqs)
            while left:
                _, kind, value = sink.get(60)
                assert kind != "error", value
                left -= kind == "done"
            return {r.tag: r.out for r in reqs}

        prompts = [(i, [10 + i] * 12) for i in range(4)]
        alone = {i: run([(i, p)])[i] for i, p in prompts}
        before = engine.metrics.value("graphplan_server_preemptions_total")
        together = run(prompts)
        assert engine.metrics.value("graphplan_server_preemptions_total") > before
        assert together == alone
    finally:
        engine.stop(5)
