"""The server as it runs on a GPU by default (async scheduling, the fused sampler's Triton kernel)
through the official ``openai`` client on loopback, over a Qwen3 checkpoint saved with
``save_pretrained`` and a ``tokenizers`` tokenizer with a chat template: streamed chat equal to
transformers' greedy ``generate``, a seed reproduced exactly alone, in a busy batch and again, stop
strings never sent, and errors as the client's exceptions. float32, so batching cannot flip a
near-tied greedy argmax in practice.

    python -m pytest -q -m gpu tests/test_openai_gpu.py
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from graphplan.server import Server
from graphplan.server.core.hf_model import HFSpec

from hf_models import generated, reference_model, write_model_dir
from served import openai_client, with_chat_template

pytestmark = pytest.mark.gpu
NAME = "gpu-chat"
PLAN = (
    "version: 1\nname: chat-gpu\nscheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}\n"
    "cudagraph: {mode: FULL_DECODE_ONLY, attention_support: ALWAYS, capture_sizes: [1, 2, 4, 8]}\n"
)
# user turns start with w1 (id 3), the prompt for the answer is w3 (id 5)
TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)
SAMPLED = dict(temperature=0.9, top_p=0.95, presence_penalty=0.3)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = with_chat_template(write_model_dir(tmp_path_factory.mktemp("hf") / NAME), TEMPLATE)
    plan = tmp_path_factory.mktemp("plan") / "plan.yaml"
    plan.write_text(PLAN)
    spec = HFSpec(model=str(model_dir), max_model_len=64, dtype="float32")
    s = Server(plan, spec=spec, device="cuda", progress=False).start()  # the defaults
    assert s.wait_ready(300), s.engine.error
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def ref(server):
    return reference_model(server.engine.model).cpu()


def words(ids: list[int]) -> str:
    """The text the server streams for ``ids`` (ids 0 and 1 are special tokens, skipped)."""
    return " ".join(f"w{t - 2}" for t in ids if t >= 2)


def test_the_server_runs_async_scheduling_and_the_fused_sampler_by_default(server):
    assert server.engine.pipeline.async_scheduling
    assert server.engine.sampler.sampler._kernels is not None


def test_streamed_chat_equals_transformers_greedy_generate(client, ref):
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "w9 w9 w9"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    want = generated(ref, [3, 11, 11, 11, 5], 8)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == words(want).split()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def _sampled(client, prompt, seed):
    return client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, seed=seed, extra_body={"ignore_eos": True},
        **SAMPLED,
    ).choices[0].token_ids  # fmt: skip


def test_a_seed_gives_the_same_tokens_alone_in_a_busy_batch_and_again(server, client):
    prompt = [5, 9, 2, 77, 40]
    alone = _sampled(client, prompt, 1234)
    aclient = openai_client(server, openai.AsyncOpenAI)

    async def busy():
        others = [
            aclient.completions.create(
                model=NAME,
                prompt=[7 + i] * (3 + i),
                max_tokens=10 + i,
                seed=i,
                temperature=0 if i % 2 else 1.3,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for i in range(6)
        ]
        mine = aclient.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, seed=1234, extra_body={"ignore_eos": True},
            **SAMPLED,
        )  # fmt: skip
        results = await asyncio.gather(*others[:3], mine, *others[3:])
        return results[3].choices[0].token_ids

    assert asyncio.run(busy()) == alone
    assert _sampled(client, prompt, 1234) == alone
    assert _sampled(client, prompt, 1235) != alone  # 12 tokens at temperature 0.9 over 128 words


def test_a_stop_string_across_token_boundaries_ends_the_text_and_is_never_sent(client, ref):
    prompt = [20, 21, 22]
    text = words(generated(ref, prompt, 10))
    third, fourth = text.split()[2:4]
    stop = third[1:] + " " + fourth[:2]  # starts inside the 3rd word, ends inside the 4th
    cut = text.index(stop)
    res = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=10, temperature=0, stop=[stop, "zzz"],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert res.choices[0].text == text[:cut] and res.choices[0].finish_reason == "stop"


def test_bad_requests_are_the_clients_exceptions(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=[1, 2], max_tokens=2)
