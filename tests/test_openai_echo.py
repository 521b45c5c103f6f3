"""``echo`` with ``logprobs`` on /v1/completions (prompt logprobs), through the official ``openai``
client on loopback: every prompt token after the first gets its logprob under the model given the
tokens before it, and its top alternatives, equal to transformers' own forward of the same weights
(float32, CPU) within TOL; prompts longer than the plan's per-step token budget (prefilled in
several chunks), several prompts and choices in one batch, streaming, ``max_tokens`` 0, and a KV
pool small enough to preempt, which must not send a position twice."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from graphplan.server.core.hf_model import HFSpec

from hf_models import reference_logits, reference_model, tokens, write_model_dir
from served import openai_client, start_server

NAME = "tiny-echo"
BUDGET = 8  # tokens per step: a prompt of more is prefilled in chunks over several steps
PLAN = (
    f"version: 1\nname: echo-t\nscheduler: {{max_num_seqs: 4, max_num_batched_tokens: {BUDGET}}}\n"
    "cudagraph: {mode: FULL_DECODE_ONLY, attention_support: ALWAYS, capture_sizes: [1, 2, 4]}\n"
)
TOL = 1e-4
"""Absolute logprob tolerance against transformers' forward (float32 on both sides; chunked
paged attention sums in another order)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("hf") / NAME)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(tmp_path_factory, model_dir, PLAN, max_model_len=64)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def truth(server):
    """log_softmax of transformers' logits at every position of ``ids``: [len, vocab]."""
    ref = reference_model(server.engine.model)
    return lambda ids: torch.log_softmax(reference_logits(ref, ids), dim=-1)


def word(t: int) -> str:
    """Token ``t`` as the test tokenizer spells it (hf_models.write_tokenizer)."""
    return ("[UNK]", "<eos>")[t] if t < 2 else f"w{t - 2}"


def prompt_of(n: int, seed: int) -> list[int]:
    return [2 + t for t in tokens(n, seed, vocab=126)]  # words only: no [UNK], no <eos>


def check_positions(lp, ids: list[int], rows: torch.Tensor, k: int, first: int) -> None:
    """Entries ``first..`` of ``lp`` are tokens ``ids[first:]`` with their logprob and top ``k``
    under ``rows`` (row j - 1 predicts token j)."""
    for j in range(max(first, 1), len(ids)):
        row, tok = rows[j - 1], ids[j]
        assert lp.tokens[j] == word(tok)
        assert lp.token_logprobs[j] == pytest.approx(row[tok].item(), abs=TOL), j
        top = lp.top_logprobs[j]
        want = row.topk(k)
        assert list(top)[:k] == [word(t) for t in want.indices.tolist()], j
        assert list(top.values())[:k] == pytest.approx(want.values.tolist(), abs=TOL)
        assert top[word(tok)] == pytest.approx(row[tok].item(), abs=TOL)
        assert len(top) == k + (word(tok) not in list(top)[:k])


def check_echo(choice, prompt: list[int], truth, k: int) -> None:
    """A greedy echo choice: the prompt's entries, then the generated tokens', all the model's."""
    seq = prompt + choice.token_ids
    lp = choice.logprobs
    assert len(lp.tokens) == len(seq)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[0] == word(prompt[0])
    check_positions(lp, seq, truth(seq), k, first=1)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(seq))]


def test_echo_logprobs_are_transformers_own_at_every_prompt_position_across_chunks(client, truth):
    prompt = prompt_of(3 * BUDGET - 3, seed=1)  # 21 tokens: chunks of 8, 8, 5
    res = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    c = res.choices[0]
    check_echo(c, prompt, truth, 3)
    assert c.text.startswith(" ".join(word(t) for t in prompt))
    assert c.prompt_token_ids == prompt and len(c.token_ids) == 3
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (21, 3)


def test_a_text_prompt_is_echoed_with_its_logprobs_and_logprobs_0_gives_the_token_alone(
    client, truth
):
    res = client.completions.create(
        model=NAME, prompt="w1 w7 w30 w2 w9", max_tokens=2, temperature=0, echo=True, logprobs=0
    )
    c = res.choices[0]
    prompt = c.prompt_token_ids
    assert c.text.startswith("w1 w7 w30 w2 w9") and len(prompt) == 5
    rows = truth(prompt + c.token_ids)
    for j, tok in enumerate(prompt + c.token_ids):
        if j == 0:
            assert c.logprobs.top_logprobs[0] is None
            continue
        want = rows[j - 1][tok].item()
        assert c.logprobs.top_logprobs[j] == {word(tok): pytest.approx(want, abs=TOL)}


def test_prompts_and_choices_batched_together_each_get_their_own_prompt_logprobs(
    server, client, truth
):
    aclient = openai_client(server, openai.AsyncOpenAI)
    prompts = [prompt_of(n, seed=10 + n) for n in (13, 5, 2, 17)]

    async def together():
        echo = aclient.completions.create(
            model=NAME,
            prompt=prompts[:2],
            max_tokens=4,
            temperature=0,
            echo=True,
            logprobs=2,
            extra_body={"ignore_eos": True},
        )
        sampled = aclient.completions.create(
            model=NAME,
            prompt=prompts[3],
            max_tokens=5,
            n=2,
            seed=7,
            temperature=1.0,
            echo=True,
            logprobs=4,
            extra_body={"ignore_eos": True},
        )
        plain = aclient.completions.create(
            model=NAME, prompt=prompts[2], max_tokens=6, temperature=0, logprobs=1
        )
        return await asyncio.gather(echo, sampled, plain)

    echo, sampled, plain = asyncio.run(together())
    for c, p in zip(echo.choices, prompts):
        check_echo(c, p, truth, 2)
    for c in sampled.choices:  # sampled tokens: their logprobs are the model's raw ones too
        check_echo(c, prompts[3], truth, 4)
    assert sampled.choices[0].token_ids != sampled.choices[1].token_ids
    assert len(plain.choices[0].logprobs.tokens) == 6  # no echo: the generated tokens only


def test_streaming_sends_each_choices_prompt_and_its_logprobs_in_its_first_chunk(client, truth):
    prompt = prompt_of(11, seed=3)
    args = dict(
        model=NAME,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        n=2,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    echoed = " ".join(word(t) for t in prompt)
    for i, want in enumerate(whole.choices):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].text.startswith(echoed) and len(mine[0].logprobs.tokens) == 12
        assert not any(m.text.startswith(echoed) for m in mine[1:])
        assert "".join(m.text for m in mine) == want.text
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            got = [x for m in mine if m.logprobs for x in getattr(m.logprobs, field)]
            assert got == getattr(want.logprobs, field), field
        assert mine[-1].finish_reason == "length" and mine[-1].logprobs is None  # no token
        check_echo(want, prompt, truth, 2)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_alone(client, truth, stream):
    prompt = prompt_of(10, seed=4)
    args = dict(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    if stream:
        chunks = list(
            client.completions.create(stream=True, stream_options={"include_usage": True}, **args)
        )
        choices, usage = [ch.choices[0] for ch in chunks if ch.choices], chunks[-1].usage
        assert len(choices) == 1
        c = choices[0]
    else:
        res = client.completions.create(**args)
        c, usage = res.choices[0], res.usage
    assert c.text == " ".join(word(t) for t in prompt) and c.finish_reason == "length"
    assert c.token_ids == [] and len(c.logprobs.tokens) == len(prompt)
    check_positions(c.logprobs, prompt, truth(prompt), 1, first=1)
    assert (usage.prompt_tokens, usage.completion_tokens) == (10, 0)


def test_echo_without_logprobs_computes_none_and_max_tokens_0_needs_echo(client, server):
    res = client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=2, echo=True)
    assert res.choices[0].logprobs is None and res.choices[0].text.startswith("w3 w4 w5")
    with pytest.raises(openai.BadRequestError, match="'max_tokens' 0 generates nothing"):
        client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=0)


def test_a_preempted_request_sends_each_prompt_position_once(model_dir, tmp_path):
    """A KV pool too small for four requests at once: some are preempted after their prompt ran and
    recompute it; each still gets exactly one entry per prompt position, as it does alone."""
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
                Request(p, 30, sink, SamplingParams(temperature=0.0), tag=i, prompt_logprobs=3)
                for i, p in prompts
            ]
            engine.enqueue(reqs)
            got: dict[int, list] = {i: [] for i, _ in prompts}
            left = len(reqs)
            while left:
                tag, kind, value = sink.get(60)
                assert kind != "error", value
                if kind == "prompt_logprobs":
                    got[tag] += value
                left -= kind == "done"
            return got

        prompts = [(i, prompt_of(12 + i, seed=20 + i)) for i in range(4)]
        alone = {i: run([(i, p)])[i] for i, p in prompts}
        before = engine.metrics.value("graphplan_server_preemptions_total")
        together = run(prompts)
        assert engine.metrics.value("graphplan_server_preemptions_total") > before
        for i, p in prompts:
            assert [s.token for s in together[i]] == p[1:]
            for a, b in zip(together[i], alone[i]):
                assert a.logprob == pytest.approx(b.logprob, abs=TOL)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    finally:
        engine.stop(5)
