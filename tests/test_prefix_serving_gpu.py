"""Prefix caching on CUDA (issue 38): an HF Llama through the fused decoder and the Triton paged
attention gives the same greedy tokens with and without the cache for requests sharing a long
prefix, synchronously and with async scheduling; the later requests find the shared blocks cached.
float32, so that the K/V a cached block holds (computed in another step's batch) and the K/V
computed again agree closely enough that no greedy near-tie flips (bfloat16 could flip one, as
tests/test_async_scheduling_gpu.py explains). Skipped cleanly without CUDA."""

from __future__ import annotations

import pytest
from test_async_scheduling import prompt, run
from test_async_scheduling_gpu import llama_dir  # noqa: F401 (a fixture)
from test_prefix_serving import _engine

from graphplan.server.core.hf_model import HFSpec
from graphplan.server.requests import GREEDY

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_two_requests_sharing_a_long_prefix_get_the_same_greedy_tokens(
    llama_dir,  # noqa: F811
    async_scheduling,
):
    spec = HFSpec(model=str(llama_dir), max_model_len=256, dtype="float32", block_size=16)
    shared = prompt(7, 200)  # + suffix + 24 new tokens fit the fixture's 256 positions
    waves = [
        [(shared + prompt(1, 5), 24, (), GREEDY)],  # fills the shared blocks
        [(shared + prompt(2, 9), 24, (), GREEDY), (shared + prompt(3, 20), 24, (), GREEDY)],
    ]
    got, hits = {}, {}
    for cache in (True, False):
        e = _engine(llama_dir, async_scheduling, cache, spec=spec, device="cuda")
        try:
            got[cache] = run(e, waves)
            hits[cache] = e.metrics.value("graphplan_prefix_cache_hits_total")
        finally:
            e.stop(5)
    assert got[True] == got[False]
    assert hits == {True: 2 * 192, False: 0}  # 12 whole blocks of the 200 shared tokens each
