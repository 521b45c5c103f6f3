"""The tiny Llama's shape (``TinyLlamaConfig``) and its parts: the attention custom op (where
piecewise graphs split the forward), RMSNorm, RoPE, attention, the SwiGLU MLP and the decoder layer.
``tiny_llama.py`` assembles them into the model."""

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
