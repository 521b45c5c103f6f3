"""Static input buffers: allocated once at the largest size, filled in place every step.

Graphs read their inputs from fixed addresses, so each input the model takes gets one buffer, and a
step copies the real rows in and makes sure the padding rows hold safe values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphplan.compiler.errors import BatchError

PER = ("token", "req", "req+1")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: on CUDA through pinned memory
    and a copy ordered on the stream (a plain ``.to`` waits for every step already launched, which
    async scheduling must not); elsewhere a plain ``.to``."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticInput:
    """One named model input that the runner keeps a static buffer for."""

    name: str
    """Keyword the model's forward takes."""
    per: str
    """Rows: ``token`` (num_tokens), ``req`` (num_reqs) or ``req+1`` (num_reqs + 1, e.g.
    query_start_loc)."""
    dtype: torch.dtype
    pad: int | float | str = 0
    """Value of padding rows: a constant (token 0, position 0, a dummy slot), or ``"last"`` to
    repeat the last real row (cumulative offsets: padded requests are empty)."""
    trailing: tuple[int, ...] = ()
    """Extra dimensions after the row dimension (e.g. ``(hidden,)`` for embeddings)."""

    def __post_init__(self):
        if self.per not in PER:
            raise ValueError(
                f"StaticInput {self.name!r}: per must be one of {PER}, not {self.per!r}"
            )
        if isinstance(self.pad, str) and self.pad != "last":
            raise ValueError(
                f"StaticInput {self.name!r}: pad must be a number or 'last', not {self.pad!r}"
            )

    def rows(self, tokens: int, reqs: int) -> int:
        return tokens if self.per == "token" else reqs + (self.per == "req+1")

    @property
    def fill(self) -> int | float:
        """The constant a row gets when there is no real row to repeat (``"last"``: 0)."""
        return 0 if isinstance(self.pad, str) else self.pad  # a str pad is "last"


def as_tuple(out) -> tuple:
    """A model's output (one tensor, or a tuple/list of them) as a tuple."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def real_rows(out, n: int):
    """The first ``n`` rows (the real tokens) of a model output of either form."""
    return tuple(o[:n] for o in out) if isinstance(out, (tuple, list)) else out[:n]


class StaticBuffers:
    """The runner's input buffers. Invariant for constant pads: rows >= ``_clean[name]`` hold the
    pad value, so a step fills only rows that a larger earlier step dirtied."""

    def __init__(
        self, specs: list[StaticInput], max_tokens: int, max_reqs: int, device: torch.device
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate static input names: {names}")
        if not any(s.per == "token" for s in specs):
            raise ValueError("at least one StaticInput must be per='token' (it gives num_tokens)")
        self.specs = tuple(specs)
        self.device = torch.device(device)
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self.buffers: dict[str, torch.Tensor] = {}
        self._clean: dict[str, int] = {}
        for s in specs:
            shape = (s.rows(max_tokens, max_reqs), *s.trailing)
            buf = torch.empty(shape, dtype=s.dtype, device=self.device)
            buf.fill_(s.fill)
            self.buffers[s.name] = buf
            self._clean[s.name] = 0
        self.device = next(iter(self.buffers.values())).device  # "cuda" -> "cuda:0"
        self.token_input = next(s.name for s in specs if s.per == "token")
        """The first per-token input: its row count is the batch's token count."""

    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> int:
        try:
            return inputs[self.token_input].shape[0]
        except KeyError:
            raise BatchError(f"batch is missing input {self.token_input!r}") from None

    def check(self, inputs: dict[str, torch.Tensor], tokens: int, reqs: int | None) -> None:
        """Every input present, of the right dtype, device and row count; nothing extra."""
        if len(inputs) != len(self.specs):
            extra = sorted(set(inputs) - set(self.buffers))
            missing = sorted(set(self.buffers) - set(inputs))
            raise BatchError(
                f"batch inputs do not match the runner's: missing {missing}, unexpected {extra}"
            )
        for s in self.specs:
            t = inputs.get(s.name)
            if t is None:
                raise BatchError(f"batch is missing input {s.name!r}")
            if t.dtype != s.dtype or t.device != self.device:
                raise BatchError(
                    f"input {s.name!r} is {t.dtype} on {t.device}; the runner's "
                    f"buffer is {s.dtype} on {self.device} (convert it with "
                    f".to({self.device}, {s.dtype}))"
                )
            if s.per != "token" and reqs is None:
                raise BatchError(f"input {s.name!r} is per request: pass num_reqs")
            want = s.rows(tokens, reqs or 0)
            if tuple(t.shape) != (want, *s.trailing):
                raise BatchError(
                    f"input {s.name!r} has shape {tuple(t.shape)}, expected "
                    f"{(want, *s.trailing)} for {tokens} tokens / {reqs} requests"
                )

    def load(
        self,
        inputs: dict[str, torch.Tensor],
        tokens: int,
        reqs: int,
        padded_tokens: int,
        padded_reqs: int,
    ) -> None:
        """Copy the real rows in; make rows up to the padded counts hold pad values.

        The copies go out as one ``torch._foreach_copy_`` over byte views (one kernel on a GPU
        for every input, whatever their dtypes, instead of a copy each): launches are the step's
        overhead outside the graph. An input that is not contiguous is copied on its own."""
        dsts, srcs = [], []
        for s in self.specs:
            buf = self.buffers[s.name]
            src = inputs[s.name]
            k = src.shape[0]
            # contiguous by torch's rule, yet a size-1 last dim may keep any stride (a [1] column
            # of a [1, n] tensor), which a byte view refuses
            if k and src.is_contiguous() and src.stride(-1) == 1:
                dsts.append(buf[:k].view(torch.uint8))
                srcs.append(src.view(torch.uint8))
            else:
                buf[:k].copy_(src, non_blocking=True)
            if s.pad == "last":
                p = s.rows(padded_tokens, padded_reqs)
                if p > k:
                    buf[k:p].copy_(src[k - 1 : k].expand(p - k, *s.trailing))
                continue
            clean = self._clean[s.name]
            if clean > k:
                buf[k:clean].fill_(s.fill)  # the constant pad
            self._clean[s.name] = k
        if dsts:
            # torch._foreach_copy_: the multi-tensor copy torch's optimizers and cudagraph trees
            # use for the same job (torch >= 2.1); dst rows and src never overlap
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def reset(self, padded_tokens: int, padded_reqs: int) -> None:
        """Pad values everywhere up to the given counts (what graphs are captured on)."""
        for s in self.specs:
            buf = self.buffers[s.name]
            buf[: s.rows(padded_tokens, padded_reqs)].fill_(s.fill)
            self._clean[s.name] = 0

    def views(self, tokens: int, reqs: int) -> dict[str, torch.Tensor]:
        return {s.name: self.buffers[s.name][: s.rows(tokens, reqs)] for s in self.specs}

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
