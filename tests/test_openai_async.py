"""graphplan-serve --async-scheduling (server/pipeline.py) through the official openai client: the
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
    sync = start_server(tmp_path_factory, path, PLAN, max_model_len=48)
    pipelined = start_server(tmp_path_factory, path, PLAN, max_model_len=48, async_scheduling=True)
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
