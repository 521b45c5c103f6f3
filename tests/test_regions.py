"""Regional compilation (runtime/compiled/regions.py): a model's repeated layers compiled once, the graph cut
after matmuls so that nothing that fuses is cut apart, outputs equal to the model's own."""

import logging
import operator

import pytest
import torch

from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig
from graphplan.runtime import CompiledModel
from graphplan.runtime.compiled.regions import split

from compiling import Recording, batch

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

CFG = TinyLlamaConfig(
    vocab_size=128,
    hidden=64,
    layers=4,
    heads=4,
    kv_heads=2,
    intermediate=96,
    max_model_len=48,
    num_cache_rows=8,
)


def test_tiny_llama_compiles_head_attention_mlp_and_tail_once_with_the_same_logits():
    model = TinyLlama(CFG, seed=0)
    eager = TinyLlama(CFG, seed=0)
    rec = Recording()
    compiled = CompiledModel(model, rec)
    compiled.warm_up(batch(model, 8))
    # head (embeddings, layer 0's attention), then per layer an MLP half and the next layer's
    # attention half, then the tail: 2 * layers + 1 regions, 4 distinct ones compiled
    assert (compiled.regions, compiled.region_compiles) == (2 * CFG.layers + 1, 4)
    assert len(rec.graphs) == 4 and compiled.compiles == 1
    for n in (1, 3, 8):
        torch.testing.assert_close(
            compiled(**batch(model, n)), eager(**batch(eager, n)), rtol=1e-5, atol=1e-5
        )
    torch.testing.assert_close(model.kv_cache, eager.kv_cache, rtol=1e-5, atol=1e-5)
    assert compiled.recompiles == 0


def dynamo_graph(model, inputs):
    """The graph dynamo hands the backend (merged projections included)."""
    rec = Recording()
    CompiledModel(model, rec, regional=False).warm_up(inputs)
    return rec.graphs[0]


def test_cuts_go_after_matmuls_and_cache_views_are_taken_outside():
    model = TinyLlama(CFG, seed=0)
    gm = dynamo_graph(model, batch(model, 4))
    outside, regions = split(gm)
    assert len(regions) == 2 * CFG.layers + 1
    for r in regions[:-1]:  # each ends with its layer's o_proj or down_proj GEMM
        assert r[-1].target is torch._C._nn.linear, r[-1]
    for r in regions[1:]:  # each starts with the residual add the previous region's GEMM feeds
        assert r[0].target is operator.add, r[0]
    kv = next(n for n in gm.graph.nodes if n.op == "placeholder" and "kv_cache" in n.name)
    views = [u for u in kv.users]
    assert len(views) == CFG.layers and all(v in outside for v in views)  # kv_cache[i]
    assert all(n not in outside for r in regions for n in r)
    assert split(dynamo_graph(TinyLlama(CFG, seed=0), batch(model, 4)), min_layers=5) is None


class CacheLayer(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.k = torch.nn.Linear(d, d, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)

    def forward(self, x, cache, keys, slots):
        keys.index_copy_(0, slots, self.k(x))
        cache[1].index_copy_(0, slots, x * 2)
        return x + self.o(cache[0, : x.shape[0]] * cache[1, : x.shape[0]])


class TwoViewModel(torch.nn.Module):
    """Each layer writes and reads two overlapping views of one cache, ``cache[i]`` and
    ``cache[i, 0]``: two inputs of a region that share memory, at offsets that differ by layer
    (as the HF adapter's paged cache does)."""

    def __init__(self, layers=4, d=8, slots=16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(CacheLayer(d) for _ in range(layers))
        self.register_buffer("cache", torch.zeros(layers, 2, slots, d))
        self.requires_grad_(False)

    def forward(self, x, slots):
        for i, layer in enumerate(self.layers):
            x = layer(x, self.cache[i], self.cache[i, 0], slots)
        return x


def test_regions_whose_inputs_share_memory_at_other_offsets_do_not_share_compiled_code():
    model, eager = TwoViewModel(), TwoViewModel()
    compiled = CompiledModel(model, "aot_eager", merge=False)
    for n in (6, 3, 1):
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
        slots = torch.arange(n) * 2
        torch.testing.assert_close(
            compiled(x=x, slots=slots), eager(x, slots), rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(model.cache, eager.cache, rtol=1e-6, atol=1e-6)
    # regions: layer 0's k GEMM; per layer, the cache writes and reads up to the o GEMM; between
    # layers, the residual add and the next k GEMM; the last add. Layer i's two cache views lie
    # at offsets of its own (code compiled for layer 1 would write layer 1's cache when run for
    # layer 2), so each layer's cache region compiles for itself; the add + k regions share one
    assert (compiled.regions, compiled.region_compiles) == (9, 1 + 4 + 1 + 1)


def test_fewer_than_three_layers_and_regional_false_compile_the_whole_graph():
    two = TinyLlama(
        TinyLlamaConfig(
            vocab_size=128,
            hidden=64,
            layers=2,
            heads=4,
            kv_heads=2,
            intermediate=96,
            max_model_len=48,
            num_cache_rows=8,
        ),
        seed=0,
    )
    compiled = CompiledModel(two, "aot_eager")
    compiled.warm_up(batch(two, 4))
    assert (compiled.regions, compiled.region_compiles, compiled.compiles) == (0, 0, 1)
    model = TinyLlama(CFG, seed=0)
    whole = CompiledModel(model, "aot_eager", regional=False)
    whole.warm_up(batch(model, 4))
    assert (whole.regions, whole.region_compiles) == (0, 0)
    assert whole.stats()["regions"] == 0


def test_a_backend_that_fails_on_regions_gets_the_whole_graph(caplog):
    model = TinyLlama(CFG, seed=0)
    ref = TinyLlama(CFG, seed=0)(**batch(model, 3))
    rec = Recording(whole_only=True)
    compiled = CompiledModel(model, rec)
    with caplog.at_level(logging.WARNING, logger="graphplan.runtime"):
        compiled.warm_up(batch(model, 8))
    assert (
        "compiling this graph region by region failed (RuntimeError: this backend takes "
        "whole graphs only); compiling it whole" in caplog.text
    )
    assert (compiled.regions, compiled.compiles, len(rec.graphs)) == (0, 1, 1)
    assert compiled.merged == 2 * CFG.layers
    torch.testing.assert_close(compiled(**batch(model, 3)), ref, rtol=1e-5, atol=1e-5)
