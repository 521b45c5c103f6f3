"""The server's OpenAI-compatible API, driven by the official ``openai`` client on loopback: a small
random Qwen3 checkpoint directory (config.json + a word-level tokenizer, no network) served through
graphplan's runtime with ``--model``; completions equal transformers' own greedy generate; streams
end in ``data: [DONE]``; errors are OpenAI-shaped 4xx."""

import http.client
import json
from pathlib import Path

import openai
import pytest

from graphplan.server import Server

from hf_models import generated, reference_model, write_model_dir
from served import openai_client, start_server

ROOT = Path(__file__).resolve().parents[1]

NAME = "tiny-qwen3"
PLAN = (
    "version: 1\nname: hf-t\nscheduler: {max_num_seqs: 4, max_num_batched_tokens: 32}\n"
    "cudagraph: {mode: FULL_DECODE_ONLY, attention_support: ALWAYS, capture_sizes: [1, 2, 4]}\n"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("hf") / NAME)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(tmp_path_factory, model_dir, PLAN, max_model_len=32)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def reference(server):
    """transformers' greedy generate on the served weights (the model's own attention)."""
    ref = reference_model(server.engine.model)
    return lambda prompt, n: generated(ref, prompt, n)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


def test_completions_from_token_ids_equal_transformers_greedy_generate(client, reference):
    prompts = [[5, 9, 2, 77], [100], [3] * 11]
    res = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0)
    assert res.object == "text_completion" and res.model == NAME and res.id.startswith("cmpl-")
    assert [c.index for c in res.choices] == [0, 1, 2]
    for c, p in zip(res.choices, prompts):
        assert c.token_ids == reference(p, 6) and c.prompt_token_ids == p
        assert c.finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == (
        16,
        18,
        34,
    )
    one = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=6, temperature=0)
    assert one.choices[0].token_ids == reference(prompts[0], 6)


def test_a_text_prompt_is_tokenized_and_the_text_decoded(client, reference, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    res = client.completions.create(model=NAME, prompt="w1 w7 w30", max_tokens=5, temperature=0)
    ids = tok.encode("w1 w7 w30")
    c = res.choices[0]
    assert c.prompt_token_ids == ids and c.token_ids == reference(ids, 5)
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_streaming_sends_a_token_per_event_and_usage_last(client, reference):
    prompt = [4, 8, 15, 16, 23, 42]
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=7,
            stream=True,
            temperature=0,
            stream_options={"include_usage": True},
        )
    )
    ids = [t for ch in chunks for c in ch.choices for t in c.token_ids]
    assert ids == reference(prompt, 7)
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    text = "".join(c.text for ch in chunks for c in ch.choices)
    assert text.split() == [f"w{t - 2}" for t in ids if t >= 2]


def test_the_raw_stream_is_server_sent_events_ending_in_done(server):
    status, body, ctype = raw(
        server,
        "POST",
        "/v1/completions",
        {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "ignore_eos": True},
    )
    events = [e for e in body.split("\n\n") if e]
    assert status == 200 and ctype.startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert len(events) == 3 + 1 + 1  # a token each, the finish, [DONE]


def test_stop_token_ids_end_a_completion_with_finish_reason_stop(client, reference):
    prompt = [7, 7, 7]
    full = reference(prompt, 8)
    stop = full[3]
    res = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [stop]},
    )
    c = res.choices[0]
    assert c.token_ids == full[: full.index(stop) + 1] and c.finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"temperature": 2.5}, "BadRequestError", "'temperature' must be at least 0 and at most 2"),
        ({"model": "gpt-4"}, "NotFoundError", "'gpt-4' does not exist"),
        ({"n": 0}, "BadRequestError", "'n' must be at least 1"),
        ({"max_tokens": 40}, "BadRequestError", "the model's context is 32 tokens"),
        ({"prompt": [1, 500]}, "BadRequestError", r"prompt\[1\]: token id 500 is outside"),
        ({"prompt": []}, "BadRequestError", "'prompt' must be a string or a list of token ids"),
        ({"logprobs": 21}, "BadRequestError", "'logprobs' must be at least 0 and at most 20"),
        ({"extra_body": {"seed": "1"}}, "BadRequestError", "'seed': Input should be"),
        ({"user": 5}, "BadRequestError", "'user': Input should be a valid string"),
    ],
)
def test_bad_requests_are_openai_shaped_4xx_errors(client, kwargs, error, match):
    args = {"model": NAME, "prompt": [1, 2], "max_tokens": 2, **kwargs}
    if "extra_body" in kwargs:
        args.pop("seed", None)
    with pytest.raises(getattr(openai, error), match=match) as e:
        client.completions.create(**args)
    assert 400 <= e.value.status_code < 500


def test_error_bodies_have_openais_shape_and_the_server_keeps_serving(server, client):
    status, body, _ = raw(
        server, "POST", "/v1/completions", {"model": NAME, "prompt": [1], "max_token": 3}
    )
    err = json.loads(body)["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == "max_token"
    assert "did you mean 'max_tokens'" in err["message"]
    status, body, _ = raw(server, "POST", "/v1/completions", raw_body=b"{nope")
    assert status == 400 and "malformed JSON" in json.loads(body)["error"]["message"]
    status, body, _ = raw(server, "GET", "/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["message"].startswith("no such endpoint")
    assert client.completions.create(model=NAME, prompt=[1], max_tokens=1).choices[0].token_ids


def test_the_tiny_llama_server_answers_v1_with_ids_only(tmp_path):
    from graphplan.server import ModelSpec

    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    s = Server(
        plan, spec=ModelSpec(layers=1, hidden=64, vocab_size=128, max_model_len=32), progress=False
    ).start()
    try:
        assert s.wait_ready(30)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny-llama"]
        res = c.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=4, seed=1)
        assert len(res.choices[0].token_ids) == 4 and res.choices[0].text == ""
        with pytest.raises(openai.BadRequestError, match="no tokenizer: send token ids"):
            c.completions.create(model="tiny-llama", prompt="hello", max_tokens=4)
    finally:
        s.stop()


def test_cli_refuses_an_unsupported_checkpoint_before_capturing(tmp_path, capsys):
    from transformers import GPT2Config

    from graphplan.server.cli import main

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    assert (
        main(["--model", str(tmp_path), "--plan", str(plan), "--port", "0", "--device", "cpu"]) == 1
    )
    err = capsys.readouterr().err
    assert "model type 'gpt2'" in err and "Traceback" not in err
    assert main(["--model", str(tmp_path / "nowhere"), "--plan", str(plan), "--port", "0"]) == 1
    assert "nowhere: no such directory" in capsys.readouterr().err


def raw(server, method, path, body=None, raw_body: bytes | None = None):
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=60)
    data = raw_body if raw_body is not None else (json.dumps(body).encode() if body else None)
    try:
        conn.request(
            method, path, body=data, headers={"Content-Type": "application/json"} if data else {}
        )
        resp = conn.getresponse()
        return resp.status, resp.read().decode(), resp.getheader("Content-Type", "")
    finally:
        conn.close()
