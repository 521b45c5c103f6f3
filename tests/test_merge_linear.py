"""Merged projections (runtime/compiled/merge_linear.py): the compiled path runs q/k/v and gate/up as one
GEMM each, on weights relaid end to end in place, with outputs equal to the model's own."""

import pytest
import torch

from graphplan.models.tiny_llama import TinyLlama, TinyLlamaConfig
from graphplan.runtime import CompiledModel

from compiling import Recording, batch

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

CFG = TinyLlamaConfig(
    vocab_size=128,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=96,
    max_model_len=48,
    num_cache_rows=8,
)


def test_tiny_llama_runs_qkv_and_gate_up_as_one_gemm_each_with_the_same_logits():
    model = TinyLlama(CFG, seed=0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = {n: model(**batch(model, n)).detach().clone() for n in (1, 3, 8)}
    rec = Recording()
    compiled = CompiledModel(model, rec)
    compiled.warm_up(batch(model, 8))
    assert compiled.stats()["merged_linears"] == 2 * CFG.layers
    assert rec.linears() == 4 * CFG.layers + 1  # 7 per layer before: q k v o gate up down; lm_head
    for n, logits in ref.items():
        torch.testing.assert_close(compiled(**batch(model, n)), logits, rtol=1e-5, atol=1e-5)
    # the parameters hold the same values, laid out end to end in one storage per group
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        ptr = {m.weight.untyped_storage().data_ptr() for m in group}
        assert len(ptr) == 1
        offsets = [m.weight.storage_offset() for m in group]
        sizes = [m.weight.numel() for m in group]
        assert offsets == [offsets[0] + sum(sizes[:i]) for i in range(len(group))]
    assert attn.o_proj.weight.storage_offset() == 0  # read its own input: left alone
    # eager code still runs on the relaid weights
    torch.testing.assert_close(model(**batch(model, 3)), ref[3], rtol=0, atol=0)


def test_a_second_compile_reuses_the_layout_and_merge_false_leaves_weights_alone():
    model = TinyLlama(CFG, seed=0)
    CompiledModel(model, "eager").warm_up(batch(model, 4))
    q = model.layers[1].attn.q_proj.weight
    ptr = q.data_ptr()
    again = CompiledModel(model, Recording())
    again.warm_up(batch(model, 4))
    assert again.merged == 2 * CFG.layers and q.data_ptr() == ptr  # not copied again

    other = TinyLlama(CFG, seed=0)
    ptrs = [p.data_ptr() for p in other.parameters()]
    rec = Recording()
    off = CompiledModel(other, rec, merge=False)
    off.warm_up(batch(other, 4))
    assert off.merged == 0 and rec.linears() == 7 * CFG.layers + 1
    assert [p.data_ptr() for p in other.parameters()] == ptrs


class Toy(torch.nn.Module):
    """Linears on one input with the cases the rules exclude."""

    def __init__(self, bias=True):
        super().__init__()
        self.a = torch.nn.Linear(8, 6, bias=bias)
        self.b = torch.nn.Linear(8, 4, bias=bias)
        self.nobias = torch.nn.Linear(8, 4, bias=False)  # bias-or-not differs from a's
        self.twice = torch.nn.Linear(8, 8, bias=bias)  # called twice: never merged
        self.wide = torch.nn.Linear(8, 3, bias=bias).double()  # another dtype

    def forward(self, x):
        y = self.twice(self.twice(x))
        return torch.cat(
            [self.a(x), self.b(x), self.nobias(x), y, self.wide(x.double()).float()], dim=-1
        )


def test_only_linears_of_one_kind_on_one_input_merge_and_biases_merge_with_them():
    torch.manual_seed(0)
    toy = Toy()
    x = torch.randn(5, 8)
    ref = toy(x).detach().clone()
    rec = Recording()
    compiled = CompiledModel(toy, rec)
    compiled.warm_up({"x": x})
    assert compiled.merged == 1  # a + b (with their biases)
    assert rec.linears() == 6 - 1  # a, b -> one; nobias, twice x2, wide unchanged
    assert toy.a.bias.untyped_storage().data_ptr() == toy.b.bias.untyped_storage().data_ptr()
    assert toy.twice.weight.storage_offset() == 0 and toy.nobias.weight.storage_offset() == 0
    for n in (1, 5, 9):
        xs = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x=xs), toy(xs), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(toy(x), ref, rtol=0, atol=0)


def test_a_compile_that_fails_on_the_merged_graph_gets_the_unmerged_one(caplog):
    class PicksyBackend(Recording):
        def __call__(self, gm, example_inputs):
            if any(n.op == "get_attr" for n in gm.graph.nodes):
                raise RuntimeError("no merged weights here")
            return super().__call__(gm, example_inputs)

    model = TinyLlama(CFG, seed=0)
    ref = model(**batch(model, 5)).detach().clone()
    rec = PicksyBackend()
    compiled = CompiledModel(model, rec)
    with caplog.at_level("WARNING", logger="graphplan.runtime"):
        compiled.warm_up(batch(model, 8))
    assert compiled.merged == 0 and compiled.compiles == 1
    assert rec.linears() == 7 * CFG.layers + 1
    assert "compiling it unmerged" in caplog.text and "no merged weights here" in caplog.text
    torch.testing.assert_close(compiled(**batch(model, 5)), ref, rtol=1e-5, atol=1e-5)
