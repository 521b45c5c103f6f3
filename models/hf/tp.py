"""Tensor parallelism for the Llama-family decoders (Llama, Qwen2, Qwen3), Megatron-style.

Each of ``tp`` ranks builds the model of a *rank config*: ``num_attention_heads / tp`` query
heads, ``num_key_value_heads / tp`` KV heads (one, replicated, when the model has fewer KV heads
than ranks: rank r holds KV head ``r // (tp / kv_heads)``, the one its query heads read),
``intermediate_size / tp`` MLP columns and ``ceil(vocab / tp)`` rows of the embedding and LM head
(the last rank's rows past the vocabulary are zero). transformers builds that model at its per-rank
size, so nothing ever holds a whole weight: each rank reads only its slices of the checkpoint
(``CheckpointReader.get_part``: safetensors ``get_slice``), or draws only its own elements of
``init_random``'s weights (the same values as the shards of the whole model's). Split by rows
(``[out, in]`` weights' dim 0, "columns" of the GEMM's output): q/k/v and gate/up, their biases,
embedding and LM head; by columns (dim 1): o_proj and down_proj, whose partial sums are added
by an all-reduce, their biases on rank 0 only. The fused layouts (one q|k|v and one gate|up GEMM,
``fused_decoder``) are built per rank from the per-rank weights.

Communication (``TPGroup``, a torch.distributed group handed in: Gloo on the CPU, NCCL on GPUs):
an in-place all-reduce after o_proj and after down_proj, one after the vocabulary-parallel
embedding (a rank looks up the ids it holds and writes zeros for the others), and an all-gather
of the LM head's logits: every rank gets the full ``[T, vocab]`` logits (and samples the same
token from them). None reads anything back to the host, so the collectives are captured inside
the graphs as any kernel is. The KV pool of each rank holds its own KV heads (``kv_shape`` of
the rank config).

The same rules serve both forwards: the fused decoder (``TPFusedDecoder``) and transformers'
own (Qwen3, or ``fused_ops=False``: the instance's o_proj/down_proj get a forward hook, the
embedding and LM head a per-instance vocabulary-parallel forward).
"""

from __future__ import annotations

import copy
import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import TensorParallelError
from .fused_decoder import FusedDecoder, fuse

ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
"""Linear layers split along their input (dim 1 of the weight); an all-reduce follows them."""
HEAD_SPLIT = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv"}
MLP_SPLIT = ("mlp.gate_proj", "mlp.up_proj")
VOCAB_SPLIT = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This rank's place in a tensor-parallel group: ``group`` a torch.distributed process group
    of ``size`` ranks (None for a group of one), ``rank`` its rank in it."""

    rank: int
    size: int
    group: object = None
    symm: object = None
    """A ``tp_symm.SymmAllReduce`` (the small messages it takes), or None: NCCL/Gloo for all."""

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the partial sums of a row-parallel GEMM)."""
        if self.size > 1 and self.symm is not None and self.symm.takes(x):  # type: ignore[attr-defined]
            return self.symm.all_reduce_(x)  # type: ignore[attr-defined]
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on every rank -> ``[..., size * n]``, rank 0's columns first."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        if x.is_cuda:  # one collective into one tensor: graph-capturable
            out = x.new_empty((self.size, *x.shape))
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = list(out.unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True, slots=True)
class Split:
    """How one rank's model divides ``config``'s (``split_of``)."""

    tp: int
    rank: int
    heads: int
    """Query heads per rank."""
    kv_heads: int
    """KV heads per rank (1 when replicated)."""
    kv_first: int
    """This rank's first KV head."""
    inter: int
    """MLP columns per rank."""
    vocab: int
    """The whole vocabulary."""
    vocab_rows: int
    """Embedding / LM head rows per rank: ceil(vocab / tp)."""
    head_dim: int

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def vocab_held(self) -> int:
        """Real vocabulary rows this rank holds (the rest of its ``vocab_rows`` are padding)."""
        return max(0, min(self.vocab, self.vocab_start + self.vocab_rows) - self.vocab_start)


def check_split(config, tp: int, where) -> None:
    """TensorParallelError unless ``config``'s model splits over ``tp`` ranks."""
    heads = config.num_attention_heads
    kv = config.num_key_value_heads or heads
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads={heads}")
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} (nor is it a multiple of it)")
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if problems:
        fits = [n for n in range(1, 65) if heads % n == 0 and (kv % n == 0 or n % kv == 0)]
        fits = [n for n in fits if config.intermediate_size % n == 0]
        raise TensorParallelError(
            f"{where}: tensor_parallel_size={tp} does not divide {', '.join(problems)}: each "
            "rank holds whole attention heads and an equal share of the MLP; use a "
            f"tensor_parallel_size among {fits}"
        )


def split_of(config, tp: int, rank: int, where="the model") -> Split:
    check_split(config, tp, where)
    heads = config.num_attention_heads
    kv = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = max(kv // tp, 1)
    kv_first = rank * kv_heads if kv >= tp else rank // (tp // kv)
    return Split(
        tp=tp,
        rank=rank,
        heads=heads // tp,
        kv_heads=kv_heads,
        kv_first=kv_first,
        inter=config.intermediate_size // tp,
        vocab=config.vocab_size,
        vocab_rows=math.ceil(config.vocab_size / tp),
        head_dim=head_dim,
    )


def rank_config(config, split: Split):
    """The config transformers builds one rank's model from (module docstring); its
    ``vocab_size`` is the rank's rows (``restore_vocab`` puts the whole back once built)."""
    c = copy.deepcopy(config)
    c.num_attention_heads = split.heads
    c.num_key_value_heads = split.kv_heads
    c.intermediate_size = split.inter
    c.head_dim = split.head_dim
    c.vocab_size = split.vocab_rows
    c.pad_token_id = None  # a padding index past this rank's rows would be refused
    return c


@dataclass(frozen=True, slots=True)
class Part:
    """One rank's part of a checkpoint tensor: rows/columns ``start:stop`` of ``dim`` (None: the
    whole tensor), then ``pad`` zero rows; ``zero``: all zeros (a row-parallel bias off rank 0)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    pad: int = 0
    zero: bool = False


def part_of(name: str, split: Split) -> Part:
    """Which part of tensor ``name`` (a checkpoint / state_dict name) this rank holds."""
    if name in VOCAB_SPLIT:
        start = split.vocab_start
        held = split.vocab_held
        return Part(dim=0, start=start, stop=start + held, pad=split.vocab_rows - held)
    module, _, kind = name.rpartition(".")
    for suffix in ROW_PARALLEL:
        if module.endswith(suffix):
            if kind == "bias":
                return Part(zero=split.rank > 0)
            width = split.heads * split.head_dim if "o_proj" in suffix else split.inter
            return Part(dim=1, start=split.rank * width, stop=(split.rank + 1) * width)
    for suffix, which in HEAD_SPLIT.items():
        if module.endswith(suffix):
            first, n = (
                (split.rank * split.heads, split.heads)
                if which == "q"
                else (split.kv_first, split.kv_heads)
            )
            return Part(dim=0, start=first * split.head_dim, stop=(first + n) * split.head_dim)
    if module.endswith(MLP_SPLIT):
        return Part(dim=0, start=split.rank * split.inter, stop=(split.rank + 1) * split.inter)
    return Part()


def full_index(part: Part, full_shape: tuple[int, ...], rows: range, device) -> torch.Tensor:
    """Flat indices into the whole tensor of rows ``rows`` of this rank's part (padding rows
    excluded by the caller): what ``load.random_values`` draws for them."""
    inner = math.prod(full_shape[1:])
    r = torch.arange(rows.start, rows.stop, dtype=torch.int64, device=device)
    if part.dim == 1:
        cols = torch.arange(part.start, part.stop, dtype=torch.int64, device=device)
        return (r[:, None] * inner + cols[None, :]).reshape(-1)
    first = part.start if part.dim == 0 else 0
    cols = torch.arange(inner, dtype=torch.int64, device=device)
    return ((r[:, None] + first) * inner + cols[None, :]).reshape(-1)


# -- the collectives in the model's forwards ----------------------------------------------------
def install_tp(hf, tp: TPGroup, split: Split) -> None:
    """Give transformers' forward of a rank's model its collectives: a forward hook summing
    each o_proj / down_proj output over the ranks, a vocabulary-parallel forward on this
    instance's embedding and LM head (their modules keep their types)."""
    for layer in hf.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.register_forward_hook(lambda _m, _i, out: tp.all_reduce_(out))
    embed, head = hf.model.embed_tokens, hf.lm_head
    embed.forward = types.MethodType(
        lambda m, ids: vocab_embedding(m.weight, ids, tp, split), embed
    )
    head.forward = types.MethodType(lambda m, h: vocab_head(m.weight, m.bias, h, tp, split), head)


def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, tp: TPGroup, split: Split):
    """The rows of the ids this rank holds, zeros for the others, summed over the ranks."""
    local = ids - split.vocab_start
    held = (local >= 0) & (local < split.vocab_held)
    h = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    h = h * held.unsqueeze(-1).to(h.dtype)
    return tp.all_reduce_(h)


def vocab_head(weight, bias, h: torch.Tensor, tp: TPGroup, split: Split) -> torch.Tensor:
    """Every rank's logits over the whole vocabulary: this rank's rows, gathered, padding cut."""
    logits = tp.gather_last(F.linear(h, weight, bias))
    return logits[..., : split.vocab] if logits.shape[-1] != split.vocab else logits


class TPFusedDecoder(FusedDecoder):
    """The fused forward of one TP rank: the rank's fused weights, an all-reduce after each
    o_proj and down_proj, the vocabulary-parallel embedding and LM head of ``install_tp``."""

    def __init__(self, hf, layers, max_positions: int, *, tp: TPGroup):
        super().__init__(hf, layers, max_positions)
        self.tp = tp
        self.embed_module, self.head_module = hf.model.embed_tokens, hf.lm_head

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_module(input_ids)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_module(h)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce_(x)


def tp_fuse(hf, max_positions: int, tp: TPGroup) -> TPFusedDecoder:
    """``fused_decoder.fuse`` for a rank's model (built by ``tp_load.load_tp_model``)."""
    return fuse(hf, max_positions, lambda *a: TPFusedDecoder(*a, tp=tp))  # type: ignore[return-value]
