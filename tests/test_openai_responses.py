"""Every response of the OpenAI routes, read as raw JSON off the wire, is what OpenAI's schema says:
it validates against the ``openai`` package's own types (generated from the spec) and carries each
field the spec requires, null where the spec allows (openai/openai-openapi ``openapi.yaml``:
``CreateCompletionResponse``, ``CreateChatCompletionResponse``,
``CreateChatCompletionStreamResponse``, ``ChatCompletionResponseMessage``, ``CompletionUsage``,
``Model``, ``ListModelsResponse``, ``ErrorResponse``), streaming or not, with and without logprobs,
echo and usage.

Two deviations are allowed, both the legacy API's and vLLM's behaviour (server/frontend/openai_responses.py):
``finish_reason`` null in a completions stream chunk before the choice ends, and the first prompt
token's null entries in ``token_logprobs``/``top_logprobs`` with ``echo``."""

from __future__ import annotations

import http.client
import json
from fnmatch import fnmatch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject
from pydantic import ValidationError

from graphplan.server.frontend.choices import Delta
from graphplan.server.frontend.openai_answers import Job, plain_chunk
from graphplan.server.frontend.openai_responses import ChatChunkChoice, ChatDelta, CompletionChoice

from hf_models import write_model_dir
from served import start_server, with_chat_template

NAME = "tiny-shapes"
PLAN = (
    "version: 1\nname: shapes-t\nscheduler: {max_num_seqs: 4, max_num_batched_tokens: 16}\n"
    "cudagraph: {mode: FULL_DECODE_ONLY, attention_support: ALWAYS, capture_sizes: [1, 2, 4]}\n"
)
TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}w3"

# the spec's required fields (openapi.yaml), each present even when null
REQUIRED = {
    "completion": {"id", "object", "created", "model", "choices"},
    "completion choice": {"finish_reason", "index", "logprobs", "text"},
    "chat": {"id", "object", "created", "model", "choices"},
    "chat choice": {"finish_reason", "index", "message", "logprobs"},
    "chat message": {"role", "content", "refusal"},
    "chat logprobs": {"content", "refusal"},
    "token logprob": {"token", "logprob", "bytes", "top_logprobs"},
    "chunk choice": {"delta", "finish_reason", "index"},
    "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
    "model": {"id", "object", "created", "owned_by"},
    "error": {"type", "message", "param", "code"},
}
STREAM_FINISH = "choices.*.finish_reason"
ECHO_FIRST = ("choices.*.logprobs.token_logprobs.0", "choices.*.logprobs.top_logprobs.0")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = with_chat_template(write_model_dir(tmp_path_factory.mktemp("hf") / NAME), TEMPLATE)
    s = start_server(tmp_path_factory, path, PLAN, max_model_len=64)
    yield s
    s.stop()


def call(server, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def get(server, path: str) -> tuple[int, dict]:
    status, text = call(server, "GET", path)
    return status, json.loads(text)


def post(server, path: str, body: dict) -> tuple[int, list[dict]]:
    """The status and the JSON objects of the answer (each event's, for a stream)."""
    status, text = call(server, "POST", path, {"model": NAME, **body})
    if not body.get("stream") or status != 200:
        return status, [json.loads(text)]
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return status, [json.loads(e) for e in events[:-1]]


def conforms(kind, obj: dict, allowed: tuple[str, ...] = ()) -> None:
    """``obj`` validates as the openai type ``kind``, but for null values at ``allowed`` paths."""
    try:
        kind.model_validate(obj)
    except ValidationError as e:
        left = [
            err
            for err in e.errors()
            if not (
                err["input"] is None
                and any(fnmatch(".".join(map(str, err["loc"])), p) for p in allowed)
            )
        ]
        assert not left, left


def has(obj: dict, what: str) -> None:
    assert REQUIRED[what] <= obj.keys(), (what, REQUIRED[what] - obj.keys())


def completion_shape(obj: dict, stream: bool) -> None:
    has(obj, "completion")
    for c in obj["choices"]:
        has(c, "completion choice")
    if obj.get("usage") is not None:
        has(obj["usage"], "usage")


def chat_shape(obj: dict, stream: bool) -> None:
    has(obj, "chat")
    for c in obj["choices"]:
        has(c, "chunk choice" if stream else "chat choice")
        if not stream:
            has(c["message"], "chat message")
        if c.get("logprobs") is not None:
            has(c["logprobs"], "chat logprobs")
            for t in c["logprobs"]["content"]:
                has(t, "token logprob")
    if obj.get("usage") is not None:
        has(obj["usage"], "usage")


COMPLETIONS = [
    {},
    {"logprobs": 2},
    {"echo": True},
    {"echo": True, "logprobs": 3},
    {"echo": True, "logprobs": 1, "max_tokens": 0},
    {"n": 2, "seed": 1, "logprobs": 0, "prompt": [[5, 6], [7, 8, 9]]},
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra", COMPLETIONS, ids=lambda e: ",".join(e) or "plain")
def test_completions_are_openais_completion_objects(server, extra, stream):
    body = {"prompt": [4, 8, 15, 16, 23], "max_tokens": 4, "ignore_eos": True, **extra}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    status, objs = post(server, "/v1/completions", body)
    assert status == 200
    allowed = ECHO_FIRST if extra.get("echo") and "logprobs" in extra else ()
    for obj in objs:
        conforms(Completion, obj, allowed + ((STREAM_FINISH,) if stream else ()))
        completion_shape(obj, stream)
        for c in obj["choices"]:
            assert (c["logprobs"] is None) == ("logprobs" not in extra) or stream
    assert objs[-1]["usage"]["total_tokens"] > 0
    if stream:  # every chunk but the usage one has choices; only the usage one has usage
        assert all(o["choices"] and "usage" not in o for o in objs[:-1])
        assert objs[-1]["choices"] == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}], ids=["plain", "lp"])
def test_chat_completions_are_openais_chat_objects(server, extra, stream):
    body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3, **extra}
    body["ignore_eos"] = True
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    status, objs = post(server, "/v1/chat/completions", body)
    assert status == 200
    for obj in objs:
        conforms(ChatCompletionChunk if stream else ChatCompletion, obj)
        chat_shape(obj, stream)
    if stream:
        assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["finish_reason"] is None for o in objs[:-2] for c in o["choices"])
        assert objs[-2]["choices"][0]["finish_reason"] == "length"
        assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 3
    else:
        choice = objs[0]["choices"][0]
        assert choice["message"]["refusal"] is None and (
            (choice["logprobs"] is None) == (not extra)
        )


def test_models_and_errors_are_openais_objects(server):
    listed = get(server, "/v1/models")[1]
    assert set(listed) >= {"object", "data"} and listed["object"] == "list"
    for m in listed["data"] + [get(server, f"/v1/models/{NAME}")[1]]:
        conforms(Model, m)
        has(m, "model")
    for status, body in (
        post(server, "/v1/completions", {"prompt": [1], "max_token": 3}),
        post(server, "/v1/chat/completions", {"messages": []}),
        get(server, "/v1/models/nope"),
        get(server, "/v1/completions"),
    ):
        obj = body[0] if isinstance(body, list) else body
        assert status in (400, 404, 405) and set(obj) == {"error"}
        conforms(ErrorObject, obj["error"])
        has(obj["error"], "error")


def test_an_error_mid_stream_is_one_error_event_then_done(server, monkeypatch):
    real, calls = server.engine.model.make_batch, []

    def failing(reqs, **kw):  # the first step runs: the stream has begun
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return real(reqs, **kw)

    with monkeypatch.context() as m:
        m.setattr(server.engine.model, "make_batch", failing)
        status, objs = post(
            server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "stream": True}
        )
    assert status == 200 and set(objs[-1]) == {"error"} and "choices" in objs[0]
    conforms(ErrorObject, objs[-1]["error"])
    assert "internal error in the engine step" in objs[-1]["error"]["message"]


def test_an_error_before_the_first_token_is_the_http_status(server, monkeypatch):
    """The stream begins with its first token: a step that fails before it (or a full queue) is
    the response's status, not an event after a 200."""

    def failing(reqs, **kw):
        raise RuntimeError("boom")

    with monkeypatch.context() as m:
        m.setattr(server.engine.model, "make_batch", failing)
        status, body = post(
            server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "stream": True}
        )
    assert status == 500 and "internal error in the engine step" in str(body)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=12),
    ids=st.lists(st.integers(0, 2**31 - 1), max_size=3),
    index=st.integers(0, 300),
    chat=st.booleans(),
    model=st.text(min_size=1, max_size=12),
)
def test_a_plain_chunk_is_the_bytes_the_response_models_give(text, ids, index, chat, model):
    """openai_answers.plain_chunk, the per-token event built from a dict, against the response
    models' own serialization: any text (quotes, controls, surrogates' neighbours, emoji)."""
    job = Job(id="cmpl-1", created=1700000000, model=model, chat=chat, n=1, prompts=[[1]])
    choice: ChatChunkChoice | CompletionChoice
    if chat:
        delta = ChatDelta(content=text)
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=None)
    else:
        choice = CompletionChoice(
            index=index, text=text, logprobs=None, finish_reason=None, token_ids=ids
        )
    assert plain_chunk(job, index, Delta(text=text, token_ids=ids)) == job.chunk([choice]).sse()
