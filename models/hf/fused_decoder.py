"""A fast forward for Llama-family decoders (``LlamaForCausalLM``, ``Qwen2ForCausalLM``): the same
weights and the same attention call as transformers' forward, with fewer, larger kernels.

At load (``fuse``), once per decoder layer:
- q/k/v projections become one ``[q + k + v, hidden]`` weight and gate/up one ``[2 inter,
  hidden]`` weight (biases alike): copied end to end into one new tensor each, and each original
  parameter's ``.data`` becomes its rows of it. No copy is kept (the old storages are freed), the
  module tree, ``state_dict`` and transformers' own forward still work on the same values, so the
  stock path stays available for comparison (``PagedCausalLM.fused_ops = False``);
- cos/sin tables of the rotary frequencies, one row per position up to the cache's longest
  sequence.

Per step (``FusedDecoder.forward``), per layer: RMSNorm fused with the residual add, one q|k|v
GEMM, rotary on q and k in place (cos/sin read at each token's position on the device), the
attention function transformers would call (looked up in its registry under
``ATTN_IMPLEMENTATION``, the model's ``attn_implementation`` once the adapter has set it, and
called with the same arguments as ``LlamaAttention.forward`` calls it, the paged metadata as the
``graphplan`` keyword), the output projection, RMSNorm fused with the
residual add, one gate|up GEMM, SiLU(gate) x up, the down projection (``fused_ops``).

Anything else (another architecture, a non-SiLU MLP, LoRA-wrapped or otherwise non-``Linear``
projections) is not fused: ``why_not_fused``
says why, and the adapter keeps transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphplan.runtime.compiled.merge_linear import end_to_end

from .attention import ATTN_IMPLEMENTATION
from .fused_ops import add_rmsnorm_, rmsnorm, rotary_, rotary_tables, silu_mul, use_triton

LAYERS = {
    "LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "Qwen2ForCausalLM": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
}
"""Causal LM class -> its decoder layer's classes (by name, matched exactly: a subclass may
change the forward)."""
SILU = ("SiLU", "SiLUActivation")
"""torch's and transformers' SiLU modules (``hidden_act: silu``)."""


@dataclass(frozen=True, slots=True)
class FusedLayer:
    attn: torch.nn.Module
    """transformers' attention module: what the attention function receives (``layer_idx``)."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: torch.Tensor
    """[(H + 2 KvH) D, hidden]: q_proj's, k_proj's and v_proj's rows, end to end."""
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    """[2 inter, hidden]: gate_proj's rows, then up_proj's."""
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    extra: tuple[tuple[str, object], ...]
    """Keywords the model's attention adds to its call (Qwen2: ``sliding_window``)."""


def why_not_fused(hf) -> str | None:
    """None when ``fuse`` applies to ``hf``, else the reason it does not."""
    name = type(hf).__name__
    if name not in LAYERS:
        return f"{name} is not a Llama-family model ({', '.join(LAYERS)})"
    layer_cls, attn_cls, mlp_cls, norm_cls = LAYERS[name]
    config = hf.config
    if hf.training:
        return "the model is in training mode"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} (fused: silu)"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    base = hf.model
    if type(hf.lm_head) is not torch.nn.Linear or type(base.embed_tokens) is not torch.nn.Embedding:
        return "the embeddings or the LM head are not plain Embedding/Linear modules"
    if type(base.norm).__name__ != norm_cls:
        return f"final norm {type(base.norm).__name__}"
    if getattr(base.rotary_emb, "rope_type", "default") not in ("default", "linear", "llama3"):
        return f"rope type {base.rotary_emb.rope_type!r} changes with the sequence"
    for i, layer in enumerate(base.layers):
        where = f"layer {i}"
        if type(layer).__name__ != layer_cls:
            return f"{where} is a {type(layer).__name__}"
        a, m = layer.self_attn, layer.mlp
        if type(a).__name__ != attn_cls or type(m).__name__ != mlp_cls:
            return f"{where}: {type(a).__name__}/{type(m).__name__} modules"
        for n in ("input_layernorm", "post_attention_layernorm"):
            if type(getattr(layer, n)).__name__ != norm_cls:
                return f"{where}: {n} is a {type(getattr(layer, n)).__name__}"
        projections = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if any(type(p) is not torch.nn.Linear for p in projections):
            return f"{where}: projections that are not plain torch.nn.Linear (LoRA or quantized)"
        if type(m.act_fn).__name__ not in SILU:
            return f"{where}: activation {type(m.act_fn).__name__}"
        if getattr(a, "sliding_window", None) is not None:
            return f"{where}: sliding-window attention"
        if (a.q_proj.bias is None) != (a.k_proj.bias is None) or (a.q_proj.bias is None) != (
            a.v_proj.bias is None
        ):
            return f"{where}: q/k/v projections with and without biases"
        if (m.gate_proj.bias is None) != (m.up_proj.bias is None):
            return f"{where}: gate/up projections with and without biases"
        if a.head_dim % 2:
            return f"{where}: odd head_dim {a.head_dim}"
    return None


@torch.no_grad()
def relay(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One tensor holding ``params`` end to end along dim 0; each parameter's ``.data`` becomes
    its rows of it (values unchanged; the old storages are freed once nothing else holds them)."""
    found = end_to_end([p.data for p in params])
    if found is not None:
        return found
    merged = torch.cat([p.data for p in params], dim=0)
    start = 0
    for p in params:
        p.data = merged[start : start + p.shape[0]]
        start += p.shape[0]
    return merged


def _relay_biases(linears) -> torch.Tensor | None:
    return None if linears[0].bias is None else relay([m.bias for m in linears])


def fuse(hf, max_positions: int, decoder=None) -> "FusedDecoder":
    """Lay ``hf``'s weights out for the fused forward (module docstring); ``hf`` must pass
    ``why_not_fused``. ``max_positions``: rows of the rotary tables (positions 0..n-1).
    ``decoder``: the class to build (``FusedDecoder``'s signature; tp.py's for a TP rank)."""
    layers = []
    for layer in hf.model.layers:
        a, m = layer.self_attn, layer.mlp
        qkv, gate_up = [a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]
        extra = () if not hasattr(a, "sliding_window") else (("sliding_window", a.sliding_window),)
        layers.append(
            FusedLayer(
                attn=a,
                input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                eps=float(layer.input_layernorm.variance_epsilon),
                qkv=relay([p.weight for p in qkv]),
                qkv_bias=_relay_biases(qkv),
                o_proj=a.o_proj.weight,
                o_bias=a.o_proj.bias,
                gate_up=relay([p.weight for p in gate_up]),
                gate_up_bias=_relay_biases(gate_up),
                down=m.down_proj.weight,
                down_bias=m.down_proj.bias,
                extra=extra,
            )
        )
        if layers[-1].qkv.is_cuda:  # the originals' blocks back to the device, for the next cat
            torch.cuda.empty_cache()
    fused = (decoder or FusedDecoder)(hf, layers, max_positions)
    fused.warm_up()
    return fused


class FusedDecoder:
    """The fused forward of one model (``fuse`` builds it): ``forward(input_ids, positions,
    graphplan)`` -> logits ``[T, vocab]`` in the model's dtype."""

    def __init__(self, hf, layers: list[FusedLayer], max_positions: int):
        base = hf.model
        self.config = hf.config
        self.layers = layers
        self.embed = base.embed_tokens.weight
        self.norm, self.eps = base.norm.weight, float(base.norm.variance_epsilon)
        self.lm_head, self.lm_head_bias = hf.lm_head.weight, hf.lm_head.bias
        c = self.config
        self.head_dim: int = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.q_heads: int = c.num_attention_heads
        self.kv_heads: int = c.num_key_value_heads or self.q_heads
        rope = base.rotary_emb
        self.cos, self.sin = rotary_tables(
            rope.inv_freq, float(rope.attention_scaling), max_positions, self.embed.dtype
        )
        self.lora = None  # LoRA adapter slots (lora_slots.LoraSlots), once LoRA is enabled
        self.lora_step = None  # the forward's lora_slots.LoraStep while it runs, or None

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile the Triton kernels for this model's widths and dtype now, one token through
        each op: loading a kernel is not permitted while a CUDA graph is being captured, so their
        first call must not be in one. (Token counts are not compiled in: one compile serves every
        batch size.)"""
        if not self.layers or not use_triton(self.embed):
            return
        layer, like = self.layers[0], self.embed
        x = like.new_zeros(1, like.shape[1])
        rmsnorm(x, layer.input_norm, layer.eps)
        add_rmsnorm_(x, x.clone(), layer.input_norm, layer.eps)
        silu_mul(like.new_zeros(1, layer.gate_up.shape[0]))
        positions = torch.zeros(1, dtype=torch.long, device=like.device)
        qkv = like.new_zeros(1, layer.qkv.shape[0])
        rotary_(qkv, positions, self.cos, self.sin, self.q_heads + self.kv_heads, self.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        graphplan,
        head: bool = True,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions ``[T]``; ``graphplan``: the step's paged metadata, handed to every
        attention call as transformers' forward hands it. ``head=False``: the last hidden states
        (after the final norm), without the LM head. ``lora_slots`` ``[T]``: each token's LoRA
        adapter slot (-1: none; ``lora_slots.py``)."""
        self.lora_step = None if self.lora is None else self.lora.step(lora_slots)
        h = self.embedding(input_ids)  # [T, hidden]
        residual = None
        step = self.step_inputs(positions, graphplan)
        for layer in self.layers:
            h, residual = self.layer_forward(layer, h, residual, step)
        if residual is None:  # no layers
            h = rmsnorm(h, self.norm, self.eps)
        else:
            h, _ = add_rmsnorm_(h, residual, self.norm, self.eps)
        return self.head(h) if head else h

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head, self.lm_head_bias)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over tensor-parallel ranks of o_proj's / down_proj's output (tp.py); one
        rank: ``x``."""
        return x

    def step_inputs(self, positions: torch.Tensor, graphplan) -> tuple:
        """What every layer of one step reads: (positions, position_ids, graphplan, the attention
        function transformers' registry holds under ATTN_IMPLEMENTATION)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attention = ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
        return positions, positions[None], graphplan, attention

    def layer_forward(
        self, layer: FusedLayer, h: torch.Tensor, residual: torch.Tensor | None, step: tuple
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer: (its input, the residual stream before it; None for the first) ->
        (its output, the residual stream), the residual add of the output left to the next
        norm. ``h`` and ``residual`` are updated in place."""
        if residual is None:
            residual, h = h, rmsnorm(h, layer.input_norm, layer.eps)
        else:
            h, residual = add_rmsnorm_(h, residual, layer.input_norm, layer.eps)
        h = self._attention(layer, h, *step)
        h, residual = add_rmsnorm_(h, residual, layer.post_norm, layer.eps)
        h = silu_mul(
            self._lora(F.linear(h, layer.gate_up, layer.gate_up_bias), h, layer, "gate_up")
        )
        down = self._lora(F.linear(h, layer.down, layer.down_bias), h, layer, "down")
        return self.reduce(down), residual

    def _lora(self, y, x, layer: FusedLayer, group: str) -> torch.Tensor:
        """``y`` (projection ``group`` of ``x``) plus the step's LoRA update, if any."""
        if self.lora_step is None:
            return y
        return self.lora_step.add(y, x, layer.attn.layer_idx, group)

    def _attention(self, layer, h, positions, position_ids, graphplan, attention):
        tokens, d = h.shape[0], self.head_dim
        q_width, kv_width = self.q_heads * d, self.kv_heads * d
        qkv = self._lora(F.linear(h, layer.qkv, layer.qkv_bias), h, layer, "qkv")
        rotary_(qkv, positions, self.cos, self.sin, self.q_heads + self.kv_heads, d)
        # [1, heads, T, D] views of the one projection, as transformers hands them over
        q = qkv[:, :q_width].view(tokens, self.q_heads, d).transpose(0, 1)[None]
        k = qkv[:, q_width : q_width + kv_width].view(tokens, self.kv_heads, d).transpose(0, 1)
        v = qkv[:, q_width + kv_width :].view(tokens, self.kv_heads, d).transpose(0, 1)
        out, _ = attention(
            layer.attn,
            q,
            k[None],
            v[None],
            None,
            dropout=0.0,
            scaling=layer.attn.scaling,
            **dict(layer.extra),
            position_ids=position_ids,
            use_cache=False,
            graphplan=graphplan,
        )
        out = out.reshape(tokens, -1)
        return self.reduce(self._lora(F.linear(out, layer.o_proj, layer.o_bias), out, layer, "o"))
