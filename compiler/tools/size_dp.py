"""The exact dynamic program behind ``plan optimize``: choose capture sizes from sorted candidates.

Problem. Candidates ``c_1 < ... < c_D`` (``c_0 = 0`` is a virtual start), candidate ``j`` costs
``weight[j] >= 1`` units of the graph budget ``K``. Choosing a set S that contains ``c_D`` pads
every counted step of ``n`` tokens up to the smallest chosen size ``>= n``. A chosen chain
``0 = i_0 < i_1 < ... < i_m = D`` costs

    sum over links (i, j):  g(i, j) = c_j * (W_j - W_i) - (S_j - S_i)

where ``W_j`` / ``S_j`` are the step count / token sum of the counted steps with ``n <= c_j``, i.e.
the padding tokens of the steps in ``(c_i, c_j]``. A link is allowed only when ``lo[j] <= i``:
``lo`` encodes the sizes that must not be skipped (pinned sizes) and segments where some step
would land on no graph. Minimise the total cost subject to ``sum weight <= K``; among optimal sets,
take the one with the fewest budget units.

Method. ``f[k][j]`` = least cost of a chain ending at ``j`` using at most ``k`` units;
``f[k][j] = min_i f[k - weight[j]][i] + g(i, j)``. ``g`` is Monge (for ``i < i'``, ``j < j'``:
``g(i,j) + g(i',j') - g(i,j') - g(i',j) = (c_j - c_j')(W_i' - W_i) <= 0``); forbidden links get
the penalties ``BIG * max(0, lo[j] - i)`` and ``BIG * max(0, i - j + 1)``, convex functions of a
row-monotone minus a column-monotone index, hence Monge too when ``lo`` is nondecreasing. So the
leftmost minimising ``i`` is nondecreasing in ``j`` and each layer's row minima come from a
divide-and-conquer over rows, vectorized level by level with numpy: O(K * V * D log D) time for V
distinct weights, O(K * D) memory. All arithmetic is int64, so ties are exact. When ``lo`` is not
nondecreasing, ``solve`` falls back to the dense O(K * D^2) layer (also exact).
"""

from __future__ import annotations

import numpy as np


def _penalized(f_prev, c, W, S, lo, big):
    def value(j, i):
        return (
            f_prev[i]
            + c[j] * (W[j] - W[i])
            - (S[j] - S[i])
            + big * (np.maximum(0, lo[j] - i) + np.maximum(0, i - j + 1))
        )

    return value


def _row_minima_dc(rows: np.ndarray, value, ncols: int) -> tuple[np.ndarray, np.ndarray]:
    """Leftmost row minima of a Monge matrix, rows ascending: divide and conquer on rows, every
    subproblem of one recursion level evaluated in one vectorized pass."""
    m = len(rows)
    best = np.empty(m, dtype=np.int64)
    arg = np.empty(m, dtype=np.int64)
    a, b = np.array([0]), np.array([m])
    lo_col, hi_col = np.array([0]), np.array([ncols - 1])
    while a.size:
        mid = (a + b) >> 1
        lens = hi_col - lo_col + 1
        offs = np.cumsum(lens) - lens
        task = np.repeat(np.arange(a.size), lens)
        cols = np.arange(int(lens.sum())) - offs[task] + lo_col[task]
        v = value(rows[mid][task], cols)
        mins = np.minimum.reduceat(v, offs)
        hits = np.flatnonzero(v == mins[task])
        opt = cols[hits[np.searchsorted(hits, offs)]]
        best[mid], arg[mid] = mins, opt
        left, right = mid > a, mid + 1 < b
        a, b, lo_col, hi_col = (
            np.concatenate((a[left], mid[right] + 1)),
            np.concatenate((mid[left], b[right])),
            np.concatenate((lo_col[left], opt[right])),
            np.concatenate((opt[left], hi_col[right])),
        )
    return best, arg


def _row_minima_dense(rows: np.ndarray, value, ncols: int) -> tuple[np.ndarray, np.ndarray]:
    cols = np.arange(ncols)
    v = value(rows[:, None], cols[None, :])
    arg = np.argmin(v, axis=1)
    return v[np.arange(len(rows)), arg], arg


def _layers(
    sizes, weight, lo, W, S, budget: int, dense: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(f, arg, w, big) of the problem: ``f[k, j]`` least cost of a chain ending at j within k
    units (>= big: none), ``arg`` its predecessor; None when there is nothing to choose."""
    c = np.concatenate(([0], np.asarray(sizes, dtype=np.int64)))
    w = np.concatenate(([0], np.asarray(weight, dtype=np.int64)))
    lo = np.asarray(lo, dtype=np.int64)
    W, S = np.asarray(W, dtype=np.int64), np.asarray(S, dtype=np.int64)
    D = len(c) - 1
    if D == 0 or budget < 1:
        return None
    if np.any(w[1:] < 1):
        raise ValueError("every candidate needs weight >= 1")
    big = int(W[-1]) * int(c[-1]) + 1  # more than any allowed chain costs
    inf = big * 4 * (D + 2)  # an unreachable state; sums stay < 2**63
    minima = _row_minima_dense if dense or np.any(np.diff(lo[1:]) < 0) else _row_minima_dc
    f = np.full((budget + 1, D + 1), inf, dtype=np.int64)
    f[:, 0] = 0
    arg = np.zeros((budget + 1, D + 1), dtype=np.int32)
    groups = [(u, np.flatnonzero(w == u)) for u in np.unique(w[1:])]
    for k in range(1, budget + 1):
        for u, rows in groups:
            if k < u:
                continue
            best, at = minima(rows, _penalized(f[k - u], c, W, S, lo, big), D + 1)
            f[k, rows] = np.where(best >= big, inf, best)
            arg[k, rows] = at
    return f, arg, w, big


def _chain(
    f: np.ndarray, arg: np.ndarray, w: np.ndarray, big: int, budget: int
) -> tuple[int, int, list[int]] | None:
    D = f.shape[1] - 1
    if f[budget, D] >= big:
        return None
    k = int(np.argmax(f[: budget + 1, D] == f[budget, D]))  # fewest units among the optima
    chosen, j = [], D
    while j > 0:
        chosen.append(j)
        j, k = int(arg[k, j]), k - int(w[j])
    chosen.reverse()
    return int(f[budget, D]), int(w[chosen].sum()), chosen


def solve(sizes, weight, lo, W, S, budget: int, dense: bool = False):
    """Optimal chain for the problem in the module docstring.

    ``sizes``/``weight``: [D] candidates (ascending) and their units; ``lo``/``W``/``S``: [D + 1]
    indexed like ``[0] + sizes``. Returns ``(cost, units, chosen)`` with ``chosen`` the 1-based
    candidate indices, ascending, ending at D; or ``None`` when no allowed chain fits ``budget``.
    """
    got = _layers(sizes, weight, lo, W, S, budget, dense)
    return None if got is None else _chain(*got, budget)


def solve_with_curve(sizes, weight, lo, W, S, budget: int, curve_budget: int, dense=False):
    """``solve`` at ``budget``, and the trade-off curve: the least cost within every budget
    0..max(budget, curve_budget) (None where no allowed chain fits). One DP gives both: the
    layers up to ``budget`` do not depend on the ones above it."""
    top = max(budget, curve_budget)
    got = _layers(sizes, weight, lo, W, S, top, dense)
    if got is None:
        return None, [None] * (top + 1)
    f, _, _, big = got
    curve = [int(v) if v < big else None for v in f[:, -1]]
    return (_chain(*got, budget) if budget >= 1 else None), curve


def min_units(weight, lo, budget_cap: int) -> int | None:
    """Fewest units of any allowed chain ending at D (ignores cost), or None above ``budget_cap``."""
    w = np.concatenate(([0], np.asarray(weight, dtype=np.int64)))
    lo = np.asarray(lo, dtype=np.int64)
    D = len(w) - 1
    best = np.zeros(D + 1, dtype=np.int64)
    for j in range(1, D + 1):  # cheapest allowed predecessor: any i in lo[j]..j-1
        best[j] = w[j] + best[lo[j] : j].min() if lo[j] < j else np.iinfo(np.int64).max // 2
    return int(best[D]) if best[D] <= budget_cap else None
