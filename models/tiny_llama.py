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

    python -m graphplan.models.tiny_llama [--device cuda] [--new-tokens 16]

The parts (config, attention op, layers) are in ``tiny_llama_layers.py``; the eager ground truth
(``greedy``, ``reference_generate``, the logit tolerances) in ``reference.py``, re-exported here.
"""

import argparse

import torch
from torch import nn

from graphplan.runtime.buffers import to_device

from .logits import every_token_rows
from .reference import LOGIT_TOL, greedy, greedy_mismatch, logits_mismatch, reference_generate
from .tiny_llama_layers import (
    ATTENTION_OP,
    MLP,
    Attention,
    DecoderLayer,
    RMSNorm,
    TinyLlamaConfig,
    apply_rope,
    rope_tables,
)

__all__ = [
    "ATTENTION_OP",
    "LM_GAIN",
    "LOGIT_TOL",
    "MLP",
    "QK_GAIN",
    "Attention",
    "DecoderLayer",
    "RMSNorm",
    "TinyLlama",
    "TinyLlamaConfig",
    "apply_rope",
    "greedy",
    "greedy_mismatch",
    "init_weights",
    "logits_mismatch",
    "main",
    "make_batch",
    "pad_batch",
    "reference_generate",
    "rope_tables",
    "static_inputs",
]


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
    def logits(self, out, rows, *, into=None) -> torch.Tensor:
        """Rows of the step's logits (forward returns every token's)."""
        return every_token_rows(out, rows, into=into)

    def make_batch(self, reqs, *, non_blocking: bool = False) -> dict[str, torch.Tensor]:
        """``(cache_row, start_pos, token_ids)`` per request -> forward's keyword arguments."""
        return make_batch(self, reqs, non_blocking=non_blocking)

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


# ---- batches ----


def make_batch(
    model: TinyLlama, reqs: list[tuple[int, int, list[int]]], *, non_blocking: bool = False
) -> dict[str, torch.Tensor]:
    """reqs: (cache_row, start_pos, token_ids) per request -> forward's keyword arguments
    (``non_blocking``: ``Model.make_batch``)."""
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
    if non_blocking:
        host = dict(
            input_ids=torch.tensor(ids, dtype=i64),
            positions=torch.tensor(pos, dtype=i64),
            slot_mapping=torch.tensor(slots, dtype=i64),
            seq_lens=torch.tensor(seq_lens, dtype=i32),
            query_start_loc=torch.tensor(qsl, dtype=i32),
        )
        return {k: to_device(v, dev) for k, v in host.items()}
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
