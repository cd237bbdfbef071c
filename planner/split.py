"""Uneven layer splits: minimise the slowest stage, given each stage's per-layer cost and extras.

Stage ``i`` running ``n`` layers costs ``extra[i] + n * per_layer[i]`` (per-layer times and the
first/last-stage extras, embedding and LM head, come from the predictor's ``StageCostModel``) and
may hold at most ``cap[i]`` layers (memory). :func:`min_max_split` returns the split that minimises
the maximum stage cost exactly. It is the classic linear-partition dynamic programme specialised to
monotone costs: for a bound ``T``, giving every stage, in order, as many layers as fit under ``T``
is optimal (an exchange argument), so a search over ``T`` replaces the O(S L^2) table.
:func:`min_max_split_dp` is the table version for any cost function (used to cross-check).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence


def _greedy(T: float, per_layer, extra, cap, L: int) -> list[int] | None:
    S = len(per_layer)
    left = L
    out = []
    for i in range(S):
        reserve = S - i - 1
        room = T - extra[i]
        if room < per_layer[i] - 1e-15:
            return None
        n = int(room / per_layer[i] * (1 + 1e-12)) if per_layer[i] > 0 else left
        n = min(n, cap[i], left - reserve)
        if n < 1:
            return None
        out.append(n)
        left -= n
    return out if left == 0 else None


def min_max_split(per_layer: Sequence[float], extra: Sequence[float], cap: Sequence[int],
                  L: int) -> tuple[list[int], float] | None:
    """Layer counts per stage minimising max(extra[i] + n_i * per_layer[i]); None if no split fits."""
    S = len(per_layer)
    if S > L or sum(min(c, L) for c in cap) < L or min(cap) < 1:
        return None
    # The optimum is one of the values extra[i] + n * per_layer[i]; binary search over them.
    values = sorted({extra[i] + n * per_layer[i] for i in range(S) for n in range(1, min(cap[i], L - S + 1) + 1)})
    lo, hi = 0, len(values) - 1
    if _greedy(values[hi], per_layer, extra, cap, L) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(values[mid], per_layer, extra, cap, L) is not None:
            hi = mid
        else:
            lo = mid + 1
    counts = _greedy(values[lo], per_layer, extra, cap, L)
    assert counts is not None
    return counts, max(extra[i] + counts[i] * per_layer[i] for i in range(S))


def min_max_split_dp(cost: Callable[[int, int, int], float], S: int, L: int) -> tuple[list[int], float] | None:
    """Exact DP for any ``cost(stage, start, end)`` (``math.inf`` = does not fit): O(S L^2)."""
    INF = math.inf
    best = [[INF] * (L + 1) for _ in range(S + 1)]
    arg = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for i in range(1, S + 1):
        for end in range(i, L - (S - i) + 1):
            for start in range(i - 1, end):
                prev = best[i - 1][start]
                if prev == INF:
                    continue
                v = max(prev, cost(i - 1, start, end))
                if v < best[i][end]:
                    best[i][end], arg[i][end] = v, start
    if best[S][L] == INF:
        return None
    counts, end = [], L
    for i in range(S, 0, -1):
        start = arg[i][end]
        counts.append(end - start)
        end = start
    return counts[::-1], best[S][L]


def uniform_split(S: int, L: int) -> list[int]:
    """Even split (the first ``L % S`` stages get one more layer)."""
    q, r = divmod(L, S)
    return [q + (1 if i < r else 0) for i in range(S)]


__all__ = ["min_max_split", "min_max_split_dp", "uniform_split"]
