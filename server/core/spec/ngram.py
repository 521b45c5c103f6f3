"""Prompt lookup (n-gram) drafts, numpy on the host: the k tokens that followed the most recent
earlier occurrence of the sequence's last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) in prompt + output. No weights: a draft is a guess that the text repeats.

When the occurrence is close to the end (the continuation runs into the last n tokens themselves),
the draft goes on with the period it found (``abcab`` -> ``cabca...``), which is what the text
predicts if it keeps repeating."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(tokens: Sequence[int] | np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``tokens`` (empty: no n-gram recurs)."""
    seq = np.asarray(tokens, dtype=np.int64)
    size = len(seq)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # windows over seq[:-1]: row i is seq[i : i + n], i < size - n (an earlier occurrence)
        windows = sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[size - n :]).all(axis=1))
        if len(hits):
            i = int(hits[-1])
            period = size - n - i
            ext = seq.tolist()
            for _ in range(k):
                ext.append(ext[len(ext) - period])
            return ext[size:]
    return []


class NgramProposer:
    """The ``Proposer`` (server/core/spec/proposer.py) of ``method: ngram``."""

    def __init__(self, k: int, n_max: int, n_min: int):
        self.k, self.n_max, self.n_min = k, n_max, n_min

    def propose(
        self, seqs: Sequence[Sequence[int]], ks: Sequence[int], rows: Sequence[int] = ()
    ) -> list[list[int]]:
        return [ngram_propose(s, k, self.n_max, self.n_min) if k else [] for s, k in zip(seqs, ks)]
