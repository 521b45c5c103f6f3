"""graphplan-serve --async-scheduling (server/core/pipeline.py) through the official openai client: the
same tokens and finish reasons as the synchronous server, streaming and not, greedy (transformers'
own generate), seeded sampling and stop token ids, with the pipeline actually speculating."""

from __future__ import annotations

import asyncio

import openai
import pytest

from hf_models import generated, reference_model, tokens, write_model_dir
from served import openai_client, start_server

PLAN = (
    "version: 1\nname: async-t\nscheduler: {max_num_seqs: 4, max_num_batched_tokens: 32}\n"
    "cudagraph: {mode: FULL_DECODE_ONLY, attention_support: ALWAYS, capture_sizes: [1, 2, 4]}\n"
)
NAME = "tiny-async"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("hf") / NAME)
    sync = start_server(tmp_path_factory, path, PLAN, max_model_len=48, async_scheduling=False)
    pipelined = start_server(tmp_path_factory, path, PLAN, max_model_len=48)  # the default
    yield sync, pipelined
    sync.stop()
    pipelined.stop()


def _answers(server) -> list[tuple[list[int], str]]:
    """Four requests at once: greedy streamed, greedy, seeded sampled (n 2), and one that ends at a
    stop token id: (token ids, finish reason) per choice."""
    client = openai_client(server, openai.AsyncOpenAI)
    prompts = [[2 + t for t in tokens(n, seed=n, vocab=100)] for n in (5, 9, 3, 7)]
    common = {"model": NAME, "extra_body": {"ignore_eos": True}}

    async def streamed(prompt):
        ids, reason = [], None
        async for chunk in await client.completions.create(
            prompt=prompt, max_tokens=12, temperature=0, stream=True, **common
        ):
            ids += chunk.choices[0].token_ids or []
            reason = chunk.choices[0].finish_reason or reason
        return [(ids, reason)]

    async def plain(prompt, **kw):
        res = await client.completions.create(prompt=prompt, **common, **kw)
        return [(c.token_ids, c.finish_reason) for c in res.choices]

    async def together():
        outs = await asyncio.gather(
            streamed(prompts[0]),
            plain(prompts[1], max_tokens=10, temperature=0),
            plain(prompts[2], max_tokens=8, temperature=0.9, seed=3, n=2),
            plain(prompts[3], max_tokens=10, temperature=0),
        )
        return [a for out in outs for a in out]

    return asyncio.run(together()), prompts


def test_async_scheduling_answers_as_the_synchronous_server_does(servers):
    sync, pipelined = servers
    want, prompts = _answers(sync)
    got, _ = _answers(pipelined)
    assert got == want
    ref = reference_model(sync.engine.model)
    assert want[0] == (generated(ref, prompts[0], 12), "length")
    assert want[1] == (generated(ref, prompts[1], 10), "length")
    assert pipelined.engine.pipeline.speculated > 0 and sync.engine.pipeline.speculated == 0


def test_a_stop_token_id_ends_the_pipelined_request_where_the_synchronous_one_ends(servers):
    sync, pipelined = servers
    prompt = [2 + t for t in tokens(6, seed=11, vocab=100)]
    full = generated(reference_model(sync.engine.model), prompt, 10)
    stop = full[4]
    for server in (sync, pipelined):
        res = openai_client(server).completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body={"stop_token_ids": [stop], "ignore_eos": True},
        )
        c = res.choices[0]
        assert c.finish_reason == "stop"
        assert c.token_ids == full[: full.index(stop) + 1]


def test_a_queue_for_the_seats_and_logprobs_keep_the_pipeline_and_its_answers(servers):
    """Seven requests for four seats, of different lengths, three asking for logprobs, at once:
    the pipelined server answers each as the synchronous one does (ids, finish reasons, logprobs
    and their top alternatives), and /metrics says it launched steps ahead. The pipeline gives a
    freed seat out a step later, so a request may decode in a batch of another size than in the
    synchronous server, and a row's logits can differ there in the last float32 bit (seen: one
    top alternative 1 ulp apart): logprobs agree within 1e-5, tokens exactly."""
    sync, pipelined = servers

    def answers(server):
        client = openai_client(server, openai.AsyncOpenAI)

        async def one(i):
            res = await client.completions.create(
                model=NAME,
                prompt=[2 + t for t in tokens(3 + i, seed=20 + i, vocab=100)],
                max_tokens=6 + 2 * i,
                temperature=0 if i % 2 else 0.8,
                seed=i,
                logprobs=3 if i < 3 else None,
                extra_body={"ignore_eos": True},
            )
            c = res.choices[0]
            lp = c.logprobs
            return c.token_ids, c.finish_reason, lp and (lp.token_logprobs, lp.top_logprobs)

        async def together():
            return await asyncio.gather(*(one(i) for i in range(7)))

        return asyncio.run(together())

    before = pipelined.engine.metrics.value("graphplan_server_async_steps_total")
    want = answers(sync)
    got = answers(pipelined)
    assert [g[:2] for g in got] == [w[:2] for w in want]  # ids and finish reasons: exactly
    for g, w in zip(got, want):  # logprobs: within float32 rounding (see the docstring)
        assert (g[2] is None) == (w[2] is None)
        if w[2] is not None:
            assert g[2][0] == pytest.approx(w[2][0], abs=1e-5)
            for top_g, top_w in zip(g[2][1], w[2][1], strict=True):
                assert top_g.keys() == top_w.keys()
                assert list(top_g.values()) == pytest.approx(list(top_w.values()), abs=1e-5)
    assert all(w[2] is not None and 3 <= len(w[2][1][0]) <= 4 for w in want[:3])  # + chosen
    scrape = (
        openai_client(pipelined).with_options(max_retries=0)._client.get(pipelined.url + "/metrics")
    )
    after = [
        float(line.split()[1])
        for line in scrape.text.splitlines()
        if line.startswith("graphplan_server_async_steps_total ")
    ]
    assert after and after[0] > before
