"""Paged attention on the CPU: the torch path (and, where Triton is installed, the Triton kernels
under its interpreter) against a dense float64 reference, on shuffled block tables, ragged
lengths, GQA, decode and mixed batches with padded rows and requests. Every slot a request does not
own holds NaN (tests/paged_cases.py), so reading one shows as a NaN in the output. Then the adapter
end to end: a small Llama saved with save_pretrained, served by PagedCausalLM through the runner,
against transformers' own eager forward (logits) and generate (greedy tokens).

Tolerances: float32 through the torch path lands within 1e-5 of the float64 reference (relative
norm; observed ~1e-7); under the Triton interpreter float32 within 1e-5 and float16 within 2e-3
(the probabilities are rounded to float16 before the P.V product, as on the GPU); the adapter's
float32 logits within atol = rtol = 1e-4 of transformers', its greedy tokens identical.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from interpreted import run_interpreted
from paged_cases import dense_reference, make_case, relative_error

from graphplan.models.hf import attention
from graphplan.models.hf.attention import attend_torch, make_paged_batch, paged_attention
from graphplan.models.paged_kv import BlockTables

DECODE = dict(seq_lens=[7, 1, 40, 16, 23], q_lens=[1, 1, 1, 1, 1])
MIXED = dict(seq_lens=[9, 33, 1, 20, 12], q_lens=[9, 1, 1, 6, 3])


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("batch", [DECODE, MIXED], ids=["decode", "mixed"])
def test_torch_path_equals_dense_causal_attention_over_each_requests_own_blocks(group, batch):
    case = make_case(**batch, group=group, pad_tokens=3, pad_reqs=2, seed=group)
    out = attend_torch(*case.inputs())
    assert relative_error(out, dense_reference(case)) < 1e-5
    assert torch.equal(out[case.padded_rows], torch.zeros_like(out[case.padded_rows]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 8)).map(lambda t: (t[0], min(t[1], t[0]))),
        min_size=1,
        max_size=5,
    ),
    page=st.sampled_from([1, 2, 4, 16]),
    group=st.sampled_from([1, 2, 4]),
    pad=st.tuples(st.integers(0, 3), st.integers(0, 2)),
    spare=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_any_block_table_addresses_exactly_the_requests_own_keys(
    reqs, page, group, pad, spare, seed
):
    """Property: whatever the block size, the order of the blocks, the spare blocks and columns
    and the padding, each row attends to its own request's keys up to its position, no others."""
    seq_lens, q_lens = [s for s, _ in reqs], [n for _, n in reqs]
    need = sum(-(-s // page) for s in seq_lens)
    case = make_case(
        seq_lens,
        q_lens,
        group=group,
        page=page,
        pad_tokens=pad[0],
        pad_reqs=pad[1],
        num_blocks=need + spare,
        max_blocks=max(-(-s // page) for s in seq_lens) + spare % 3,
        seed=seed,
    )
    out = attend_torch(*case.inputs())
    assert relative_error(out, dense_reference(case)) < 1e-5


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 3, 4, 16]),
    grows=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20)), min_size=1, max_size=20),
)
def test_a_slot_the_cache_writes_is_the_slot_its_block_table_reads(block_size, grows):
    """Property (paged_kv.BlockTables): the slot make_batch writes a position to is
    ``row[p // block_size] * block_size + p % block_size``, the address the kernels read, and no
    two live positions share a slot."""
    tables = BlockTables(
        num_blocks=4 * 80, block_size=block_size, num_seats=4, max_blocks_per_seq=80
    )
    length = [0] * 4
    for seat, n in grows:
        if length[seat] + n > 80 * block_size:
            continue
        tables.reserve(seat, length[seat], n)
        slots = tables.slots(seat, length[seat], n)
        row = tables.row(seat)
        for p, slot in zip(range(length[seat], length[seat] + n), slots):
            assert slot == row[p // block_size] * block_size + p % block_size
        length[seat] += n
    live = [s for seat in range(4) for s in tables.slots(seat, 0, length[seat])]
    assert len(live) == len(set(live))


class _Layer:
    layer_idx = 1


def test_the_registered_function_writes_this_steps_kv_then_attends_over_it():
    """paged_attention as transformers calls it: query [1, H, T, D], key/value [1, KvH, T, D]; the
    step's K/V land at slot_mapping, nothing else in the cache moves, and the output equals the
    dense reference over the whole context."""
    case = make_case(**MIXED, group=4, pad_tokens=2, pad_reqs=1, seed=3)
    kv = torch.stack([torch.zeros_like(case.cache), case.cache, torch.zeros_like(case.cache)])
    page = case.cache.shape[2]
    rows, slots = [], []
    starts = case.query_start_loc.tolist()
    for r, s in enumerate(case.seq_lens.tolist()[: len(case.keys)]):
        for i, p in enumerate(range(s - (starts[r + 1] - starts[r]), s)):
            rows.append((r, p, starts[r] + i))
            slots.append(int(case.block_tables[r, p // page]) * page + p % page)
    pad_slot = (case.cache.shape[1] - 1) * page
    slot_mapping = torch.tensor(slots + [pad_slot] * 2)
    key = torch.randn(1, case.cache.shape[3], case.q.shape[0], case.q.shape[2])
    value = torch.randn_like(key)
    keys, values = [k.clone() for k in case.keys], [v.clone() for v in case.values]
    for r, p, t in rows:  # the step's own K/V replace what the case put there
        keys[r][p], values[r][p] = key[0, :, t], value[0, :, t]
    before = kv.clone()
    batch = make_paged_batch(
        kv, None, slot_mapping, case.block_tables, case.seq_lens, case.query_start_loc
    )
    query = case.q.transpose(0, 1)[None]
    out, weights = paged_attention(
        _Layer(), query, key, value, None, scaling=case.scale, graphplan=batch
    )
    assert weights is None and out.shape == (1, *case.q.shape)
    expect = dense_reference(dataclasses.replace(case, keys=tuple(keys), values=tuple(values)))
    assert relative_error(out[0], expect) < 1e-5
    changed = (kv != before) & ~(kv.isnan() & before.isnan())
    layer_slots = changed[1].flatten(1, 2).any(-1).any(-1).any(0).nonzero().flatten().tolist()
    assert set(layer_slots) <= set(slots) | {pad_slot} and not changed[[0, 2]].any()


def test_the_torch_path_matches_transformers_own_sdpa_attention_on_one_prompt():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    case = make_case([13], [13], group=4, page=4, seed=7)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    k, v = (x.transpose(0, 1)[None] for x in (case.keys[0], case.values[0]))
    want, _ = sdpa_attention_forward(
        module, case.q.transpose(0, 1)[None], k, v, None, scaling=case.scale
    )
    got = attend_torch(*case.inputs())
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


def test_the_compiled_path_sees_one_opaque_op_with_a_consistent_fake():
    case = make_case(**MIXED, group=2, pad_tokens=1, seed=5)
    torch.library.opcheck(attention.paged_attend, case.inputs())


# -- the adapter against transformers' own forward -----------------------------------------------
# A small Llama saved with save_pretrained, loaded back by PagedCausalLM and by transformers:
# random weights with the attention's projections scaled up (hf_models.sharpen_attention), so
# that the context, not only the last token, moves the logits.
# Request 3 is a filler whose blocks go back to the pool after the first step; the pool holds
# exactly the blocks the three requests need, so the filler's (lowest) blocks are handed out last
# and the block tables end up out of order as well as non-contiguous.

LENS = (25, 7, 12)  # request 0: a 13-token prompt in chunks of 5 and 8; 1: a 1-token prompt;
FILLER = 12  # 2: an 8-token prompt in chunks of 3 and 5, beside decodes
SCHEDULE = [
    [(3, FILLER), (0, 5)],
    "release 3",
    [(1, 1), (0, 8), (2, 3)],  # a one-token prompt, the rest of a prompt, a first chunk
    [(0, 1), (2, 5), (1, 1)],  # decodes around a prompt chunk
    *[[(0, 1), (1, 1), (2, 1)]] * 4,  # uniform decode of 3: a FULL graph of 4
    [(1, 1), (0, 1)],
    *[[(0, 1)]] * 6,
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from graphplan.models.hf import load_model

    from hf_models import sharpen_attention, small_config

    path = tmp_path_factory.mktemp("llama")
    config = small_config("llama", layers=2, heads=4, kv_heads=2)
    model = load_model(config, seed=5, attn_implementation="eager", random_weights=True)
    sharpen_attention(model).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def transformers_llama(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        llama_dir, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval().requires_grad_(False)


def paged_llama(path, block_size: int, pool_tokens: int):
    from graphplan.compiler import compile_plan
    from graphplan.models.hf import PagedCausalLM
    from graphplan.runtime import GraphRunner

    from hf_models import plan

    model = PagedCausalLM.load(
        path, max_num_seqs=4, max_model_len=32, block_size=block_size, kv_cache_tokens=pool_tokens
    )
    runner = GraphRunner(model, compile_plan(plan()), model.static_inputs(), progress=False)
    runner.capture()
    return model, runner


def blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@torch.no_grad()
def test_mixed_and_decode_steps_over_scattered_blocks_give_transformers_logits(
    llama_dir, transformers_llama, block_size
):
    """Teacher-forced: every position's logits equal transformers' forward over the request's
    whole sequence (float32, atol = rtol = 1e-4), through prompt chunks of 1, 3, 5 and 8 tokens
    mixed with decodes, FULL decode graphs with a padded request, contexts landing exactly on a
    block boundary (8, 12, 16 tokens) and block tables out of order."""
    from hf_models import reference_logits, tokens

    need = sum(blocks(n, block_size) for n in LENS)
    model, runner = paged_llama(llama_dir, block_size, need * block_size)
    seqs = [tokens(n, seed=40 + i) for i, n in enumerate(LENS)] + [tokens(FILLER, seed=9)]
    done, got = [0] * 4, [[] for _ in range(4)]
    for step in SCHEDULE:
        if step == "release 3":
            model.release(3)
            continue
        reqs = [(i, done[i], seqs[i][done[i] : done[i] + n]) for i, n in step]
        assert all(len(r[2]) == n for r, (_, n) in zip(reqs, step)), "the schedule overruns"
        batch = model.make_batch(reqs)
        logits = runner.step(batch, num_reqs=len(reqs), max_query_len=max(n for _, n in step))
        first = 0
        for i, n in step:
            got[i].append(logits[first : first + n].clone())  # views: valid until the next step
            done[i] += n
            first += n
    assert done[:3] == list(LENS)
    tables = [model.tables.row(i)[: blocks(n, block_size)] for i, n in enumerate(LENS)]
    assert any(t != sorted(t) for t in tables), tables  # the filler's blocks came last
    for i in range(3):
        want = reference_logits(transformers_llama, seqs[i])
        torch.testing.assert_close(torch.cat(got[i]), want, atol=1e-4, rtol=1e-4)
    moved = seqs[0][:1] + [(seqs[0][1] + 1) % 128] + seqs[0][2:]
    last = (
        reference_logits(transformers_llama, moved)[-1]
        - reference_logits(transformers_llama, seqs[0])[-1]
    )
    assert last.abs().max() > 0.05  # the context matters: a kernel that dropped it would fail


@pytest.mark.parametrize("block_size", [1, 4])
@torch.no_grad()
def test_greedy_tokens_equal_transformers_generate_with_a_pool_that_preempts(
    llama_dir, transformers_llama, block_size
):
    """The batcher over the runner with a pool of one max_model_len sequence and a budget of 5
    tokens a step (prompts cut into chunks; requests preempted and recomputed into other blocks):
    every request's greedy tokens are those of transformers' generate."""
    from graphplan.server.core.batching import ContinuousBatcher

    from hf_models import generated, serve_greedy, tokens

    model, runner = paged_llama(llama_dir, block_size, 32)
    prompts = [tokens(n, seed=60 + n) for n in (7, 1, 11, 4)]
    batcher = ContinuousBatcher(
        max_num_seqs=4, token_budget=5, max_model_len=32, num_cache_rows=4, kv_pool=model.kv_pool
    )
    serve_greedy(model, runner, batcher, prompts, 10)
    assert batcher.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert batcher.finished[i] == generated(transformers_llama, p, 10), f"prompt {i}"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_attention_benchmarks_layouts_hold_the_same_attention():
    """bench/paged_attention_bench.py (GPU-only) times each method in its own layout; on the CPU,
    in float32, each layout must give the same output as the contiguous floor: the paged pool
    (through the torch path), the old gather over max_model_len slots and FlexAttention's block
    mask (its eager reference), with a context that ends inside a block."""
    import paged_attention_bench as bench

    gen = torch.Generator().manual_seed(0)
    for batch, ctx, mml in [(3, 200, 512), (1, 1, 256)]:
        d = bench.build(batch, ctx, mml, gen, dtype=torch.float32)
        floor = bench.run_floor(d, ctx, mml)()
        paged = attend_torch(d["q"], d["pool"], d["tables"], d["seq_lens"], d["qsl"], 128**-0.5)
        for out in (paged, bench.run_gather(d, ctx, mml)(), bench.run_flex(d, ctx, mml, False)()):
            torch.testing.assert_close(out, floor, atol=1e-5, rtol=1e-5)


# -- the Triton kernels under the interpreter ----------------------------------------------------


INTERPRETER_SECONDS = 60
"""The interpreted tests take ~12 s on this project's 2-core CPU machine; past this, skipped."""


@pytest.mark.slow
def test_the_triton_kernels_under_the_interpreter_equal_the_dense_reference():
    """tests/triton_interpreted.py in a fresh process with TRITON_INTERPRET=1 (tests/interpreted.py).
    Skipped without Triton, or when the interpreter is too slow here."""
    run_interpreted("triton_interpreted.py", timeout=INTERPRETER_SECONDS)


def test_the_warm_up_calls_each_kernel_with_the_runners_int32_metadata(monkeypatch):
    """Triton compiles a variant per argument dtype: the warm-up must pass the dtypes a step
    passes (int32 tables, lengths and offsets), or the first real call, perhaps inside a CUDA
    graph capture, compiles another (the H100 run found an int64 offsets tensor here)."""
    kernels = pytest.importorskip("graphplan.models.hf.triton_attention")
    seen = []
    for name in ("decode", "prefill"):
        monkeypatch.setattr(
            kernels, name, lambda q, cache, *meta, _n=name, **kw: seen.append((_n, meta[:3]))
        )
    q = torch.zeros(4, 8, 16)
    kernels.warm_up(q, torch.zeros(2, 5, 4, 2, 16), torch.zeros(4, 3, dtype=torch.int32))
    assert [n for n, _ in seen] == ["decode", "prefill"]
    assert all(t.dtype == torch.int32 for _, meta in seen for t in meta), seen
