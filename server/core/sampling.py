"""A batched sampler that a CUDA graph can hold: one step's sampling is a fixed-shape function of the
logits and of static per-row tensors, with no host reads, the same code for greedy and sampled rows.

Per row (a *slot*, e.g. the request's cache row) the sampler keeps its parameters, a 32-bit key
derived from the request's seed, a step counter and, with penalties on, its token history. A step:

    slots = sampler.load_slots([3, 0, 5], size=8)  # padded with a neutral greedy slot
    out = sampler.sample(logits[:8], slots)         # [8, vocab] -> out.token_ids [8], on device
    sampler.update(slots, out.token_ids)            # after the step: history and step counters
    tokens = out.token_ids[:3].tolist()             # the caller's one host read

What ``sample`` does per row (vLLM's order and semantics):

1. logits in float32; with ``logprobs_mode="raw"`` the logprobs come from these (vLLM's default:
   the model's own distribution, before penalties, temperature and truncation).
2. Penalties: repetition (prompt + generated tokens: a positive logit divided by it, a negative one
   multiplied), then frequency (times each generated token's count) and presence (once per
   generated token), both subtracted.
3. Temperature: logits / T (T = 1 for greedy rows).
4. Truncation, as one threshold per row on the sorted scaled logits: top-k (ties with the k-th
   are kept), min-p (probability at least min_p times the largest), then top-p over what is left
   (drop the least likely tokens while their total probability stays <= 1 - top_p; the likeliest
   token always stays; ties with the cut are kept). ``logprobs_mode="processed"``: logprobs of
   this truncated, scaled distribution.
5. Gumbel-max: the token is argmax(scaled logit + g) over kept tokens, g = -log(-log u), which
   samples softmax(kept / T) exactly. Greedy rows add no noise and keep every token: argmax.

The uniform u of token v at a row's step comes from a counter-based hash of (seed key, step, v) in
integer tensor ops, not from a generator: the same seed gives the same tokens alone or in any batch,
in any row, eager or replayed. The hash works on 32-bit values held in int64, with multipliers below
2**31, so no product overflows on any device.

Cost: a step is a few dozen elementwise ops, one sort, one softmax and one cumsum over [R, vocab]
(``bench/sampling_bench.py``); its [R, vocab] temporaries (float32 and int64, at most ~33 bytes per
logit alive at once, in the noise hash) live in the captured graph's memory pool. The server captures
``sample`` + ``update`` per padded row count (server/core/step_sampler.py): a padding row names
``pad_slot``, whose parameters stay neutral, so its counter and history may grow without effect.
``penalties=True`` keeps an int32 [max_num_seqs + 1, vocab] history.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from ...models.counter_hash import M32, mix32, seed_key
from ..sampling_params import SamplingParams

PROMPT_BIT = 1 << 30
"""History marks a prompt token with this bit; the low bits count generated tokens."""
_F_TEMP, _F_TOP_P, _F_TOP_K, _F_MIN_P, _F_PRES, _F_FREQ, _F_REP = range(7)
_NEUTRAL = (0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0)  # greedy, nothing penalised (top_k: the vocab)


def vocab_keys(vocab_size: int, device=None) -> torch.Tensor:
    """[vocab] int64: each token id's 32-bit key, mixed into every row's noise."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return mix32((v * 0x2545F491 + 0x68E31DA4) & M32)


def noise_row_keys(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[R] int64: each row's 32-bit noise key at its step, from its seed key [R] and step [R]."""
    step_keys = mix32((steps * 0x3C6EF372 + 0x1B873593) & M32)
    return mix32(keys ^ step_keys)


def gumbel_noise(keys: torch.Tensor, steps: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """[R, vocab] float32 Gumbel noise, a pure function of each row's seed key [R], step [R] and
    the token keys [vocab] (``vocab_keys``): no generator state, so any batch reproduces it."""
    bits = mix32(noise_row_keys(keys, steps)[:, None] ^ vocab)  # [R, vocab] in [0, 2**32)
    # 23 bits + 1/2: u in (0, 1) exactly representable, so log(u) < 0 and -log(-log u) finite
    u = ((bits >> 9).float() + 0.5) * 2.0**-23
    return u.log_().neg_().log_().neg_()


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One step's results, tensors on the sampler's device, one row per logits row."""

    token_ids: torch.Tensor
    """[R] int64."""
    logprobs: torch.Tensor | None = None
    """[R] float32: the chosen token's logprob (None when the sampler returns no logprobs)."""
    top_logprobs: torch.Tensor | None = None
    """[R, max_logprobs] float32, largest first; a row asking for fewer reads a prefix."""
    top_ids: torch.Tensor | None = None
    """[R, max_logprobs] int64, the token ids of ``top_logprobs``."""


class Sampler:
    """Static per-row state for ``max_num_seqs`` slots plus one padding slot (``pad_slot``: greedy,
    never set). ``max_logprobs`` (0..20) and ``penalties`` are fixed per sampler, so one captured
    graph serves every mix of requests; ``penalties=False`` saves the [slots, vocab] history."""

    def __init__(
        self,
        max_num_seqs: int,
        vocab_size: int,
        *,
        device: torch.device | str = "cpu",
        max_logprobs: int = 0,
        logprobs_mode: str = "raw",
        penalties: bool = True,
        fused: bool = False,
        rng: random.Random | None = None,
    ):
        if max_num_seqs < 1 or not 1 <= vocab_size < 2**24:
            raise ValueError(
                f"Sampler needs max_num_seqs >= 1 and 1 <= vocab_size < 2**24, not "
                f"{max_num_seqs} and {vocab_size}"
            )
        if not 0 <= max_logprobs <= min(vocab_size, 20):
            raise ValueError(f"max_logprobs must be 0..min(vocab_size, 20), not {max_logprobs}")
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', not {logprobs_mode!r}")
        self.max_num_seqs, self.vocab_size = max_num_seqs, vocab_size
        self.device = torch.device(device)
        self.max_logprobs, self.logprobs_mode = max_logprobs, logprobs_mode
        self.penalties = penalties
        self._kernels = _sampling_kernels(self.device) if fused else None
        """``fused``: the noise, mask and argmax as one Triton kernel (server/core/sampling_kernels.py)."""
        self.pad_slot = max_num_seqs
        self._rng = rng or random.Random()
        rows, dev = max_num_seqs + 1, self.device
        self._neutral = torch.tensor(_NEUTRAL, dtype=torch.float32)
        self._neutral[_F_TOP_K] = vocab_size
        self._floats = self._neutral.repeat(rows, 1).to(dev)  # [rows, 7]
        self._keys = torch.zeros(rows, dtype=torch.int64, device=dev)  # seed_key per row
        self._steps = torch.zeros(rows, dtype=torch.int64, device=dev)  # tokens sampled so far
        self._history = (  # [rows, vocab] generated-token counts | PROMPT_BIT
            torch.zeros(rows, vocab_size, dtype=torch.int32, device=dev) if penalties else None
        )
        self._vocab_keys = vocab_keys(vocab_size, dev)
        self._slots = torch.full((max_num_seqs,), self.pad_slot, dtype=torch.int64, device=dev)

    # host-side updates, between steps

    def set_row(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        """Give ``slot`` to a request: its parameters, its seed (a random one when unseeded), step
        0 and, when it is penalised, its prompt's tokens for the repetition penalty."""
        self._check_slot(slot)
        if params.penalised and not self.penalties:
            raise ValueError(
                "this sampler was built with penalties=False; presence, frequency and "
                "repetition penalties need penalties=True"
            )
        ids = list(prompt_ids) if self.penalties and params.repetition_penalty != 1 else []
        if ids and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            raise ValueError(f"prompt token ids must be in 0..{self.vocab_size - 1}")
        row = self._neutral.clone()
        if not params.greedy:
            row[_F_TEMP] = params.temperature
            row[_F_TOP_P] = params.top_p
            row[_F_TOP_K] = (
                self.vocab_size if params.top_k <= 0 else min(params.top_k, self.vocab_size)
            )
            row[_F_MIN_P] = params.min_p
        row[_F_PRES] = params.presence_penalty
        row[_F_FREQ] = params.frequency_penalty
        row[_F_REP] = params.repetition_penalty
        self._floats[slot].copy_(row)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        self._keys[slot] = seed_key(seed)
        self._steps[slot] = 0
        if self._history is not None:
            self._history[slot].zero_()
            if ids:
                index = torch.tensor(ids, dtype=torch.int64).to(self.device)
                self._history[slot].index_fill_(0, index, PROMPT_BIT)

    def clear_row(self, slot: int) -> None:
        """Free ``slot``: neutral greedy parameters (its history is reset by the next set_row)."""
        self._check_slot(slot)
        self._floats[slot].copy_(self._neutral)
        self._steps[slot] = 0

    def update(self, slots, token_ids) -> None:
        """Record one sampled token per slot (tensors on the device or sequences): the history
        the penalties read and the step counter the noise reads. Call it once after every step."""
        slots = torch.as_tensor(slots, dtype=torch.int64).to(self.device)
        tokens = torch.as_tensor(token_ids, dtype=torch.int64).to(self.device)
        self._steps.index_add_(0, slots, torch.ones_like(slots))
        if self._history is not None:  # scatter_add_: atomic adds, no sort, capturable
            one = torch.ones((), dtype=torch.int32, device=self.device).expand(slots.shape)
            self._history.view(-1).scatter_add_(0, slots * self.vocab_size + tokens, one)

    def load_slots(self, slots: Sequence[int], size: int | None = None) -> torch.Tensor:
        """Copy a step's slots into the sampler's static slot buffer, padded with ``pad_slot`` to
        ``size`` (a captured graph's row count), and return that view of the buffer."""
        size = len(slots) if size is None else size
        if not len(slots) <= size <= self.max_num_seqs:
            raise ValueError(
                f"cannot pad {len(slots)} slots to {size} rows: the size must be between the "
                f"number of slots and max_num_seqs ({self.max_num_seqs})"
            )
        for s in slots:
            self._check_slot(s)
        padded = list(slots) + [self.pad_slot] * (size - len(slots))
        self._slots[:size].copy_(torch.tensor(padded, dtype=torch.int64))
        return self._slots[:size]

    def slot_state(self, slot: int) -> tuple[int, list[int]]:
        """``slot``'s step counter and its history row as a list (empty with ``penalties=False``),
        read back to the host: for tests and debugging, never in a step."""
        if not (isinstance(slot, int) and 0 <= slot <= self.pad_slot):
            raise ValueError(f"slot {slot!r} is outside 0..{self.pad_slot}")
        history = self._history[slot].tolist() if self._history is not None else []
        return int(self._steps[slot]), history

    def _check_slot(self, slot) -> None:
        if not (isinstance(slot, int) and 0 <= slot < self.max_num_seqs):
            raise ValueError(f"slot {slot!r} is outside 0..{self.max_num_seqs - 1}")

    # the step: device ops only, fixed shapes

    def sample(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        *,
        logprobs: bool = True,
        truncate: bool = True,
        penalise: bool = True,
        offsets: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Sample one token per row of ``logits`` [R, vocab] for the slots ``slots`` [R] (int64, on
        the device). Reads nothing back to the host, so it can be captured in a CUDA graph.
        ``offsets`` [R] (speculative decoding, server/core/spec/verify.py): each row samples as its
        slot would ``offsets[i]`` steps later (a slot may then appear in several rows, one per
        position it scores; its noise is that of its step + offset).

        Three switches leave out work that no row of the step needs (the caller knows its rows'
        parameters; a switch left on is always correct):
        ``logprobs=False`` skips the logprobs (a softmax and a top-k over [R, vocab]) of a sampler
        built with ``max_logprobs``: no request asked for them. ``truncate=False`` skips the
        thresholds (a sort, a softmax and a cumsum over [R, vocab]): no row truncates
        (``SamplingParams.truncates``), so every token is kept. ``penalise=False`` skips the
        history: no row is penalised (``SamplingParams.penalised``). Each gives the same tokens
        as the switch left on: with every token kept the threshold only drops tokens whose
        probability is 0 in float32, which Gumbel-max can never pick (their scaled logit is
        over 87 below the row's largest, the noise spans less than 20)."""
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [rows, {self.vocab_size}], not {list(logits.shape)}")
        raw = logits.float()
        p = self._floats[slots]  # [R, 7]
        steps = self._steps[slots] if offsets is None else self._steps[slots] + offsets
        temp, top_p, top_k, min_p = (p[:, i : i + 1] for i in range(4))
        greedy = temp < 1e-5  # [R, 1]
        x = raw
        if penalise and self._history is not None:
            x = _penalised(raw, self._history[slots], p)
        scaled = x / torch.where(greedy, 1.0, temp)
        threshold: torch.Tensor | None = None  # [R, 1]; greedy rows keep every token
        if truncate:
            cut = self._threshold(scaled, top_p, top_k, min_p)
            threshold = torch.where(greedy, float("-inf"), cut)
        if self._kernels is not None:
            if threshold is None:
                threshold = scaled.new_full((scaled.shape[0], 1), float("-inf"))
            row_keys = noise_row_keys(self._keys[slots], steps)
            tokens = self._kernels.gumbel_argmax(scaled, threshold[:, 0], row_keys, greedy[:, 0])
        else:
            noise = gumbel_noise(self._keys[slots], steps, self._vocab_keys)
            noisy = scaled + noise.masked_fill_(greedy, 0.0)
            if threshold is not None:
                noisy.masked_fill_(scaled < threshold, float("-inf"))
            tokens = noisy.argmax(dim=-1)
        if not (self.max_logprobs and logprobs):
            return SampleOutput(tokens)
        source = raw
        if self.logprobs_mode == "processed":
            source = (
                scaled if threshold is None else scaled.masked_fill(scaled < threshold, -math.inf)
            )
        lp = torch.log_softmax(source, dim=-1)
        top = lp.topk(self.max_logprobs, dim=-1)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
        return SampleOutput(tokens, chosen, top.values, top.indices)

    def _threshold(self, scaled, top_p, top_k, min_p) -> torch.Tensor:
        """[R, 1]: the smallest scaled logit that top-k, min-p and top-p keep."""
        ordered = scaled.sort(dim=-1).values  # ascending
        vocab = self.vocab_size
        kth = ordered.gather(1, (vocab - top_k.clamp(1, vocab)).long())
        threshold = torch.maximum(kth, ordered[:, -1:] + torch.log(min_p))
        probs = torch.softmax(ordered.masked_fill(ordered < threshold, float("-inf")), dim=-1)
        dropped = (probs.cumsum(dim=-1) <= 1 - top_p).sum(dim=-1, keepdim=True)
        return torch.maximum(threshold, ordered.gather(1, dropped.clamp_(max=vocab - 1)))


def _sampling_kernels(device: torch.device):
    """server/core/sampling_kernels.py where its Triton kernel can run on ``device`` (CUDA, or any
    device under ``TRITON_INTERPRET=1``); a ValueError saying why not otherwise."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"fused=True needs a CUDA device (or TRITON_INTERPRET=1), not {device}")
    try:
        from . import sampling_kernels
    except ImportError as e:
        raise ValueError(f"fused=True needs triton ({e})") from None
    return sampling_kernels


def _penalised(x: torch.Tensor, history: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``x`` [R, vocab], from each row's token
    ``history`` [R, vocab] (counts, the prompt bit) and its parameters ``p`` [R, 7]."""
    counts = (history & (PROMPT_BIT - 1)).float()
    rep = p[:, _F_REP : _F_REP + 1]
    x = torch.where(history != 0, torch.where(x > 0, x / rep, x * rep), x)
    x = x - p[:, _F_FREQ : _F_FREQ + 1] * counts
    return x - p[:, _F_PRES : _F_PRES + 1] * (counts > 0).float()
