"""models/hf/kv_write.py: the cache write as one custom op equals the two index_copy_ calls, and
under torch.compile (inductor, CPU) stays in place, where the index_copy_ form copies the layer's
whole K/V slice every call (the compiled path's 2.8x at 8B)."""

import math
import re

import torch

from graphplan.models.hf.kv_write import write_kv

LAYERS, SLOTS, KVH, D = 3, 96, 2, 8


def index_copy_form(kv, layer: int, slots, key, value):
    cache = kv[layer].view(2, -1, KVH, D)
    cache[0].index_copy_(0, slots, key)
    cache[1].index_copy_(0, slots, value)
    return kv.sum()


def op_form(kv, layer: int, slots, key, value):
    write_kv(kv[layer], slots, key, value)
    return kv.sum()


def inputs(tokens: int = 5):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYERS, 2, SLOTS, KVH, D, generator=gen)
    slots = torch.randperm(SLOTS, generator=gen)[:tokens]
    return kv, slots, torch.randn(tokens, KVH, D, generator=gen), torch.randn(tokens, KVH, D)


def test_write_kv_writes_each_tokens_slot_of_one_layer_and_nothing_else():
    kv, slots, key, value = inputs()
    want = kv.clone()
    index_copy_form(want, 1, slots, key, value)
    op_form(kv, 1, slots, key, value)
    assert torch.equal(kv, want)
    assert torch.equal(kv[1, 0, slots], key) and torch.equal(kv[1, 1, slots], value)


def cache_sized_buffers(fn) -> list[tuple[int, ...]]:
    """Shapes of the buffers, at least one layer's K (SLOTS x KVH x D elements), that inductor's
    code for ``fn`` allocates; also checks that the compiled ``fn`` writes what eager ``fn`` does."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    kv, slots, key, value = inputs()
    want = kv.clone()
    fn(want, 2, slots, key, value)
    try:
        _, codes = run_and_get_code(
            # scalar C++ as tests/test_compiled.py compiles: in one process inductor's C++ header
            # is built once, and a vectorised kernel after a scalar one fails to compile
            torch.compile(fn, fullgraph=True, options={"cpp.vec_isa_ok": False}),
            kv,
            2,
            slots,
            key,
            value,
        )
    finally:
        torch._dynamo.reset()
    assert torch.equal(kv, want)
    shapes = re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", "\n".join(codes))
    sizes = [tuple(int(d) for d in s.split(",") if d.strip()) for s in shapes]
    return [z for z in sizes if math.prod(z) >= SLOTS * KVH * D]


def test_compiled_index_copy_on_the_cache_copies_it_and_write_kv_does_not():
    """The index_copy_ form's compiled code copies the whole pool (or the layer slice) around the
    write; write_kv's calls the op on the cache in place. The first assertion documents torch's
    behaviour (2.11-2.13): if it fails, torch re-inplaces the write itself now."""
    assert cache_sized_buffers(index_copy_form)
    assert cache_sized_buffers(op_form) == []


def test_the_adapters_compiled_step_writes_the_cache_through_write_kv(tmp_path):
    """What torch.compile traces of PagedCausalLM's step holds the cache write as graphplan's op,
    not index_copy_ (which inductor would turn into copies of each layer's whole K/V, above)."""
    from graphplan.models.hf import PagedCausalLM, load_model

    from hf_models import small_config

    load_model(
        small_config("llama"), seed=0, attn_implementation="eager", random_weights=True
    ).save_pretrained(tmp_path)
    model = PagedCausalLM.load(tmp_path, max_num_seqs=2, max_model_len=16, block_size=4)
    targets: list[str] = []

    def record(gm, example_inputs):
        targets.extend(
            str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")
        )
        return gm.forward

    batch = model.make_batch([(0, 0, [1, 2, 3]), (1, 0, [4, 5])])
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend=record)(**batch)
    finally:
        torch._dynamo.reset()
    writes = [t for t in targets if "write_kv" in t]
    assert len(writes) == model.hf.config.num_hidden_layers, targets
    assert not [t for t in targets if "index_copy" in t]
