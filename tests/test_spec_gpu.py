"""Speculative decoding on CUDA through the HF path (PagedCausalLM, the Triton paged attention,
graphs captured on the device): greedy output identical with and without speculation (n-gram
and a draft model equal to the target, alone, in a busy batch and with preemption), float32 so
that the q = 1 + k verify step and the q = 1 step round alike; a draft equal to the target is
always accepted; the uniform steps replay the table's q-multiple FULL graphs. bfloat16: a draft
equal to the target is accepted almost always (the draft's q = 1 step and the verify step of
q = 4 may round a near-tie apart). Skipped cleanly without CUDA."""

from __future__ import annotations

import pytest
from test_async_scheduling import prompt, run
from test_async_scheduling_gpu import llama_dir  # noqa: F401 (a fixture)
from test_spec_engine import NGRAM, K, _accepted, _draft, plan, repeating, replays_and_routes

from graphplan.server.core.hf_model import HFSpec
from graphplan.server.requests import GREEDY

pytestmark = pytest.mark.gpu


WAVES = [
    [(prompt(i, 5 + i), 30 - i, (), GREEDY) for i in range(4)],
    [([7] * 6, 20, (), GREEDY), (repeating(9, 7), 12, (), GREEDY)],
]


@pytest.mark.parametrize("kv_tokens", [None, 96], ids=["roomy", "preempting"])
def test_greedy_identity_on_cuda(llama_dir, kv_tokens):  # noqa: F811
    spec = HFSpec(
        model=str(llama_dir), max_model_len=64, dtype="float32", kv_cache_tokens=kv_tokens
    )
    got, uniform = {}, {}
    for name, speculative in (("off", None), ("ngram", NGRAM), ("self", _draft(llama_dir))):
        text = plan(1 + K if speculative else 1, seqs=4, sizes=(1, 2, 4, 8, 16))
        e = _cuda_engine(spec, text, speculative)
        try:
            replays, routed, uniform[name] = replays_and_routes(
                e, lambda e=e, name=name: got.__setitem__(name, run(e, WAVES))
            )
            assert replays == routed  # every step replayed the graph its route names
            assert e.kv_blocks_used() == 0
            if kv_tokens:
                assert e.metrics.value("graphplan_server_preemptions_total") > 0
            drafted = e.metrics.value("graphplan_spec_decode_num_draft_tokens_total")
            if name == "self":
                assert drafted > 30 and _accepted(e) == drafted
        finally:
            e.stop(5)
    assert got["ngram"] == got["off"] and got["self"] == got["off"]
    # a draft equal to the target makes every decode step uniform: q-multiple FULL graphs ran
    assert len(uniform["self"]) >= 5
    assert all(rt.mode.name == "FULL" for _, rt in uniform["self"])


def test_bfloat16_draft_equal_to_the_target_is_accepted_almost_always(llama_dir):  # noqa: F811
    spec = HFSpec(model=str(llama_dir), max_model_len=64, dtype="bfloat16")
    e = _cuda_engine(spec, plan(1 + K, seqs=4, sizes=(1, 2, 4, 8, 16)), _draft(llama_dir))
    try:
        run(e, WAVES)
        drafted = e.metrics.value("graphplan_spec_decode_num_draft_tokens_total")
        assert drafted > 30 and _accepted(e) >= 0.9 * drafted
    finally:
        e.stop(5)


def _cuda_engine(spec, text, speculative):
    from test_server import load_table_from_text

    from graphplan.server import Engine

    e = Engine(
        load_table_from_text(text), "plan.yaml", spec=spec, device="cuda", progress=False,
        speculative=speculative,
    )  # fmt: skip
    e.start()
    assert e.wait_ready(120), e.error
    return e
