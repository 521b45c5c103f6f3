"""A communication-heavy model for DBO: a tensor-parallel-style MLP stack, one all-reduce per layer.

Each of the group's W ranks holds a 1/W shard of every layer's intermediate dimension (columns of
``up``, rows of ``down``), computes its partial output and all-reduces it over the group, as
Megatron-style tensor parallelism does. With the same tokens on every rank the result equals the
dense model (``dense_reference``); with different tokens per rank (DP ranks) it still runs the same
compute and the same collectives, which is all the DBO benchmark needs.

Micro-batching sees the all-reduces through ``forward_stages``: a generator that yields a
``runtime.dp.ubatch.Collective`` per layer, so one ubatch's all-reduce overlaps the other's MLP.

    inputs: input_ids [T] int64 -> hidden states [T, hidden] in the model dtype
    torchrun --nproc-per-node 2 models/comm_model.py      (prints a checksum per rank)
"""

from __future__ import annotations

import torch
from torch import nn

from graphplan.runtime.dp.ubatch import Collective, drive


def _weights(vocab: int, hidden: int, intermediate: int, layers: int, seed: int):
    """Dense weights drawn on the CPU in float32 (identical on every rank)."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, hidden, generator=g)
    up = torch.randn(layers, hidden, intermediate, generator=g) * hidden**-0.5
    down = torch.randn(layers, intermediate, hidden, generator=g) * intermediate**-0.5
    return embed, up, down


class CommMLP(nn.Module):
    """``layers`` x (up -> SiLU -> down -> all-reduce -> residual): four kernels and one
    collective per layer (no norm: the benchmark wants few, large kernels)."""

    embed: torch.Tensor  # [V, H]  (buffers, registered in __init__)
    up: torch.Tensor  # [L, H, I/W]
    down: torch.Tensor  # [L, I/W, H]

    def __init__(
        self,
        *,
        vocab: int = 1024,
        hidden: int = 512,
        intermediate: int = 2048,
        layers: int = 4,
        group=None,
        seed: int = 0,
        device="cpu",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        import torch.distributed as dist

        dist_on = dist.is_available() and dist.is_initialized()
        self.group = group
        self.world = dist.get_world_size(group) if dist_on else 1
        self.rank = dist.get_rank(group) if dist_on else 0
        if intermediate % self.world:
            raise ValueError(
                f"intermediate={intermediate} must divide by the group size {self.world}"
            )
        shard = intermediate // self.world
        lo, hi = self.rank * shard, (self.rank + 1) * shard
        embed, up, down = _weights(vocab, hidden, intermediate, layers, seed)
        kw = dict(device=device, dtype=dtype)
        self.embed: torch.Tensor  # buffers, declared for type checkers
        self.up: torch.Tensor
        self.down: torch.Tensor
        self.register_buffer("embed", embed.to(**kw))
        self.register_buffer("up", up[:, :, lo:hi].contiguous().to(**kw))  # [L, H, I/W]
        self.register_buffer("down", down[:, lo:hi, :].contiguous().to(**kw))  # [L, I/W, H]
        self.layers = layers

    def _all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(y, group=self.group)
        return y

    def forward_stages(self, input_ids: torch.Tensor):
        x = self.embed[input_ids]  # [T, H]
        for i in range(self.layers):
            y = nn.functional.silu(x @ self.up[i]) @ self.down[i]  # [T, H] partial sum
            y = yield Collective(self._all_reduce, (y,))
            x = x + y
        return x

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return drive(self.forward_stages(input_ids))


@torch.no_grad()
def dense_reference(
    input_ids: torch.Tensor,
    *,
    vocab: int = 1024,
    hidden: int = 512,
    intermediate: int = 2048,
    layers: int = 4,
    seed: int = 0,
) -> torch.Tensor:
    """The same model unsharded, in float32 on the CPU, in one process."""
    embed, up, down = _weights(vocab, hidden, intermediate, layers, seed)
    x = embed[input_ids.cpu()]
    for i in range(layers):
        x = x + nn.functional.silu(x @ up[i]) @ down[i]
    return x


def static_inputs() -> list:
    from graphplan.runtime import StaticInput

    return [StaticInput(name="input_ids", per="token", dtype=torch.int64, pad=0)]


def main() -> None:
    import os

    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    model = CommMLP(device=device)
    ids = torch.arange(64, device=device) % 1024
    out = model(ids)
    ref = dense_reference(ids)
    err = (out.float().cpu() - ref).abs().max().item()
    print(
        f"rank {model.rank}/{model.world}: checksum {out.float().sum().item():.4f}, "
        f"max |tp - dense| {err:.2e}"
    )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
