"""The compiled path (runtime/compiled/model.py) on the CPU: the model compiled once with a dynamic token
dimension, FULL graphs captured of it per size, zero recompiles after the first compile.

One test compiles with inductor's CPU backend (C++ kernels, about a minute on two busy cores);
the rest use "aot_eager" or "eager" through the same counting backend, which trace and guard exactly
as inductor does but generate no kernels.
"""

import logging

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models.tiny_llama import (
    TinyLlama,
    TinyLlamaConfig,
    make_batch,
    reference_generate,
    static_inputs,
)
from graphplan.runtime import GraphRunner, render_prometheus
from graphplan.runtime.compiled.model import CompiledModel, ModelCompileError

CFG = TinyLlamaConfig(
    vocab_size=128,
    hidden=64,
    layers=3,
    heads=4,
    kv_heads=2,
    intermediate=96,
    max_model_len=32,
    num_cache_rows=16,
)
TINY = TinyLlamaConfig(
    vocab_size=64,
    hidden=32,
    layers=1,
    heads=2,
    kv_heads=1,
    intermediate=64,
    max_model_len=16,
    num_cache_rows=16,
)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def plan(mode="FULL", sizes=(1, 2, 4, 8, 16)):
    return {
        "version": 1,
        "name": "c",
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 64},
        "cudagraph": {"mode": mode, "attention_support": "ALWAYS", "capture_sizes": list(sizes)},
    }


def decode(model, n, seed=0, start=3):
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(1, model.cfg.vocab_size, (n,), generator=gen).tolist()
    return make_batch(model, [(row, start + row % 5, [t]) for row, t in enumerate(toks)])


def test_inductor_compiled_full_graphs_match_eager_at_every_size_with_one_compile():
    model = TinyLlama(TINY, seed=0)
    # vec_isa_ok=False: scalar C++ kernels compile in about half the time; numerics are the same
    compiled = CompiledModel(model, "inductor", options={"cpp.vec_isa_ok": False})
    runner = GraphRunner(
        model,
        compile_plan(plan("FULL_AND_PIECEWISE")),
        static_inputs(model),
        progress=False,
        compile=compiled,
    )
    runner.capture()
    eager = TinyLlama(TINY, seed=0)
    for n in (1, 2, 3, 8, 13, 16):  # captured sizes, padded sizes in between, the largest
        batch = decode(model, n, seed=n)
        out = runner.step(batch, num_reqs=n, max_query_len=1)
        torch.testing.assert_close(out, eager(**batch), rtol=1e-4, atol=1e-4)
    # a prefill next to a decode: a PIECEWISE graph, which runs the uncompiled model's pieces
    mixed = make_batch(model, [(0, 0, [5, 6, 7, 8, 9]), (1, 9, [3])])
    torch.testing.assert_close(
        runner.step(mixed, num_reqs=2, max_query_len=5), eager(**mixed), rtol=1e-4, atol=1e-4
    )
    s = runner.stats()
    assert s["replays_by_mode"] == {"FULL": 6, "PIECEWISE": 1} and s["eager_steps"] == {}
    assert s["compile"]["backend"] == "inductor" and s["compile"]["seconds"] > 0
    assert (s["compile"]["compiles"], s["compile"]["recompiles"]) == (1, 0)


def test_one_compile_serves_every_capture_size_including_one_and_eager_steps_run_uncompiled():
    model = TinyLlama(CFG, seed=0)
    runner = GraphRunner(
        model,
        compile_plan(plan(sizes=(1, 2, 3, 4, 6, 8, 12, 16))),
        static_inputs(model),
        progress=False,
        compile="aot_eager",
    )
    summary = runner.capture()
    assert summary["graphs"] == 8
    assert runner.stats()["compile"] == {
        "backend": "aot_eager",
        "compiles": 1,
        "recompiles": 0,
        "seconds": runner.stats()["compile"]["seconds"],
        "merged_linears": 2 * CFG.layers,  # q/k/v, gate/up
        # head, an MLP half and an attention half per layer
        # after the first, tail; 4 distinct (regions.py)
        "regions": 2 * CFG.layers + 1,
        "region_compiles": 4,
    }
    prompts = [[5, 6, 7], [9], [3, 3, 3, 3, 3], [100, 1, 2, 7]]
    with_graphs = reference_generate(model, prompts, 5, step=lambda b, r, q: runner.step(b, r, q))
    assert with_graphs == reference_generate(TinyLlama(CFG, seed=0), prompts, 5)
    big = make_batch(model, [(5, 0, list(range(1, 21)))])  # 20 tokens: past every graph
    torch.testing.assert_close(
        runner.step(big, num_reqs=1, max_query_len=20),
        TinyLlama(CFG, seed=0)(**big),
        rtol=1e-5,
        atol=1e-5,
    )
    s = runner.stats()
    assert s["eager_steps"] and s["replays_by_mode"]["FULL"] > 0
    assert (s["compile"]["compiles"], s["compile"]["recompiles"]) == (1, 0)


def test_one_compiled_model_shared_by_runners_compiles_once():
    model = TinyLlama(CFG, seed=0)
    compiled = CompiledModel(model, "eager")
    for sizes in ((1, 2, 4), (1, 8, 16)):  # a server swapping tables keeps its compiled model
        runner = GraphRunner(
            model,
            compile_plan(plan(sizes=sizes)),
            static_inputs(model),
            progress=False,
            compile=compiled,
        )
        runner.capture()
        runner.step(decode(model, 3), num_reqs=3, max_query_len=1)
    assert (compiled.compiles, compiled.recompiles) == (1, 0)
    with pytest.raises(ValueError, match="wraps another model"):
        GraphRunner(
            TinyLlama(CFG, seed=0),
            compile_plan(plan()),
            static_inputs(model),
            progress=False,
            compile=compiled,
        )


def test_a_recompile_after_warm_up_is_counted_and_logged(caplog):
    model = TinyLlama(CFG, seed=0)
    compiled = CompiledModel(model, "eager")
    compiled.warm_up(decode(model, 8))
    compiled(**decode(model, 1))
    assert (compiled.compiles, compiled.recompiles) == (1, 0)
    batch = decode(model, 2)
    batch["input_ids"] = batch["input_ids"].int()  # another dtype: a guard fails
    with caplog.at_level(logging.WARNING, logger="graphplan.runtime"):
        compiled(**batch)
    assert (compiled.compiles, compiled.recompiles) == (2, 1)
    assert "compiled again after its warm-up (recompile 1" in caplog.text


def test_compile_metrics_are_in_stats_and_prometheus_only_when_compiling():
    model = TinyLlama(CFG, seed=0)
    plain = GraphRunner(model, compile_plan(plan()), static_inputs(model), progress=False)
    plain.capture()
    assert "compile" not in plain.stats()
    assert "model_recompiles_total" not in render_prometheus(plain.stats())
    runner = GraphRunner(
        model, compile_plan(plan()), static_inputs(model), progress=False, compile="eager"
    )
    runner.capture()
    text = render_prometheus(runner.stats())
    assert 'graphplan_model_compiles_total{backend="eager"} 1' in text
    assert 'graphplan_model_recompiles_total{backend="eager"} 0' in text


def test_a_model_that_cannot_compile_names_the_fix():
    def model(input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        return input_ids.float().view(16, 1)  # the token count fixed at 16

    m = TinyLlama(CFG, seed=0)
    runner = GraphRunner(
        model, compile_plan(plan()), static_inputs(m), progress=False, device="cpu", compile="eager"
    )
    with pytest.raises(
        ModelCompileError,
        match="dynamic token dimension failed.*Fix: .*fixes "
        "the token or request count to a constant",
    ):
        runner.capture()


def test_server_compile_flag_serves_greedy_tokens_and_compiles_once_across_a_reload(tmp_path):
    import http.client
    import json

    from graphplan.server import ModelSpec, Server, build_model, load_table
    from graphplan.server.cli import build_parser

    assert build_parser().parse_args(["--plan", "p.yaml", "--compile"]).compile == "inductor"
    assert build_parser().parse_args(["--plan", "p.yaml"]).compile == ""
    text = (
        "version: 1\nname: {}\nscheduler: {{max_num_seqs: 8, max_num_batched_tokens: 64}}\n"
        "cudagraph: {{mode: FULL, attention_support: ALWAYS, capture_sizes: {}}}\n"
    )
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(text.format("a", [1, 2, 4, 8]))
    second.write_text(text.format("b", [1, 4]))
    spec = ModelSpec(layers=3, hidden=64, vocab_size=128, max_model_len=48, compile="eager")
    server = Server(first, spec=spec, progress=False).start()
    try:
        assert server.wait_ready(60), server.engine.error
        host, port = server.address

        def generate(prompt, n):
            conn = http.client.HTTPConnection(host, port, timeout=60)
            conn.request("POST", "/generate", body=json.dumps({"prompt": prompt, "max_tokens": n}))
            body = json.loads(conn.getresponse().read())
            conn.close()
            return body["tokens"]

        reference = build_model(spec, load_table(str(first)), "cpu")
        assert generate([5, 6, 7], 4) == reference_generate(reference, [[5, 6, 7]], 4)[0]
        server.engine.reload(str(second))
        assert generate([9], 3) == reference_generate(reference, [[9]], 3)[0]
        assert server.engine.runner.stats()["compile"] == {
            "backend": "eager",
            "compiles": 1,
            "recompiles": 0,
            "seconds": server.engine.compiled.seconds,
            "merged_linears": 6,
            "regions": 7,
            "region_compiles": 4,
        }
    finally:
        server.stop()


def test_token_and_request_counts_stay_independent_and_one_is_not_special():
    def model(input_ids, seq_lens):  # uses both counts, equal at warm-up
        return input_ids.float()[:, None] + seq_lens.float().sum()

    compiled = CompiledModel(model, "eager")
    compiled.warm_up(
        {"input_ids": torch.ones(8, dtype=torch.long), "seq_lens": torch.ones(8, dtype=torch.int32)}
    )
    for tokens, reqs in ((8, 3), (5, 1), (1, 1), (0, 0)):
        out = compiled(input_ids=torch.arange(tokens), seq_lens=torch.ones(reqs, dtype=torch.int32))
        assert out.shape == (tokens, 1) and (tokens == 0 or out[0, 0] == reqs)
    assert (compiled.compiles, compiled.recompiles) == (1, 0)


@pytest.mark.parametrize("logits", ["all", "rows"])
def test_hf_adapter_decode_graphs_of_the_compiled_model_match_its_own_forward(logits):
    """Either way: every token's logits from the compiled step, or (the server's) its hidden
    states with the LM head applied after it (hf_models.AllRows)."""
    pytest.importorskip("transformers")
    from graphplan.models.hf import PagedCausalLM

    from hf_models import (
        LENS,
        STEPS,
        AllRows,
        reference_logits,
        reference_model,
        run_schedule,
        small_config,
        tokens,
    )
    from hf_models import plan as hf_plan

    model = PagedCausalLM.load(
        small_config("llama", layers=3),
        max_num_seqs=4,
        max_model_len=32,
        block_size=4,
        seed=0,
        random_weights=True,
        logits=logits,
    )
    assert model.logits_mode == logits
    runner = GraphRunner(
        model, compile_plan(hf_plan()), model.static_inputs(), progress=False, compile="eager"
    )
    runner.capture()
    seqs = [tokens(n, seed=10 + i) for i, n in enumerate(LENS)]
    driver = AllRows(runner, model) if logits == "rows" else runner
    got = run_schedule(model, driver, seqs, STEPS)  # prefill chunks eager, decodes FULL graphs
    ref = reference_model(model)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], reference_logits(ref, seq), atol=1e-4, rtol=1e-4)
    s = runner.stats()
    assert s["replays_by_mode"]["FULL"] == 6 and sum(s["eager_steps"].values()) == 2
    assert (s["compile"]["compiles"], s["compile"]["recompiles"]) == (1, 0)
    # the layers' two cache views reach each region as one input (regions.py), so the 3 layers
    # share compiled attention and MLP halves
    assert (s["compile"]["regions"], s["compile"]["region_compiles"]) == (7, 4)


def test_hf_adapter_under_inductor_never_recompiles_after_its_warm_up():
    """torch's inductor lowering guards ``tokens > 1`` in ops the HF models use (an index, a
    transpose, a cat), even while sizes are size-oblivious: the runner's warm-up also runs the
    smallest graph's size, so that compile is the warm-up's and no step ever pays one."""
    pytest.importorskip("transformers")
    from graphplan.models.hf import PagedCausalLM

    from hf_models import (
        LENS,
        STEPS,
        reference_logits,
        reference_model,
        run_schedule,
        small_config,
        tokens,
    )
    from hf_models import plan as hf_plan

    table = compile_plan(hf_plan())
    model = PagedCausalLM.load(
        small_config("llama", layers=3),
        max_num_seqs=table.max_num_seqs,
        max_model_len=32,
        block_size=4,
        seed=0,
        random_weights=True,
    )
    compiled = CompiledModel(model, "inductor", options={"cpp.vec_isa_ok": False})
    runner = GraphRunner(model, table, model.static_inputs(), progress=False, compile=compiled)
    runner.capture()
    assert compiled.recompiles == 0 and compiled.compiles in (1, 2)
    # q/k/v and gate/up of the 3 layers, one GEMM each, in every compile; 7 regions, 4 distinct
    assert compiled.merged == 2 * 3 * compiled.compiles
    assert (compiled.regions, compiled.region_compiles) == (
        7 * compiled.compiles,
        4 * compiled.compiles,
    )
    warm = compiled.compiles
    seqs = [tokens(n, seed=10 + i) for i, n in enumerate(LENS)]
    got = run_schedule(model, runner, seqs, STEPS)  # decodes at 1..4 requests: FULL graphs
    ref = reference_model(model)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], reference_logits(ref, seq), atol=1e-3, rtol=1e-3)
    s = runner.stats()
    assert s["replays_by_mode"]["FULL"] == 6
    assert (s["compile"]["compiles"], s["compile"]["recompiles"]) == (warm, 0)


def test_piecewise_graphs_run_the_uncompiled_model_next_to_compiled_full():
    model = TinyLlama(CFG, seed=0)
    p = plan("FULL_AND_PIECEWISE")
    p["cudagraph"]["splitting_ops"] = ["attention"]
    runner = GraphRunner(
        model, compile_plan(p), static_inputs(model), progress=False, compile="eager"
    )
    runner.capture()
    prompts = [[5, 6, 7], [9], [3, 3, 3, 3, 3], [100, 1, 2, 7]]
    got = reference_generate(model, prompts, 5, step=lambda b, r, q: runner.step(b, r, q))
    assert got == reference_generate(TinyLlama(CFG, seed=0), prompts, 5)
    s = runner.stats()
    assert s["replays_by_mode"] == {"PIECEWISE": 1, "FULL": 4} and s["eager_steps"] == {}
    assert (s["compile"]["compiles"], s["compile"]["recompiles"]) == (1, 0)
