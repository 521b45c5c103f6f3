"""A tiny Llama-style model with a slot-based KV cache, capturable by CUDA graphs.

Random weights from a fixed seed. The graphplan runtime captures and replays it; `reference_generate`
runs it eagerly as ground truth.

Per-step metadata (what the runtime keeps in static buffers), T tokens of R requests:
  input_ids [T] int64, positions [T] int64,
  slot_mapping [T] int64    where each token's K/V goes: slot = row * max_model_len + position,
  seq_lens [R], query_start_loc [R + 1]   (int32 or int64).
The model reads only input_ids, positions and slot_mapping: a token attends to the keys of its own
cache row (slot // max_model_len) at positions <= its own, so stale data past it is masked. seq_lens
and query_start_loc are accepted (the runtime passes them) and ignored. Padding tokens are
(token 0, position 0, dummy_slot): they write and read only the dummy row, never a real one.
Logits are float32.

    python models/tiny_llama.py [--device cuda] [--new-tokens 16]
"""

import argparse
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyLlamaConfig:
    vocab_size: int = 4096
    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2  # grouped-query attention: heads // kv_heads query heads share one K/V head
    intermediate: int = 1408
    max_model_len: int = 256  # positions per request = columns of a cache row
    num_cache_rows: int = 64  # live sequences; one more row (index num_cache_rows) is the dummy
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def sized(cls, *, hidden: int, layers: int, **rest) -> "TinyLlamaConfig":
        """A config shaped from its hidden size: 64-wide heads, a K/V head per 4 query heads
        (at least one of each), SwiGLU intermediate 3 x hidden."""
        return cls(
            hidden=hidden,
            layers=layers,
            heads=max(hidden // 64, 1),
            kv_heads=max(hidden // 256, 1),
            intermediate=hidden * 3,
            **rest,
        )


# ---- attention core: one custom op, where piecewise graphs split the forward ----


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Writes k, v at slot_mapping, then attends each token over its own cache row.

    q [T, H, D], k/v [T, KvH, D], kv_cache [2, rows + 1, S, KvH, D] (mutated),
    slot_mapping/positions [T]. Returns [T, H, D]. No host syncs, shapes depend only on T.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, max_len, kv_heads, _ = kv_cache.shape
    flat = kv_cache.view(2, -1, kv_heads, head_dim)  # [2, (rows + 1) * S, KvH, D]
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
    rows = torch.div(slot_mapping, max_len, rounding_mode="floor")  # [T]
    keys = kv_cache[0].index_select(0, rows)  # [T, S, KvH, D]
    values = kv_cache[1].index_select(0, rows)  # [T, S, KvH, D]
    qg = q.reshape(num_tokens, kv_heads, num_heads // kv_heads, head_dim) * head_dim**-0.5
    scores = torch.einsum("tkgd,tskd->tkgs", qg, keys).float()  # [T, KvH, G, S]
    future = torch.arange(max_len, device=q.device) > positions[:, None]  # [T, S]
    scores = scores.masked_fill(future[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    out = torch.einsum("tkgs,tskd->tkgd", probs, values)  # [T, KvH, G, D]
    return out.reshape(num_tokens, num_heads, head_dim)


def _attention_fake(q, k, v, kv_cache, slot_mapping, positions):
    return torch.empty_like(q)


# Guarded: importing this file under two module names must not register the op twice.
if not hasattr(torch.ops.tiny_llama, "attention"):
    torch.library.custom_op("tiny_llama::attention", _attention, mutates_args=("kv_cache",))
    torch.library.register_fake("tiny_llama::attention", _attention_fake)
ATTENTION_OP = torch.ops.tiny_llama.attention.default  # the op piecewise graphs split at


# ---- modules ----


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_tables(cfg: TinyLlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin, each [max_model_len, head_dim // 2] float32."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(cfg.max_model_len, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin, half: int):
    """x [T, H, D]; cos/sin [T, 1, D/2]. Rotates the two halves of each head (Llama layout)."""
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x, cos, sin, kv_cache, slot_mapping, positions):
        half = self.head_dim // 2
        q = apply_rope(self.q_proj(x).view(-1, self.heads, self.head_dim), cos, sin, half)
        k = apply_rope(self.k_proj(x).view(-1, self.kv_heads, self.head_dim), cos, sin, half)
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        out = ATTENTION_OP(q, k, v, kv_cache, slot_mapping, positions)  # [T, H, D]
        return self.o_proj(out.view(-1, self.heads * self.head_dim))  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_cache, slot_mapping, positions):
        x = x + self.attn(self.input_norm(x), cos, sin, kv_cache, slot_mapping, positions)
        return x + self.mlp(self.post_attn_norm(x))


class TinyLlama(nn.Module):
    """Inference-only (no grads). Owns its KV cache `kv_cache`
    [layers, 2, num_cache_rows + 1, max_model_len, kv_heads, head_dim] in the model dtype.
    A ``graphplan.models.Model``: ids only (no tokenizer), no end-of-sequence token."""

    tokenizer = None
    kv_cache: torch.Tensor  # a buffer, registered in __init__

    def __init__(
        self,
        cfg: TinyLlamaConfig = TinyLlamaConfig(),
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.cfg = cfg
        with torch.device("meta"):  # allocate once on the target device, init from a CPU generator
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
            self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)  # untied
        self.to_empty(device=device).to(dtype)
        init_weights(self, seed)
        self.requires_grad_(False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        shape = (
            cfg.layers,
            2,
            cfg.num_cache_rows + 1,
            cfg.max_model_len,
            cfg.kv_heads,
            cfg.head_dim,
        )
        self.register_buffer(
            "kv_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    def slot(self, row: int, pos: int) -> int:
        return row * self.cfg.max_model_len + pos

    @property
    def dummy_slot(self) -> int:
        """Where padding tokens write: position 0 of the extra row num_cache_rows."""
        return self.slot(self.cfg.num_cache_rows, 0)

    kv_pool = None
    """One cache row per seat at max_model_len: no blocks to hand out (``server.batching``)."""

    def forward(self, input_ids, positions, slot_mapping, seq_lens, query_start_loc):
        """input_ids/positions/slot_mapping [T] int64 -> logits [T, vocab] float32.
        seq_lens [R] and query_start_loc [R + 1] are unused (see module docstring)."""
        x = self.embed(input_ids)  # [T, hidden]
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.rope_sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, self.kv_cache[i], slot_mapping, positions)
        return self.lm_head(self.norm(x)).float()

    # -- the Model protocol (the module functions below stay for existing callers) ----------
    def make_batch(self, reqs) -> dict[str, torch.Tensor]:
        """``(cache_row, start_pos, token_ids)`` per request -> forward's keyword arguments."""
        return make_batch(self, reqs)

    def static_inputs(self) -> list:
        return static_inputs(self)

    def release(self, seat: int) -> None:
        """Nothing to do: each seat owns a whole cache row, overwritten by its next sequence."""

    def stop_token_ids(self) -> tuple[int, ...]:
        return ()


QK_GAIN = 2.0
"""q_proj / k_proj std is QK_GAIN / sqrt(fan_in): attention logits of std ~QK_GAIN**2, so
attention picks out tokens of the context instead of averaging them."""
LM_GAIN = 4.0
"""lm_head std is LM_GAIN / sqrt(hidden): logits of std ~LM_GAIN, so greedy argmaxes are decided
by clear margins rather than near-ties."""


@torch.no_grad()
def init_weights(model: TinyLlama, seed: int) -> None:
    """Same weights for a seed on any device and dtype: drawn in float32 on the CPU, then copied.

    Scaled so that outputs depend on the context, which the equality checks need (with every
    linear at std 0.02, attention averaged the context away: 26 of 30 prompt pairs sharing only
    their last token generated the same first token, so a KV-cache mix-up between requests went
    unseen). Embedding std 1; every linear std 1/sqrt(fan_in), keeping the residual stream at
    unit scale; q/k and lm_head scaled up by QK_GAIN and LM_GAIN. tests/test_tiny_llama.py
    measures it: prompts sharing only their last token generate different first tokens."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            w = torch.ones(p.shape)
        elif name == "embed.weight":
            w = torch.randn(p.shape, generator=gen)
        else:
            gain = (
                QK_GAIN
                if name.endswith(("q_proj.weight", "k_proj.weight"))
                else LM_GAIN
                if name == "lm_head.weight"
                else 1.0
            )
            w = torch.randn(p.shape, generator=gen) * (gain / p.shape[1] ** 0.5)
        p.copy_(w)


# ---- batches and ground truth ----


def make_batch(model: TinyLlama, reqs: list[tuple[int, int, list[int]]]) -> dict[str, torch.Tensor]:
    """reqs: (cache_row, start_pos, token_ids) per request -> forward's keyword arguments."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    for row, start, tokens in reqs:
        n = len(tokens)
        ids += tokens
        pos += range(start, start + n)
        slots += [model.slot(row, p) for p in range(start, start + n)]
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
    i64, i32, dev = torch.int64, torch.int32, model.device
    return dict(
        input_ids=torch.tensor(ids, dtype=i64, device=dev),
        positions=torch.tensor(pos, dtype=i64, device=dev),
        slot_mapping=torch.tensor(slots, dtype=i64, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=i32, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=i32, device=dev),
    )


def pad_batch(
    model: TinyLlama, batch: dict[str, torch.Tensor], num_tokens: int, num_reqs: int
) -> dict[str, torch.Tensor]:
    """Pads to num_tokens tokens (token 0, position 0, dummy slot) and num_reqs requests
    (seq_len 0, zero query length: query_start_loc repeats its last value)."""
    pad_t = num_tokens - batch["input_ids"].shape[0]
    pad_r = num_reqs - batch["seq_lens"].shape[0]
    assert pad_t >= 0 and pad_r >= 0, "pad_batch only grows a batch"

    def grow(t, n, value):
        return torch.cat([t, t.new_full((n,), value)])

    return dict(
        input_ids=grow(batch["input_ids"], pad_t, 0),
        positions=grow(batch["positions"], pad_t, 0),
        slot_mapping=grow(batch["slot_mapping"], pad_t, model.dummy_slot),
        seq_lens=grow(batch["seq_lens"], pad_r, 0),
        query_start_loc=grow(batch["query_start_loc"], pad_r, int(batch["query_start_loc"][-1])),
    )


def static_inputs(model: TinyLlama) -> list:
    """The runtime's description of forward's inputs: dtypes and safe padding values."""
    from graphplan.runtime import StaticInput

    return [
        StaticInput(name="input_ids", per="token", dtype=torch.int64, pad=0),
        StaticInput(name="positions", per="token", dtype=torch.int64, pad=0),
        StaticInput(name="slot_mapping", per="token", dtype=torch.int64, pad=model.dummy_slot),
        StaticInput(name="seq_lens", per="req", dtype=torch.int32, pad=0),
        StaticInput(name="query_start_loc", per="req+1", dtype=torch.int32, pad="last"),
    ]


LOGIT_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""atol = rtol for logits of the same tokens computed two ways (graphs vs eager, batched vs alone,
padded vs not): float32 differs by summation order only; bf16 by its 8-bit mantissa through the
layers (logits reach ~20, where one bf16 step is 0.125)."""


def logits_mismatch(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None when ``got`` matches ``want`` within LOGIT_TOL[dtype], else what differs."""
    tol = LOGIT_TOL[dtype]
    if got.shape != want.shape:
        return f"logits shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
    got, want = got.float().cpu(), want.float().cpu()
    bad = (got - want).abs() > tol + tol * want.abs()
    if not bad.any():
        return None
    i = tuple(int(v) for v in bad.nonzero()[0])
    return (
        f"{int(bad.sum())} of {bad.numel()} logits differ beyond atol=rtol={tol:g} "
        f"(first at {i}: {got[i].item():.5f} vs {want[i].item():.5f}; max |diff| "
        f"{(got - want).abs().max().item():.4g})"
    )


def greedy_mismatch(
    tokens: list[list[int]], got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype
) -> str | None:
    """Compare a generation (``tokens`` and the logits ``got`` they were picked from) with a
    reference run teacher-forced over the same tokens (``want``): every logit within
    LOGIT_TOL[dtype], every token the reference's argmax or a near-tie within that tolerance.
    None when they agree, else what differs first."""
    tol = LOGIT_TOL[dtype]
    for i, (toks, g, w) in enumerate(zip(tokens, got, want)):
        bad = logits_mismatch(g, w, dtype)
        if bad:
            return f"prompt {i}: {bad}"
        for t, (tok, row) in enumerate(zip(toks, w.float())):
            top = row.max().item()
            if row[tok].item() < top - 2 * (tol + tol * abs(top)):
                return (
                    f"prompt {i}, new token {t}: picked {tok} (reference logit "
                    f"{row[tok].item():.4f}), the reference's argmax {int(row.argmax())} "
                    f"has {top:.4f}"
                )
    return None


@torch.no_grad()
def greedy(
    model: TinyLlama,
    prompts: list[list[int]],
    max_new_tokens: int,
    step=None,
    forced: list[list[int]] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy: prefill all prompts in one batch (prompt i in cache row i), then decode all
    requests together one token per step. Returns each prompt's new tokens and the logits they
    were chosen from ([max_new_tokens, vocab] float32 on the CPU per prompt).

    ``step(batch, num_reqs, max_query_len) -> logits`` runs a batch (default: the model, eagerly;
    examples/generate.py passes a GraphRunner). ``forced`` (new tokens per prompt) feeds those
    tokens back instead of the argmax (teacher forcing): two ways of computing can then be
    compared logit by logit over the same token sequence, even where a near-tie flips an argmax."""
    assert len(prompts) <= model.cfg.num_cache_rows
    step = step or (lambda batch, num_reqs, max_query_len: model(**batch))
    reqs = [(row, 0, list(p)) for row, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for i in range(max_new_tokens):
        batch = make_batch(model, reqs)
        last = batch["query_start_loc"][1:].long() - 1  # [R] each request's last token
        logits = step(batch, len(reqs), max(len(toks) for _, _, toks in reqs))[last].float()
        next_ids = logits.argmax(dim=-1).tolist() if forced is None else [f[i] for f in forced]
        for tokens, kept, tok, row in zip(out, rows, next_ids, logits.cpu()):
            tokens.append(tok)
            kept.append(row)
        reqs = [(row, start + len(toks), [tok]) for (row, start, toks), tok in zip(reqs, next_ids)]
    return out, [torch.stack(r) if r else torch.empty(0) for r in rows]


def reference_generate(
    model: TinyLlama, prompts: list[list[int]], max_new_tokens: int, step=None
) -> list[list[int]]:
    """The new tokens of ``greedy`` (see there)."""
    return greedy(model, prompts, max_new_tokens, step)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = TinyLlama(TinyLlamaConfig(), seed=args.seed, device=args.device, dtype=dtype)
    prompts = [[1, 2, 3, 4], [100, 200], [7] * 9]
    for prompt, new in zip(prompts, reference_generate(model, prompts, args.new_tokens)):
        print(f"{prompt} -> {new}")


if __name__ == "__main__":
    main()
