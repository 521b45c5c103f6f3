"""A stock ``LlamaForCausalLM`` whose hand-set weights copy: greedy decoding continues a repeated
sequence. Speculative decoding's n-gram bar (issue 36) needs a model that repeats its prompt, and
the benches cannot download one; random weights never copy, so n-gram drafts are never accepted.

    python bench/copy_model.py --shape tiny --out /tmp/copy-tiny     # a save_pretrained directory
    python bench/copy_model.py --shape 8b --out DIR --max-positions 2048

The circuit (the classic two-layer induction circuit), for any Llama config with at least two
layers. Every tensor keeps its full size, so a step costs what a step of the shape costs; only
layer 0 and the next ``induction_layers`` layers' attention write anything (every other o_proj and
every down_proj is zero, so their layers pass the residual through; norm weights are 1).

Residual layout (``Layout``): coordinate 0 is a constant 1 in every token's embedding (a bias);
``M`` holds token t's *match code*: ``n`` unit vectors c_t^j of ``m`` dimensions (one per
induction head j), scaled by 1/sqrt(n); ``P`` (zero in the embeddings) receives the previous
token's match code; ``R`` holds t's *readout code* rho_t, a unit vector of ``kv_heads * rb``
dimensions; ``out`` (zero in the embeddings) receives the induction heads' copies and is what the
LM head reads (a tied head reads the embedding's own R, so there ``out`` is R). Codes are random
Gaussian vectors, normalised. Each embedding has norm sqrt(3) exactly, so RMSNorm scales every
position of layer 0 alike.

1. Layer 0, previous-token heads: q and k read only the bias coordinate, so they are constant
   vectors that RoPE rotates. Rotary pair p (frequency w_p) gets q = a_p (1, 0) and
   k = a_p (cos w_p, sin w_p), so the score of query i and key j is
   sum_p a_p^2 cos((i - j - 1) w_p): largest at i - j = 1. The amplitudes a_p^2 come from a small
   linear program (``previous_token_weights``) that maximises the margin between i - j = 1 and
   every other offset up to ``max_positions``; it puts most weight on the fastest pairs, and
   gives a margin of about 0.3 of the peak (scaled so the margin is ``PREV_MARGIN`` logits).
   Values copy M, o_proj writes it into P: P_i ~ M_{i-1}. (Position 0 attends only itself.)
2. Layers 1.. (``induction_layers``), induction heads: one q head a KV head (the others zero).
   Head j's query is c_t^j (token i's match code), its key c^j in P minus ``LAMBDA`` times c^j in
   M (the previous token's code, minus the key's own: position 0, whose "previous" token is
   itself, and the query's own position score low). Both sit on the lowest-frequency rotary
   pairs, which turn by at most ``MAX_ANGLE`` radians over ``max_positions`` (Llama-3's rope
   scaling included: the frequencies come from the config's own rotary embedding), so the score
   is about ``MATCH`` logits where token j-1 equals token i and about 0 elsewhere. The value
   copies the key position's readout block of R (the embedding's, untouched by earlier induction
   layers, which write into ``out``); o_proj adds it into ``out``, ``GAMMA`` in all. Each head
   copies its own block, so the heads vote: one head in the wrong place costs a block.
3. The LM head reads ``out``: rho_v . GAMMA rho_next is about GAMMA for the next token and near 0
   for the rest. A tied head (one induction layer) reads the embedding's R, M and bias too: the
   bias adds the same to every logit, R and M add about 2 to the current token's.

So wherever the current token occurred before, the model predicts the token that followed it; a
token seen several times may resolve to any earlier occurrence (or a mix). How sharply depends on
the match dimensions ``m`` and the heads ``n`` (``layout``): the 8B shape (m = 46 over 2048
positions, 8 heads) copies a 1024-token context in bfloat16 by about 46 logits; the ``tiny``
shape (m = 12, two heads, vocab 512) only about 96 % of positions, its match codes too short. ``copy_weights``
checks the shape has room (hidden size, KV heads, slow rotary pairs) and raises ``ValueError``
naming what to change. Same seed, same weights on one device type (the codes are drawn with the
device's generator, on the device: an 8B model is filled in about a second on a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

PREV_MARGIN = 16.0
"""Logits between the previous-token heads' score at offset 1 and at any other offset."""
MATCH = 40.0
"""Logits of an induction head's score where the key's previous token is the query's token."""
LAMBDA = 0.5
"""Induction keys subtract this share of the key position's own code."""
GAMMA = 3.0
"""Weight of the copied readout code in R (the current token's weighs 1)."""
MAX_ANGLE = 0.5
"""Radians a match pair may turn over ``max_positions`` (cos 0.5 = 0.88 of the match score)."""
MAX_MATCH_DIMS = 64


@dataclass(frozen=True)
class Layout:
    """Where each part of the circuit lives (see the module docstring)."""

    hidden: int
    head_dim: int
    groups: int
    """q heads a KV head."""
    kv_heads: int
    induction_layers: int
    m: int
    """Match-code dimensions an induction head (on the ``low_pairs`` rotary pairs)."""
    low_pairs: tuple[int, ...]
    rb: int
    """Readout dimensions a KV head."""
    tied: bool

    @property
    def n(self) -> int:
        """Induction heads."""
        return self.kv_heads * self.induction_layers

    @property
    def M(self) -> int:
        return 1

    @property
    def P(self) -> int:
        return 1 + self.n * self.m

    @property
    def R(self) -> int:
        return 1 + 2 * self.n * self.m

    @property
    def dR(self) -> int:
        return self.kv_heads * self.rb

    @property
    def out(self) -> int:
        """Where induction heads write (and the LM head reads): R itself when the head is tied to
        the embedding, else its own subspace after R."""
        return self.R if self.tied else self.R + self.dR


def rotary(config) -> tuple[torch.Tensor, float]:
    """The config's rotary frequencies a pair (float64) and its attention scaling."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("cpu"):
        rot = LlamaRotaryEmbedding(config)
    return rot.inv_freq.double(), float(getattr(rot, "attention_scaling", 1.0))


def layout(config, max_positions: int, induction_layers: int | None = None) -> Layout:
    """The circuit's layout for ``config`` and contexts up to ``max_positions`` tokens."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv, layers, hidden = config.num_key_value_heads, config.num_hidden_layers, config.hidden_size
    where = f"{type(config).__name__}(hidden_size={hidden}, head_dim={hd}, layers={layers})"
    if layers < 2:
        raise ValueError(f"{where}: the copy circuit needs at least 2 layers")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    top = 1 if tied else layers - 1  # a tied head reads R, which later layers' values would copy
    if induction_layers is None:  # about 8 induction heads, where the layers allow
        induction_layers = max(1, min(top, math.ceil(8 / kv)))
    if not 1 <= induction_layers <= top:
        raise ValueError(f"{where}: induction_layers must be 1..{top}")
    inv_freq, _ = rotary(config)
    slow = [p for p in torch.argsort(inv_freq).tolist() if inv_freq[p] * max_positions <= MAX_ANGLE]
    n = kv * induction_layers
    m = min(2 * len(slow), MAX_MATCH_DIMS, (hidden // 2) // (2 * n) // 2 * 2)
    if m < 8:
        raise ValueError(
            f"{where}: {len(slow)} rotary pairs turn by at most {MAX_ANGLE} rad over "
            f"{max_positions} positions and the hidden size leaves {m} match dimensions; the "
            "circuit needs 8: lower --max-positions, raise rope_theta or the hidden size"
        )
    if math.ceil(n * m / hd) > kv:
        raise ValueError(f"{where}: layer 0 cannot copy {n * m} dimensions: fewer induction layers")
    rb = min(hd, (hidden - 1 - 2 * n * m) // (kv if tied else 2 * kv))
    if rb < 8:
        raise ValueError(f"{where}: no room for the readout code; raise the hidden size")
    return Layout(hidden, hd, config.num_attention_heads // kv, kv, induction_layers, m,
                  tuple(sorted(slow[: m // 2])), rb, tied)  # fmt: skip


def previous_token_weights(
    inv_freq: torch.Tensor, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Weights w_p >= 0 (sum 1) of the rotary pairs maximising the least margin
    min over offsets d of sum_p w_p (1 - cos(d w_p)), d = -1, 1, 2, .. max_positions (d = i - j - 1),
    and that margin: a deterministic exponentiated-gradient ascent on a soft minimum (float64)."""
    d = torch.arange(1, max_positions + 1, dtype=torch.float64)
    gain = 1 - torch.cos(d[:, None] * inv_freq[None, :])  # offset -1 is offset 1's
    logw = torch.zeros_like(inv_freq)
    best, best_w = -1.0, None
    steps = 3000
    for it in range(steps):
        w = torch.softmax(logw, 0)
        margin = gain @ w
        low = float(margin.min())
        if low > best:
            best, best_w = low, w
        tau = 0.002 + 0.05 * (1 - it / steps)
        grad = torch.softmax(-margin / tau, 0) @ gain
        logw = logw + 0.5 * grad / grad.abs().max()
    return best_w, best


def _norm_scale(sq: float, hidden: int, eps: float) -> float:
    """RMSNorm divides a residual of squared norm ``sq`` by this."""
    return math.sqrt(sq / hidden + eps)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


@torch.no_grad()
def fill_copy_weights(model, *, max_positions: int = 2048, seed: int = 0,
                      induction_layers: int | None = None) -> Layout:  # fmt: skip
    """Write the copy circuit into a built ``LlamaForCausalLM`` (any dtype, any device), in place."""
    config = model.config
    lay = layout(config, max_positions, induction_layers)
    hd, g, n, m, rb = lay.head_dim, lay.groups, lay.n, lay.m, lay.rb
    eps = float(getattr(config, "rms_norm_eps", 1e-6))
    inv_freq, scaling = rotary(config)
    for name, p in model.named_parameters():
        p.fill_(1.0) if "norm" in name.split(".")[-2] else p.zero_()
    dev = model.get_input_embeddings().weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    V = config.vocab_size
    beta = 1 / math.sqrt(n)
    codes = _unit(torch.randn(V, n, m, generator=gen, device=dev)) * beta
    readout = _unit(torch.randn(V, lay.dR, generator=gen, device=dev))
    embed = model.get_input_embeddings().weight
    embed[:, 0] = 1.0
    embed[:, lay.M : lay.P] = codes.reshape(V, n * m).to(embed.dtype)
    embed[:, lay.R : lay.R + lay.dR] = readout.to(embed.dtype)
    del codes
    if not lay.tied:
        model.get_output_embeddings().weight[:, lay.out : lay.out + lay.dR] = readout.to(
            embed.dtype
        )
    del readout
    layers = model.model.layers

    def put(weight, rows, cols, values):
        weight[torch.as_tensor(rows, device=dev), torch.as_tensor(cols, device=dev)] = (
            torch.as_tensor(values, dtype=torch.float64).to(weight.dtype).to(dev)
        )

    # layer 0: previous-token heads on the bias coordinate, copying M into P
    attn = layers[0].self_attn
    w, margin = previous_token_weights(inv_freq, max_positions)
    amp = torch.sqrt(PREV_MARGIN / margin * w * math.sqrt(hd)) / scaling
    n0 = _norm_scale(3.0, lay.hidden, eps)
    half = hd // 2
    pairs = torch.arange(half)
    for kvh in range(math.ceil(n * m / hd)):
        q = kvh * g
        put(attn.q_proj.weight, q * hd + pairs, [0] * half, amp * n0)
        put(attn.k_proj.weight, kvh * hd + pairs, [0] * half, amp * torch.cos(inv_freq) * n0)
        put(attn.k_proj.weight, kvh * hd + half + pairs, [0] * half, amp * torch.sin(inv_freq) * n0)
        u = torch.arange(kvh * hd, min((kvh + 1) * hd, n * m))
        put(attn.v_proj.weight, kvh * hd + u % hd, lay.M + u, [n0] * len(u))
        put(attn.o_proj.weight, lay.P + u, q * hd + u % hd, [1.0] * len(u))

    # layers 1..: induction heads, query M's code, key P's code minus LAMBDA M's, value R
    low = torch.tensor(lay.low_pairs)
    dims = torch.stack([low, low + half], 1).reshape(-1)  # match code i -> its head dimension
    s = math.sqrt(MATCH * math.sqrt(hd)) / scaling
    gamma = GAMMA / lay.induction_layers
    i = torch.arange(m)
    d = torch.arange(rb)
    for layer in range(1, lay.induction_layers + 1):
        done = gamma * (layer - 1)
        # bias, M, P, R (rho_t) and the output so far (done rho_next; with R when tied)
        nl = _norm_scale((4.0 + done**2) if lay.tied else (5.0 + done**2), lay.hidden, eps)
        attn = layers[layer].self_attn
        for kvh in range(lay.kv_heads):
            j, q = (layer - 1) * lay.kv_heads + kvh, kvh * g
            code = j * m + i
            put(attn.q_proj.weight, q * hd + dims, lay.M + code, [s * nl / beta] * m)
            put(attn.k_proj.weight, kvh * hd + dims, lay.P + code, [s * nl / beta] * m)
            put(attn.k_proj.weight, kvh * hd + dims, lay.M + code, [-LAMBDA * s * nl / beta] * m)
            put(attn.v_proj.weight, kvh * hd + d, lay.R + kvh * rb + d, [nl] * rb)
            put(attn.o_proj.weight, lay.out + kvh * rb + d, q * hd + d, [gamma] * rb)
    return lay


def build_copy_model(config, dtype=torch.float32, device="cpu", *, max_positions: int = 2048,
                     seed: int = 0, attn_implementation: str = "sdpa",
                     induction_layers: int | None = None):  # fmt: skip
    """``config``'s model with the copy circuit's weights, in eval mode without grads."""
    from graphplan.models.hf.load import build_model

    model = build_model(config, dtype, device, attn_implementation)
    fill_copy_weights(model, max_positions=max_positions, seed=seed,
                      induction_layers=induction_layers)  # fmt: skip
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def drawn_as_copy_model(max_positions: int = 2048):
    """While open, every model loaded with random weights (``load_model(random_weights=True)``,
    ``HFSpec(random_weights=True)``, ``--random-weights``) gets the copy circuit instead: the
    engine loads its model on its own thread, so keep this open until it is ready."""
    from graphplan.models.hf import load

    draw = load.init_random

    def fill(model, seed: int) -> None:
        fill_copy_weights(model, max_positions=max_positions, seed=seed)

    load.init_random = fill
    try:
        yield
    finally:
        load.init_random = draw


def copy_weights(config, *, max_positions: int = 2048, seed: int = 0) -> dict[str, torch.Tensor]:
    """The copy circuit's state dict for ``config`` (float32, CPU)."""
    return build_copy_model(config, max_positions=max_positions, seed=seed).state_dict()


def main(argv=None) -> int:
    from transformers import LlamaConfig

    from llama_shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--out", required=True, help="the save_pretrained directory to write")
    p.add_argument("--max-positions", type=int, default=2048, help="longest context it copies in")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        p.error(f"--out {out}: not empty; give a new directory")
    if a.max_positions < 2:
        p.error("--max-positions: give at least 2")
    cfg = LlamaConfig(
        **{**SHAPES[a.shape], "max_position_embeddings": max(a.max_positions, 2)},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    try:
        model = build_copy_model(cfg, getattr(torch, a.dtype), max_positions=a.max_positions,
                                 seed=a.seed)  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    model.save_pretrained(out)
    print(f"wrote {out}: {a.shape} copy model, contexts up to {a.max_positions} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
