"""The runtime on the CPU stand-in: routing, copy-in, padding, replay, slicing, safety, metrics.

The stand-in re-runs the recorded call on the static buffers at replay, so every test here exercises
the same buffer and output handling that real CUDA graphs get (tests/test_runtime_gpu.py).
"""

import re

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models.tiny_llama import (
    TinyLlama,
    TinyLlamaConfig,
    greedy,
    greedy_mismatch,
    make_batch,
    reference_generate,
    static_inputs,
)
from graphplan.runtime import (
    BatchError,
    CaptureError,
    GraphRunner,
    RunnerStateError,
    StaticInput,
    TableError,
    render_prometheus,
)

CFG = TinyLlamaConfig(
    vocab_size=128,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=96,
    max_model_len=32,
    num_cache_rows=8,
)


def plan(mode="FULL", sizes=(1, 2, 4, 8, 16), **sched):
    return {
        "version": 1,
        "name": "t",
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64, **sched},
        "cudagraph": {"mode": mode, "attention_support": "ALWAYS", "capture_sizes": list(sizes)},
    }


def runner_for(p, model=None, **kw):
    model = model or TinyLlama(CFG, seed=0)
    r = GraphRunner(model, compile_plan(p), static_inputs(model), progress=False, **kw)
    return model, r


def decode_batch(model, n, start=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(1, CFG.vocab_size, (n,), generator=gen).tolist()
    return make_batch(model, [(row, start, [t]) for row, t in enumerate(toks)])


def test_replayed_decode_matches_eager_at_every_captured_and_in_between_size():
    model, runner = runner_for(plan())
    runner.capture()
    eager_model = TinyLlama(CFG, seed=0)
    for n in range(1, 9):
        batch = decode_batch(model, n, seed=n)
        out = runner.step(batch, num_reqs=n, max_query_len=1)
        ref = eager_model(**{k: v.clone() for k, v in batch.items()})
        assert out.shape == (n, CFG.vocab_size)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert runner.stats()["eager_steps"] == {}
    assert runner.stats()["replays"] == 8


def test_generation_through_graphs_equals_eager_generation():
    model, runner = runner_for(plan("FULL_AND_PIECEWISE"))
    runner.capture()
    prompts = [[5, 6, 7], [9], [3, 3, 3, 3, 3], [100, 1, 2, 7]]
    with_graphs, got = greedy(model, prompts, 6, step=lambda b, r, q: runner.step(b, r, q))
    eager = reference_generate(TinyLlama(CFG, seed=0), prompts, 6)
    assert with_graphs == eager
    _, want = greedy(TinyLlama(CFG, seed=0), prompts, 6, forced=with_graphs)
    assert greedy_mismatch(with_graphs, got, want, torch.float32) is None  # logits, not only tokens
    s = runner.stats()
    assert s["replays_by_mode"] == {"FULL": 5, "PIECEWISE": 1}  # 5 decodes; the mixed prefill
    assert s["eager_steps"] == {}


def context_checks(model, runner, tol):
    """A request's logits through the runner change when its own earlier tokens change and do not
    change when its batch neighbours change. Returns the logits of the probe request."""
    gen = torch.Generator().manual_seed(11)

    def rand(n):
        return torch.randint(1, model.cfg.vocab_size, (n,), generator=gen).tolist()

    probe, other_past = rand(9), rand(9)
    neighbours = [[rand(12), rand(5)], [rand(3), rand(15)]]  # two different sets of neighbours
    out = {}
    for name, past, nbrs in (
        ("a", probe, neighbours[0]),
        ("b", probe, neighbours[1]),
        ("changed", other_past[:-1] + probe[-1:], neighbours[0]),
    ):
        model.kv_cache.zero_()
        prefill = make_batch(
            model, [(0, 0, past[:-1]), *((r + 1, 0, p[:-1]) for r, p in enumerate(nbrs))]
        )
        runner.step(prefill, num_reqs=3, max_query_len=max(len(past), *map(len, nbrs)) - 1)
        decode = make_batch(
            model,
            [
                (0, len(past) - 1, past[-1:]),
                *((r + 1, len(p) - 1, p[-1:]) for r, p in enumerate(nbrs)),
            ],
        )
        out[name] = runner.step(decode, num_reqs=3, max_query_len=1)[0].float().cpu().clone()
    torch.testing.assert_close(out["a"], out["b"], atol=tol, rtol=tol)  # neighbours: no effect
    moved = (out["a"] - out["changed"]).abs().max().item()
    assert moved > 100 * tol, moved  # its own earlier tokens: a clear effect (same last token)
    assert out["a"].argmax() != out["changed"].argmax()
    return out


def test_a_requests_outputs_follow_its_own_context_and_ignore_its_neighbours():
    model, runner = runner_for(plan("FULL_AND_PIECEWISE"))
    runner.capture()
    context_checks(model, runner, 1e-4)
    assert set(runner.stats()["replays_by_mode"]) == {"FULL", "PIECEWISE"}


def test_padding_rows_hold_safe_values_after_a_larger_step():
    model, runner = runner_for(plan())
    runner.capture()
    runner.step(decode_batch(model, 7), num_reqs=7, max_query_len=1)  # pads to 8
    runner.step(decode_batch(model, 3), num_reqs=3, max_query_len=1)  # pads to 4
    bufs = runner.buffers.buffers
    assert bufs["slot_mapping"][3:16].tolist() == [model.dummy_slot] * 13
    assert bufs["input_ids"][3:16].tolist() == [0] * 13
    assert bufs["positions"][3:16].tolist() == [0] * 13
    assert bufs["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 3]  # padded request is empty


def test_copy_in_writes_every_dtype_and_a_non_contiguous_input_exactly():
    """StaticBuffers.load copies contiguous inputs in one foreach over byte views (mixed dtypes,
    trailing dimensions) and any other input on its own; pads follow the real rows."""
    from graphplan.runtime.buffers import StaticBuffers

    specs = [
        StaticInput(name="ids", per="token", dtype=torch.int64, pad=-1),
        StaticInput(name="emb", per="token", dtype=torch.float16, trailing=(3,)),
        StaticInput(name="flag", per="token", dtype=torch.bool),
        StaticInput(name="lens", per="req", dtype=torch.int32, pad=7),
        StaticInput(name="qsl", per="req+1", dtype=torch.int32, pad="last"),
    ]
    bufs = StaticBuffers(specs, max_tokens=8, max_reqs=4, device="cpu")
    wide = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    batch = {
        "ids": torch.tensor([5, -2, 1 << 40]),
        "emb": wide[:, :3],  # not contiguous
        "flag": torch.tensor([True, False, True]),
        "lens": torch.tensor([9, 8], dtype=torch.int32),
        "qsl": torch.tensor([0, 2, 3], dtype=torch.int32),
    }
    assert not batch["emb"].is_contiguous()
    bufs.check(batch, 3, 2)
    bufs.load(batch, 3, 2, padded_tokens=4, padded_reqs=3)
    b = bufs.buffers
    assert b["ids"][:4].tolist() == [5, -2, 1 << 40, -1]
    assert torch.equal(b["emb"][:3], wide[:, :3])
    assert b["flag"][:3].tolist() == [True, False, True]
    assert b["lens"][:3].tolist() == [9, 8, 7] and b["qsl"][:4].tolist() == [0, 2, 3, 3]
    bufs.load({k: v[:1] if k not in ("qsl",) else v[:2] for k, v in batch.items()}, 1, 1, 1, 1)
    assert b["ids"][:4].tolist() == [5, -1, -1, -1]  # rows the larger step dirtied are pads again
    # one row of a column: contiguous by torch's rule, its stride 2 (the sampler's token column
    # with logprobs, async scheduling's next input_ids), which a byte view refuses
    column = torch.tensor([[42, 0]])[:, 0]
    assert column.is_contiguous() and column.stride() == (2,)
    bufs.load({**{k: v[:1] for k, v in batch.items()}, "ids": column, "qsl": batch["qsl"][:2]},
              1, 1, 1, 1)  # fmt: skip
    assert b["ids"][:2].tolist() == [42, -1]


def test_the_compiled_model_writes_its_outputs_into_the_callers_buffers():
    """CompiledModel.run_into: the body a compiled FULL graph records writes rows [0, n) of the
    static outputs from the compiled code (no copy after it); rows past n are left alone."""
    from graphplan.runtime import CompiledModel

    torch._dynamo.reset()
    model = TinyLlama(CFG, seed=0)
    compiled = CompiledModel(model, "eager")
    big, small = decode_batch(model, 8), decode_batch(model, 3, seed=5)
    outputs = compiled.warm_up(big)
    assert outputs[0].shape == (8, CFG.vocab_size)
    static = torch.full((16, CFG.vocab_size), 7.0)
    compiled.run_into((static,), small)
    torch.testing.assert_close(static[:3], model(**small))
    assert bool((static[3:] == 7.0).all())
    out = compiled(**small)  # a fresh result, n rows
    assert out.shape == (3, CFG.vocab_size)
    torch.testing.assert_close(out, model(**small))
    assert (compiled.compiles, compiled.recompiles) == (1, 0)
    torch._dynamo.reset()


def test_outputs_are_views_of_static_buffers_valid_until_the_next_step():
    model, runner = runner_for(plan())
    runner.capture()
    first = runner.step(decode_batch(model, 4, seed=1), num_reqs=4, max_query_len=1)
    kept = first.clone()
    runner.step(decode_batch(model, 4, seed=2), num_reqs=4, max_query_len=1)
    assert not torch.equal(first, kept)  # documented: copy what you keep


def test_eager_route_runs_the_model_directly_with_the_reason_counted():
    model, runner = runner_for(plan(sizes=(1, 2)))
    runner.capture()
    batch = decode_batch(model, 5)
    out = runner.step(batch, num_reqs=5, max_query_len=1)
    assert out.shape == (5, CFG.vocab_size)
    assert runner.stats()["eager_steps"] == {"above_largest_capture_size": 1}


def test_capture_twice_is_an_error():
    _, runner = runner_for(plan())
    runner.capture()
    with pytest.raises(RunnerStateError, match="capture\\(\\) already ran"):
        runner.capture()


def test_bad_batches_give_clear_errors_and_leave_the_runner_usable():
    model, runner = runner_for(plan())
    runner.capture()
    too_many = {
        k: torch.zeros(65 if k not in ("seq_lens", "query_start_loc") else 1, dtype=v.dtype)
        for k, v in decode_batch(model, 1).items()
    }
    with pytest.raises(BatchError, match="outside 1..64"):
        runner.step(too_many, num_reqs=1, max_query_len=65)
    wrong_dtype = decode_batch(model, 2)
    wrong_dtype["positions"] = wrong_dtype["positions"].to(torch.int32)
    with pytest.raises(BatchError, match="'positions' is torch.int32"):
        runner.step(wrong_dtype, num_reqs=2, max_query_len=1)
    missing = decode_batch(model, 2)
    del missing["seq_lens"]
    with pytest.raises(BatchError, match="missing \\['seq_lens'\\]"):
        runner.step(missing, num_reqs=2, max_query_len=1)
    wrong_rows = decode_batch(model, 2)
    wrong_rows["seq_lens"] = wrong_rows["seq_lens"][:1]
    with pytest.raises(BatchError, match="'seq_lens' has shape \\(1,\\)"):
        runner.step(wrong_rows, num_reqs=2, max_query_len=1)
    out = runner.step(decode_batch(model, 2), num_reqs=2, max_query_len=1)
    assert out.shape == (2, CFG.vocab_size)


def test_table_fingerprint_mismatch_is_refused():
    model = TinyLlama(CFG, seed=0)
    with pytest.raises(TableError, match="does not match the runner's"):
        GraphRunner(
            model,
            compile_plan(plan()),
            static_inputs(model),
            expected_fingerprint="sha256:" + "0" * 64,
        )


def test_runner_loads_a_table_file(tmp_path):
    path = tmp_path / "table.json"
    compile_plan(plan()).save(path)
    model = TinyLlama(CFG, seed=0)
    runner = GraphRunner(model, path, static_inputs(model), progress=False)
    assert runner.table.fingerprint == compile_plan(plan()).fingerprint


class FailsAt:
    """A model that cannot run at one token count (as if capture ran out of memory there)."""

    def __init__(self, model, bad_tokens):
        self.model, self.bad = model, bad_tokens

    def __call__(self, **kw):
        if kw["input_ids"].shape[0] == self.bad:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.model(**kw)


def test_failed_capture_names_the_graph_releases_everything_and_runner_stays_usable():
    model = TinyLlama(CFG, seed=0)
    runner = GraphRunner(
        FailsAt(model, 4), compile_plan(plan()), static_inputs(model), progress=False, device="cpu"
    )
    with pytest.raises(
        CaptureError,
        match=r"graph #2 \(4 tokens.*Released every graph.*lower "
        r"cudagraph.capture_sizes",
    ):
        runner.capture()
    assert runner.captured_graph_ids() == [] and not runner.captured
    out = runner.step(decode_batch(model, 2), num_reqs=2, max_query_len=1)  # eager, still works
    assert out.shape == (2, CFG.vocab_size)
    assert runner.stats()["eager_steps"] == {"full_not_captured": 1}
    runner.model = model
    runner.capture()  # a retry after fixing the cause captures everything
    assert len(runner.captured_graph_ids()) == 5


def test_capture_summary_and_prometheus_metrics():
    model, runner = runner_for(plan())
    summary = runner.capture()
    assert summary["graphs"] == 5 and summary["backend"] == "cpu-stand-in"
    assert [t for _, t, _ in summary["per_graph"]] == [16, 8, 4, 2, 1]  # largest first
    runner.step(decode_batch(model, 3), num_reqs=3, max_query_len=1)
    runner.step(decode_batch(model, 3), num_reqs=3, max_query_len=1)
    s = runner.stats()
    assert s["graphs"] == [
        {
            "id": 2,
            "mode": "FULL",
            "num_tokens": 4,
            "num_active_loras": 0,
            "num_ubatches": 1,
            "replays": 2,
            "padding_tokens": 2,
        }
    ]
    text = render_prometheus(s)
    assert 'graphplan_graph_replays_total{graph="2",mode="FULL",num_tokens="4"} 2' in text
    assert 'graphplan_graph_padding_tokens_total{graph="2",mode="FULL",num_tokens="4"} 2' in text
    assert re.search(r'graphplan_plan_info\{plan="t",fingerprint="sha256:[0-9a-f]{64}"', text)
    assert "graphplan_captured_graphs 5" in text


def test_static_inputs_are_validated_at_construction():
    model = TinyLlama(CFG, seed=0)
    with pytest.raises(ValueError, match="per must be one of"):
        StaticInput(name="x", per="row", dtype=torch.int64)
    with pytest.raises(ValueError, match="duplicate static input names"):
        GraphRunner(model, compile_plan(plan()), static_inputs(model) * 2)


def test_multiple_outputs_are_sliced_to_real_rows():
    model = TinyLlama(CFG, seed=0)

    def two_outputs(**kw):
        logits = model(**kw)
        return logits, logits.argmax(-1)

    runner = GraphRunner(
        two_outputs, compile_plan(plan()), static_inputs(model), device="cpu", progress=False
    )
    runner.capture()
    logits, ids = runner.step(decode_batch(model, 3), num_reqs=3, max_query_len=1)
    assert logits.shape == (3, CFG.vocab_size) and ids.shape == (3,)
    assert torch.equal(ids, logits.argmax(-1))


def test_runner_device_defaults_to_where_the_weights_are_even_without_parameters():
    class BuffersOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.ones(3, device="meta"))

    model = TinyLlama(CFG, seed=0)
    runner = GraphRunner(BuffersOnly(), compile_plan(plan()), static_inputs(model), progress=False)
    assert runner.device.type == "meta"


def test_capture_logs_a_line_every_tenth_of_the_graphs_when_stderr_is_no_terminal(caplog):
    """In logs and CI (no terminal) a progress bar would be redrawn into the log: capture writes
    about ten progress lines instead, the last one at n/n."""
    model = TinyLlama(CFG, seed=0)
    sizes = list(range(1, 41))
    r = GraphRunner(model, compile_plan(plan(sizes=sizes)), static_inputs(model), progress=True)
    with caplog.at_level("INFO", logger="graphplan.runtime"):
        r.capture()
    lines = [m for m in caplog.messages if m.startswith("Capturing graphs")]
    assert len(lines) == 10 and lines[0].endswith(": 4/40") and lines[-1].endswith(": 40/40")


def test_an_interrupt_during_capture_releases_everything_and_leaves_the_runner_usable():
    model = TinyLlama(CFG, seed=0)
    calls = {"n": 0}

    def interrupting(**kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return model(**kw)

    r = GraphRunner(interrupting, compile_plan(plan()), static_inputs(model), progress=False)
    with pytest.raises(KeyboardInterrupt):
        r.capture()
    assert r.captured_graph_ids() == [] and not r.captured
    r.capture()  # nothing half-captured is left to trip over
    assert len(r.captured_graph_ids()) == 5
