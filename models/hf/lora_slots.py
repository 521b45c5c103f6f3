"""Batched LoRA in one step: adapters in static device slots, each token's slot in a static input.

``LoraSlots`` holds, per decoder layer and per fused projection of ``fused_decoder`` (``qkv``:
q|k|v, ``o``, ``gate_up``: gate|up, ``down``), every slot's A and B stacked along the rank:

    A [S * n * R, in]      rows (slot s, sub-projection j, rank i) at s*n*R + j*R + i
    B [out, S * n * R]     sub-projection j's output rows read only its own columns (zero elsewhere)

with S = ``max_loras``, R = ``max_rank`` (a smaller rank is zero-padded) and n the sub-projections
of the fused weight. A step's ``lora_slots`` ``[T]`` (slot per token; -1: the base model, and every
padding row) becomes a mask ``[T, S * n * R]`` holding the slot's scale on the token's own columns,
and each adapted projection ``y = x W^T`` gains

    y += ((x A^T) * mask) B^T        = scale[slot] * (x A[slot]^T) B[slot]^T per token

two GEMMs and a multiply, the same kernels for any mix of adapters, reading only static buffers:
a captured graph replays with any slot assignment. A token of the base model adds exact zeros.

``LoraManager`` keeps adapters on the host (any number), up to S of them in device slots (least
recently used evicted, never one a running sequence uses), and each sequence seat's slot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
import torch.nn.functional as F

from graphplan.compiler.errors import GraphplanError
from graphplan.runtime.buffers import StaticInput
from graphplan.runtime.lora_case import current_lora_case

from .errors import ModelLoadError
from .fused_ops import use_triton
from .lora import LoraAdapter, projection_shapes

LORA_SLOTS_INPUT = StaticInput(name="lora_slots", per="token", dtype=torch.int64, pad=-1)
"""The runner's buffer of each token's slot (padding rows: -1, no adapter)."""
MAX_LORAS, MAX_RANK = 256, 512

GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""The fused decoder's projections -> the model's projections they hold, in row order."""


class LoraSlotError(GraphplanError):
    """An adapter cannot get a device slot now, or is unknown, or is in use."""


class LoraSlots:
    """Static device buffers of ``max_loras`` adapter slots (module docstring)."""

    def __init__(self, config, *, max_loras: int, max_rank: int, dtype, device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.layers = config.num_hidden_layers
        shapes = projection_shapes(config)
        s, r = max_loras, max_rank
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(self.layers):
            per = {}
            for g, mods in GROUPS.items():
                n, inp = len(mods), shapes[mods[0]][1]
                out = sum(shapes[m][0] for m in mods)
                a = torch.zeros(s * n * r, inp, dtype=dtype, device=device)
                b = torch.zeros(out, s * n * r, dtype=dtype, device=device)
                per[g] = (a, b)
            self.weights.append(per)
        self.shapes = shapes
        self.bounds = {  # the first output row of each sub-projection after the first
            g: tuple(sum(shapes[m][0] for m in mods[:i]) for i in range(1, len(mods)))
            for g, mods in GROUPS.items()
        }
        self.kernel = "auto"
        """``torch`` (the masked GEMMs above), ``triton`` (``lora_kernels``: each token reads only
        its slot, as punica's BGMV) or ``auto``: Triton for steps of at most
        ``triton_max_tokens`` tokens where Triton runs (``fused_ops.use_triton``), else torch.
        Decided when a forward runs: a captured graph keeps its choice."""
        self.triton_max_tokens = 16
        self.scales = torch.zeros(s, dtype=dtype, device=device)
        self.slot_ids = torch.arange(s, device=device)

    @torch.no_grad()
    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (what it does not adapt stays zero)."""
        s, r = slot, self.max_rank
        for layer, per in enumerate(self.weights):
            for g, mods in GROUPS.items():
                a_all, b_all = per[g]
                n = len(mods)
                a_all[s * n * r : (s + 1) * n * r].zero_()
                b_all[:, s * n * r : (s + 1) * n * r].zero_()
                row = 0
                for j, m in enumerate(mods):
                    out = self.shapes[m][0]
                    ab = adapter.weights.get((layer, m))
                    if ab is not None:
                        a, b = ab
                        col = (s * n + j) * r
                        a_all[col : col + a.shape[0]].copy_(a)
                        b_all[row : row + out, col : col + b.shape[1]].copy_(b)
                    row += out
        self.scales[slot] = adapter.scale

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile the Triton kernels for every projection's widths now (one token of no
        adapter): a kernel must not first load while a CUDA graph is being captured."""
        if not self.weights or not use_triton(self.scales):
            return
        from .lora_kernels import lora_add

        slot = torch.full((1,), -1, dtype=torch.int64, device=self.scales.device)
        for g, (a, b) in self.weights[0].items():
            x, y = a.new_zeros(1, a.shape[1]), b.new_zeros(1, b.shape[0])
            lora_add(y, x, a, b, slot, self.scales, self.bounds[g], self.max_rank)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.scales[slot] = 0.0

    def step(self, lora_slots: torch.Tensor | None) -> "LoraStep | None":
        """What a forward's projections add for tokens in slots ``lora_slots`` ``[T]``, or None
        when this forward records no LoRA kernels (a graph of LoRA case 0, or no slots given)."""
        if lora_slots is None or current_lora_case() == 0:
            return None
        return LoraStep(self, lora_slots)


class LoraStep:
    """One forward's masks (module docstring); ``add`` applies a layer's adapters."""

    __slots__ = ("slots", "masks", "tokens", "triton")

    def __init__(self, slots: LoraSlots, lora_slots: torch.Tensor):
        self.slots, self.tokens = slots, lora_slots
        t, s, r = lora_slots.shape[0], slots.max_loras, slots.max_rank
        self.triton = slots.kernel == "triton" or (
            slots.kernel == "auto" and t <= slots.triton_max_tokens and use_triton(lora_slots)
        )
        if self.triton:
            self.masks = {}
            return
        onehot = (lora_slots[:, None] == slots.slot_ids[None, :]).to(slots.scales.dtype)
        onehot = onehot * slots.scales[None, :]  # [T, S]: the token's slot's scale, else 0
        self.masks = {
            n: onehot[:, :, None].expand(t, s, n * r).reshape(t, s * n * r) for n in (1, 2, 3)
        }

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """``y`` (the projection ``group`` of layer ``layer`` of ``x``) plus its adapters'
        update, in place."""
        a, b = self.slots.weights[layer][group]
        if self.triton:
            from .lora_kernels import lora_add

            s = self.slots
            return lora_add(
                y, x.contiguous(), a, b, self.tokens, s.scales, s.bounds[group], s.max_rank
            )
        shrink = F.linear(x, a) * self.masks[len(GROUPS[group])]
        return y.addmm_(shrink, b.t())


class LoraManager:
    """Adapters by name on the host, up to ``max_loras`` in device slots (least recently used
    evicted), and the slot of each sequence seat; ``assign`` binds a step's seats, and
    ``token_slots`` and ``num_active`` describe its batch."""

    def __init__(self, slots: LoraSlots, num_seats: int):
        self.slots = slots
        self.adapters: dict[str, LoraAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self.seat_slot = [-1] * num_seats
        self.seat_name: list[str | None] = [None] * num_seats
        self.lock = threading.Lock()
        """Held by the engine's step (``assign``) and by loads and unloads from other threads."""

    def add(self, adapter: LoraAdapter) -> None:
        """Register ``adapter`` (replacing one of the same name: its slot is reloaded on use)."""
        self._evict(adapter.name)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Forget adapter ``name`` (the caller makes sure no running sequence uses it)."""
        if name not in self.adapters:
            raise LoraSlotError(f"LoRA adapter {name!r} is not loaded")
        self._evict(name)
        del self.adapters[name]

    def _evict(self, name: str) -> None:
        slot = self.resident.pop(name, None)
        if slot is not None:
            self.slots.clear(slot)
        for seat, n in enumerate(self.seat_name):
            if n == name:
                self.seat_slot[seat], self.seat_name[seat] = -1, None

    def acquire(self, name: str, keep=frozenset()) -> int:
        """The device slot of adapter ``name``, loading it when it is not resident (into a free
        slot, else the least recently used one whose adapter is not in ``keep``)."""
        if name not in self.adapters:
            raise LoraSlotError(f"LoRA adapter {name!r} is not loaded")
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        taken = set(self.resident.values())
        free = [s for s in range(self.slots.max_loras) if s not in taken]
        if not free:
            idle = next((n for n in self.resident if n not in keep), None)
            if idle is None:
                raise LoraSlotError(
                    f"all {self.slots.max_loras} LoRA slots hold adapters in use (--max-loras)"
                )
            free = [self.resident.pop(idle)]
        self.slots.load(free[0], self.adapters[name])
        self.resident[name] = free[0]
        return free[0]

    def assign(self, pairs) -> int:
        """Bind each ``(seat, adapter name or None)`` of a step; returns its count of distinct
        adapters (its ``num_active_loras``). At most ``max_loras`` of them."""
        with self.lock:
            return self._assign(pairs)

    def _assign(self, pairs) -> int:
        names = {n for _, n in pairs if n is not None}
        if len(names) > self.slots.max_loras:
            raise LoraSlotError(
                f"a step with {len(names)} adapters; at most {self.slots.max_loras} (--max-loras)"
            )
        for n in names:
            self.acquire(n, keep=names)
        for seat, n in pairs:
            self.seat_slot[seat] = -1 if n is None else self.resident[n]
            self.seat_name[seat] = n
        return len(names)

    def bind(self, seat: int, name: str | None) -> int:
        """Seat ``seat`` runs adapter ``name`` (None: the base model), keeping every other seat's
        adapter resident; its slot."""
        keep = {n for n in self.seat_name if n is not None} | {name}
        slot = -1 if name is None else self.acquire(name, keep=keep)
        self.seat_slot[seat], self.seat_name[seat] = slot, name
        return slot

    def token_slots(self, reqs) -> torch.Tensor:
        """``[T]`` int64 slot per token of ``reqs`` (``(seat, start_pos, token_ids)``)."""
        out: list[int] = []
        for seat, _, ids in reqs:
            out.extend([self.seat_slot[seat]] * len(ids))
        return torch.tensor(out, dtype=torch.int64)

    def num_active(self, seats) -> int:
        """Distinct adapters among the sequences on ``seats`` (the step's ``num_active_loras``)."""
        return len({self.seat_slot[s] for s in seats} - {-1})


def enable_lora(model, max_loras: int, max_rank: int, num_seats: int) -> LoraManager:
    """Give a ``PagedCausalLM`` with the fused decoder ``max_loras`` adapter slots of rank up to
    ``max_rank`` (allocated now, before the KV pool is sized from what is left)."""
    if not 1 <= max_loras <= MAX_LORAS or not 1 <= max_rank <= MAX_RANK:
        raise ModelLoadError(
            f"max_loras={max_loras}, max_lora_rank={max_rank}: expected 1..{MAX_LORAS} and "
            f"1..{MAX_RANK}"
        )
    if model.fused is None:
        raise ModelLoadError(
            f"LoRA adapters run in the fused decoder, which this model cannot use "
            f"({model.fused_reason}); serve a Llama-family model with fused_ops on"
        )
    weight = model.fused.embed
    slots = LoraSlots(
        model.hf.config,
        max_loras=max_loras,
        max_rank=max_rank,
        dtype=weight.dtype,
        device=weight.device,
    )
    slots.warm_up()
    model.fused.lora = slots
    return LoraManager(slots, num_seats)
