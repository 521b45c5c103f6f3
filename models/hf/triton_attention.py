"""Paged attention in Triton: each token reads only its own request's KV blocks, so the cost
follows the real context, never ``max_model_len``. Graph-capturable: the grid depends only on the
token and request counts (and the device), every length and offset is read on the device.

    cache [2, num_blocks + 1, block_size, kv_heads, head_dim]   (one layer of paged_kv's tensor)
    q [T, H, D] (any strides, last dim contiguous), block_tables [R, B] int32, seq_lens [R] int32,
    query_start_loc [R + 1] int32  ->  out [T, H, D] in q's dtype (padded tokens: zeros)

A token at row t of request r (rows ``query_start_loc[r] .. query_start_loc[r + 1] - 1``, the
last one at position ``seq_lens[r] - 1``) attends to the keys at positions <= its own. Tokens past
``query_start_loc[R]`` belong to no request (padded rows) and get zeros. Scores and softmax in
float32; bf16/fp16 operands on the tensor cores, fp32 ones in IEEE float32.

- ``decode`` (any batch; the adapter uses it when every request has one row, T == R): one program
  per (token, K/V head, KV split). The query heads of a group are the rows of one tile (padded to
  16), so one K/V tile load serves the whole group. The keys are split into chunks whose length is
  derived on the device from the batch's total context (``_split_len``): about
  ``PROGRAMS_PER_SM`` programs per multiprocessor whatever the lengths, a long request beside
  short ones split more. Each split stores its normalised output and log2-sum-exp; ``_combine``
  merges them (a token with one split writes its output directly).
- ``prefill`` (varlen query chunks mixed with decodes): one program per block of ``BLOCK_Q``
  query tokens x the ``G`` query heads of one K/V head (``BLOCK_M`` rows), over the keys up to
  its last token's position, causal within the chunk. The grid ``T // BLOCK_Q + R`` bounds the
  number of query blocks; a program finds its request by a binary search over
  ``query_start_loc[r] // BLOCK_Q + r``.

One compiled variant of each kernel serves every token and request count of a layout (heads,
head_dim, block size, table width, dtype): the counts are runtime arguments, never specialised
(``VARYING``), and ``warm_up`` compiles and loads the variant before any capture.

Learned from (designs only, no code copied): vLLM ``vllm/v1/attention/ops/
triton_unified_attention.py`` (kernel_unified_attention_2d/3d and reduce_segments: query blocks x
the group's heads as one tile; the ``T // BLOCK_Q + R`` grid and its binary search; segments of
the KV sequence merged by their max and exp-sum) and SGLang ``python/sglang/srt/layers/attention/
triton_ops/decode_attention.py`` (_fwd_grouped_kernel_stage1/_fwd_kernel_stage2: grouped split-KV
decode with the heads padded to 16 rows, per-split log-sum-exp, a second kernel to combine, the
number of splits chosen on the device from the batch's lengths).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
PROGRAMS_PER_SM = 8
"""Decode programs per multiprocessor the split length aims at (more: shorter tails, more
partial results to combine)."""
MAX_SPLITS = 64
"""Most KV splits of one token (the grid's third dimension is at most this)."""
BLOCK_R = 128
"""Requests summed per step of the split length's loop over ``seq_lens``."""
NUM_WARPS = 4
NUM_STAGES = 2
VARYING = ["num_reqs", "target", "max_keys", "stride_qt", "stride_qh", "stride_ot", "stride_oh"]
"""Integer arguments that differ between batch shapes: not specialised (Triton compiles a variant
per value 1 and per divisibility by 16), so one compiled kernel serves every graph of a model and
nothing compiles or loads a module while a CUDA graph is being captured (see ``warm_up``)."""


@triton.jit
def _token_context(qsl_ptr, seq_lens_ptr, t, num_reqs, max_keys):
    """(request, keys it sees) of token row t; a padded row: (num_reqs, 0)."""
    lo = 0
    hi = num_reqs + 1
    while lo < hi:  # the largest r in [0, R] with query_start_loc[r] <= t
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) <= t:
            lo = mid + 1
        else:
            hi = mid
    r = lo - 1
    real = r < num_reqs
    rr = tl.minimum(r, num_reqs - 1)
    ctx = tl.load(seq_lens_ptr + rr) - tl.load(qsl_ptr + rr + 1) + t + 1
    return rr, tl.minimum(tl.maximum(tl.where(real, ctx, 0), 0), max_keys)


@triton.jit
def _split_len(seq_lens_ptr, num_reqs, ctx, target, num_splits, BLOCK_N: tl.constexpr,
               BLOCK_R: tl.constexpr):  # fmt: skip
    """Keys per split: the batch's total context over ``target`` programs, at least a tile, and
    enough that ``ctx`` needs at most ``num_splits`` splits."""
    total = 0
    for r0 in range(0, num_reqs, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        total += tl.sum(tl.load(seq_lens_ptr + r, mask=r < num_reqs, other=0), 0)
    want = tl.maximum((total + target - 1) // target, (ctx + num_splits - 1) // num_splits)
    return tl.maximum((want + BLOCK_N - 1) // BLOCK_N, 1) * BLOCK_N


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, n, n_ok, kv_off, d_ok, allowed, qk_scale,
                 stride_slot, PAGE: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One online-softmax step over keys n (positions) of a request: log2-domain scores."""
    page = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
    slot = (page * PAGE + n % PAGE) * stride_slot
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + slot[:, None] + kv_off[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_ptr + slot[:, None] + kv_off[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit(do_not_specialize=VARYING)
def _decode_kernel(out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_ptr, v_ptr, tables_ptr,
                   seq_lens_ptr, qsl_ptr, qk_scale, num_reqs, target, max_keys, stride_qt,
                   stride_qh, stride_ot, stride_oh, stride_slot, stride_table,
                   H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    r, ctx = _token_context(qsl_ptr, seq_lens_ptr, t, num_reqs, max_keys)
    chunk = _split_len(seq_lens_ptr, num_reqs, ctx, target, num_splits, BLOCK_N, BLOCK_R)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    head = kvh * G + g
    rows = (g < G)[:, None] & d_ok[None, :]
    o_ptrs = out_ptr + t * stride_ot + head[:, None] * stride_oh + d[None, :]
    start = split * chunk
    if (ctx == 0) & (split == 0):  # a padded row
        tl.store(o_ptrs, tl.zeros([BLOCK_G, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                 mask=rows)  # fmt: skip
    if start >= ctx:
        return
    end = tl.minimum(start + chunk, ctx)
    q = tl.load(
        q_ptr + t * stride_qt + head[:, None] * stride_qh + d[None, :], mask=rows, other=0.0
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + r.to(tl.int64) * stride_table
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, n, n_ok, kvh * D + d,
                                     d_ok, n_ok[None, :], qk_scale, stride_slot, PAGE,
                                     PRECISION)  # fmt: skip
    if ctx <= chunk:  # one split: the output itself
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=rows)
    else:
        part = (t * H + head).to(tl.int64) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * D + d[None, :], acc / l_i[:, None], mask=rows)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g < G)


@triton.jit(do_not_specialize=VARYING + ["num_splits"])
def _combine_kernel(out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, qsl_ptr, num_reqs, target,
                    max_keys, num_splits, stride_ot, stride_oh, H: tl.constexpr, D: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_R: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    _, ctx = _token_context(qsl_ptr, seq_lens_ptr, t, num_reqs, max_keys)
    chunk = _split_len(seq_lens_ptr, num_reqs, ctx, target, num_splits, BLOCK_N, BLOCK_R)
    n_splits = (ctx + chunk - 1) // chunk
    if n_splits <= 1:
        return
    s = tl.arange(0, SPLITS)
    s_ok = s < n_splits
    d = tl.arange(0, BLOCK_D)
    part = (t * H + h).to(tl.int64) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + part[:, None] * D + d[None, :],
                    mask=s_ok[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < D)  # fmt: skip


@triton.jit(do_not_specialize=VARYING)
def _prefill_kernel(out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, qk_scale,
                    num_reqs, max_keys, stride_qt, stride_qh, stride_ot, stride_oh, stride_slot,
                    stride_table, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    lo = 0
    hi = num_reqs
    while lo < hi:  # the largest r < R whose first query block index is <= pid
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    r = tl.maximum(lo - 1, 0)
    q_begin = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_begin
    first = (pid - q_begin // BLOCK_Q - r) * BLOCK_Q  # this block's first query of the request
    if first >= q_len:
        return
    past = tl.load(seq_lens_ptr + r) - q_len  # keys before the chunk
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tok = first + m // G
    head = kvh * G + m % G
    row_ok = (m < BLOCK_Q * G) & (tok < q_len)
    rows = row_ok[:, None] & d_ok[None, :]
    q_rows = (q_begin + tok) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=rows, other=0.0)
    last_key = past + tok  # each row sees the keys at positions <= its own
    key_end = tl.minimum(past + tl.minimum(first + BLOCK_Q, q_len), max_keys)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + r.to(tl.int64) * stride_table
    for n0 in range(0, key_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < key_end
        allowed = n_ok[None, :] & (n[None, :] <= last_key[:, None])
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, n, n_ok, kvh * D + d,
                                     d_ok, allowed, qk_scale, stride_slot, PAGE,
                                     PRECISION)  # fmt: skip
    o_rows = (q_begin + tok) * stride_ot + head * stride_oh
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out, mask=rows)


JIT_KERNELS = (_decode_kernel, _combine_kernel, _prefill_kernel)
"""The jitted kernels (a GPU test counts their compiled variants: one per layout)."""


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter (TRITON_INTERPRET=1) on a CPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def _layout(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor):
    num_tokens, num_heads, head_dim = q.shape
    _, _, page, kv_heads, d = cache.shape
    if d != head_dim or num_heads % kv_heads or q.stride(-1) != 1 or not cache.is_contiguous():
        raise ValueError(
            f"paged attention: q {tuple(q.shape)} (strides {q.stride()}) and cache "
            f"{tuple(cache.shape)} need the same head_dim, query heads a multiple of K/V heads, "
            "q's last dimension contiguous and a contiguous cache"
        )
    common = dict(
        G=num_heads // kv_heads,
        D=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    max_keys = block_tables.shape[1] * page
    return num_tokens, num_heads, kv_heads, max_keys, common


def num_splits(num_tokens: int, kv_heads: int, device: torch.device) -> int:
    """The decode grid's KV splits: enough programs to fill the device at short contexts."""
    want = triton.cdiv(PROGRAMS_PER_SM * 2 * _multiprocessors(device), num_tokens * kv_heads)
    return min(MAX_SPLITS, triton.next_power_of_2(max(want, 4)))


def decode(q, cache, block_tables, seq_lens, query_start_loc, scale, *, splits=None,
           programs_per_sm=None, block_n=None, num_stages=None):  # fmt: skip
    """Split-KV paged attention, one program per (token, K/V head, split); see the module doc."""
    num_tokens, num_heads, kv_heads, max_keys, common = _layout(q, cache, block_tables)
    num_reqs = block_tables.shape[0]
    splits = min(splits or num_splits(num_tokens, kv_heads, q.device), MAX_SPLITS)
    per_sm = programs_per_sm or PROGRAMS_PER_SM
    target = max(1, per_sm * _multiprocessors(q.device) // kv_heads)
    block_n = block_n or (64 if common["BLOCK_D"] <= 128 else 32)
    out = q.new_empty(num_tokens, num_heads, q.shape[2])
    part_out = q.new_empty(num_tokens, num_heads, splits, q.shape[2], dtype=torch.float32)
    part_lse = q.new_empty(num_tokens, num_heads, splits, dtype=torch.float32)
    _decode_kernel[(num_tokens, kv_heads, splits)](
        out, part_out, part_lse, q, cache[0], cache[1], block_tables, seq_lens, query_start_loc,
        scale * LOG2E, num_reqs, target, max_keys, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), cache.stride(2), block_tables.stride(0), H=num_heads,
        BLOCK_G=max(16, triton.next_power_of_2(common["G"])), BLOCK_N=block_n, BLOCK_R=BLOCK_R,
        num_warps=NUM_WARPS, num_stages=num_stages or NUM_STAGES, **common,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(num_tokens, num_heads)](
            out, part_out, part_lse, seq_lens, query_start_loc, num_reqs, target, max_keys, splits,
            out.stride(0), out.stride(1), H=num_heads, D=common["D"], BLOCK_D=common["BLOCK_D"],
            BLOCK_N=block_n, SPLITS=MAX_SPLITS, BLOCK_R=BLOCK_R, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


def prefill(q, cache, block_tables, seq_lens, query_start_loc, scale, *, block_m=None,
            block_n=None, num_stages=None):  # fmt: skip
    """Paged attention over varlen query chunks (prefill and decode rows mixed), causal."""
    num_tokens, num_heads, kv_heads, max_keys, common = _layout(q, cache, block_tables)
    num_reqs = block_tables.shape[0]
    group = common["G"]
    block_m = block_m or max(64, triton.next_power_of_2(group))
    block_q = max(1, block_m // group)
    block_n = block_n or (64 if common["BLOCK_D"] <= 128 else 32)
    out = q.new_zeros(num_tokens, num_heads, q.shape[2])  # padded rows stay zero
    _prefill_kernel[(num_tokens // block_q + num_reqs, kv_heads)](
        out, q, cache[0], cache[1], block_tables, seq_lens, query_start_loc, scale * LOG2E,
        num_reqs, max_keys, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(2), block_tables.stride(0), BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, num_warps=NUM_WARPS, num_stages=num_stages or NUM_STAGES, **common,
    )  # fmt: skip
    return out


_WARM: set[tuple] = set()
"""The layouts ``warm_up`` has compiled and loaded both kernels for."""


def _layout_key(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor) -> tuple:
    """What selects the compiled kernels: everything else is a runtime argument (``VARYING``)."""
    return (q.device, q.dtype, q.shape[1:], cache.shape[2:], block_tables.shape[1])


def warm_up(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    """Compile and load the kernels that serve ``q``'s and ``cache``'s layout (any token and
    request count), by running both on a two-request batch of this layout. A CUDA graph capture
    must not be the first call of a layout: loading a compiled module is not permitted while a
    stream is capturing. ``paged_attention`` does this by itself on its first (eager) call."""
    _, num_heads, head_dim = q.shape
    page, kv_heads = cache.shape[2], cache.shape[3]
    tiny = q.new_zeros(2, 3, page, kv_heads, head_dim)  # blocks 0, 1 and the padding block
    tables = torch.full((2, block_tables.shape[1]), 2, dtype=torch.int32, device=q.device)
    tables[:, 0] = torch.arange(2, dtype=torch.int32, device=q.device)
    seq_lens = torch.tensor([1, 2], dtype=torch.int32, device=q.device)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=q.device)
    rows = q.new_zeros(3, num_heads, head_dim)
    decode(rows[:2], tiny, tables, seq_lens, starts, 1.0)
    # int32 offsets, as the runner's buffers hold them (an int64 sum would warm another variant)
    chunks = torch.tensor([0, 1, 3], dtype=torch.int32, device=q.device)
    prefill(rows, tiny, tables, seq_lens, chunks, 1.0)
    _WARM.add(_layout_key(q, cache, block_tables))


def paged_attention(q, cache, block_tables, seq_lens, query_start_loc, scale):
    """``decode`` when the batch has a row per request (T == R: uniform decode, padded or not),
    else ``prefill``; both are right for any batch, the choice is speed (static per shape)."""
    if _layout_key(q, cache, block_tables) not in _WARM:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "paged attention: the first call for this layout is inside a CUDA graph capture, "
                "where Triton cannot load its kernels; run one eager step first (the runner's "
                "warm-up does), or call triton_attention.warm_up before capturing"
            )
        warm_up(q, cache, block_tables)
    if q.shape[0] == block_tables.shape[0]:
        return decode(q, cache, block_tables, seq_lens, query_start_loc, scale)
    return prefill(q, cache, block_tables, seq_lens, query_start_loc, scale)
