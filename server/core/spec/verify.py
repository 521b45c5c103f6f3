"""Acceptance: which of a request's k draft tokens the target keeps, and the token after them.

A speculative step scores a request's last token and its drafts d_1..d_k: row j of its logits is the
target's distribution p_j of the token after d_j (row 0: after the last token). Output: d_1..d_a
(the accepted prefix) and one more token, the target's at the first rejection (a < k) or the bonus
token from p_k (all k accepted), so 1..k+1 tokens per step.

- **Greedy** (temperature 0): d_j is accepted while it is argmax p_{j-1}; the token after is the
  argmax at the first mismatch. The output is the non-speculative greedy output exactly.
- **Sampled, deterministic drafts** (n-gram: q = one-hot at d_j): Leviathan et al. accept d_j with
  probability min(1, p(d_j) / q(d_j)) = p(d_j) and, on rejection, sample from
  norm(max(p - q, 0)) = p without d_j. ``target_tokens`` draws t_j ~ p_{j-1} by the sampler's own
  Gumbel-max at the request's step + j (server/core/sampling.py: temperature, top-k/top-p/min-p and
  the seed exactly as without speculation) and ``accepted`` keeps d_j while t_j = d_j: that
  happens with probability p(d_j), and t_j given t_j != d_j is distributed as p without d_j,
  renormalised, so this *is* the rejection sampler for a one-hot q, with its uniform coupled to
  the Gumbel noise. A seed therefore gives the very tokens it gives without speculation.
- **Sampled, drafts with a distribution q** (a draft model: ``rejection_sample``): vLLM's
  ``RejectionSampler``: accept d_j when u_j < min(1, p(d_j) / q(d_j)), else resample from
  norm(max(p - q, 0)); the bonus from p_k. Its uniforms and Gumbel noise come from the same
  counter hash as the sampler's (seed key, step + j), so a seed reproduces.
"""

from __future__ import annotations

from typing import Sequence

import torch

from graphplan.models.counter_hash import M32, mix32

from ..sampling import SampleOutput, Sampler, gumbel_noise, noise_row_keys, vocab_keys


def accepted(drafts: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a step commits: ``target[j]`` is the target's token at position j (j = 0..k;
    argmax, or ``target_tokens``' sample), ``drafts`` the k drafts. Drafts are kept while they
    equal the target's token; then the target's token at the first mismatch, or the bonus
    ``target[k]``."""
    if len(target) != len(drafts) + 1:
        raise ValueError(f"{len(target)} target tokens for {len(drafts)} drafts (needs k + 1)")
    for j, d in enumerate(drafts):
        if target[j] != d:
            return list(target[: j + 1])
    return list(target)


def target_tokens(
    sampler: Sampler,
    logits: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    *,
    logprobs: bool,
    penalise: bool = False,
) -> SampleOutput:
    """The target's token at each scored position: ``logits`` [N, vocab] (a request's k + 1 rows in
    order), ``slots`` [N] its sampler slot in each, ``offsets`` [N] the position (0..k). Greedy rows
    give the argmax, sampled rows the sampler's draw at the slot's step + offset, with the
    logprobs of the token at that row when asked for (``raw`` mode: the model's own distribution,
    the same whether the token is a draft kept or the last one). ``penalise``: a penalised
    request scores one position (it does not speculate), so its history is exact."""
    return sampler.sample(
        logits, slots, logprobs=logprobs, truncate=True, penalise=penalise, offsets=offsets
    )


def _uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[n, k] float64 uniforms in (0, 1): a pure function of each request's seed key [n] and the
    steps [n, k] (a salt keeps them apart from the Gumbel noise of the same step)."""
    bits = mix32(noise_row_keys(keys[:, None].expand_as(steps), steps) ^ 0x6A09E667)
    return ((bits & M32).double() + 0.5) * 2.0**-32


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    keys: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. / vLLM's RejectionSampler for drafts drawn from ``q``.

    ``p`` [n, k+1, vocab]: the target's probabilities at each position; ``q`` [n, k, vocab]: the
    draft's, which drew ``drafts`` [n, k]; ``keys`` [n] the requests' seed keys
    (``counter_hash.seed_key``), ``steps`` [n] their step (tokens generated so far). Returns
    (``num_accepted`` [n], ``tokens`` [n, k+1]): a request's output is
    ``tokens[i, : num_accepted[i] + 1]``."""
    n, k1, vocab = p.shape
    k = k1 - 1
    if q.shape != (n, k, vocab) or drafts.shape != (n, k):
        raise ValueError(
            f"q {list(q.shape)} and drafts {list(drafts.shape)} do not fit p {list(p.shape)}"
        )
    pos = steps[:, None] + torch.arange(k1, device=p.device)  # [n, k+1]
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0].double()
    q_d = q.gather(2, drafts[..., None])[..., 0].double()
    ok = _uniforms(keys, pos[:, :k]) * q_d < p_d  # u < p/q, q_d > 0 for a drawn draft
    residual = (p[:, :k] - q).clamp_(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q: a rejection has probability 0
    residual = torch.where(empty, p[:, :k], residual)
    dist = torch.cat([residual, p[:, k:]], dim=1)  # [n, k+1, vocab]: what position j resamples
    vk = vocab_keys(vocab, p.device)
    noise = gumbel_noise(keys.repeat_interleave(k1), pos.reshape(-1), vk).view(n, k1, vocab)
    drawn = (dist.log() + noise).argmax(dim=-1)  # Gumbel-max: log 0 = -inf is never drawn
    rejected = torch.cat([~ok, torch.ones(n, 1, dtype=torch.bool, device=p.device)], dim=1)
    num_accepted = rejected.int().argmax(dim=1)  # the first rejection (k: all accepted)
    tokens = torch.cat([drafts, drafts.new_zeros(n, 1)], dim=1)
    tokens.scatter_(1, num_accepted[:, None], drawn.gather(1, num_accepted[:, None]))
    return num_accepted, tokens
