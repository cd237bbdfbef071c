"""MaOEA-CS: a many-objective evolutionary algorithm based on corner solution search (Cai, Sun, Zhu,
Li and Zhang, arXiv 1806.02967), on vectors in [0, 1]^D with every objective minimised.

Two phases, as the paper describes them:

1. **Corner solution search** (exploitative). The corner solutions of m objectives are the best
   solutions on each single objective and the best on the L2 norm of each m - 1 of them (the
   boundary optima of the front; 2m criteria on objectives normalised by the ideal point and the
   non-dominated set's nadir). Environmental selection takes solutions from the 2m criterion
   rankings in turn (round robin), so the population crowds the corners; mating picks parents by
   binary tournament on their best criterion rank, with small variation steps. The phase ends when
   the corners stop improving for ``stall`` generations (or after ``corner_share`` of the budget).
2. **Extension** (explorative). Objectives are normalised by the ideal point and the nadir point
   of the corner solutions found in phase 1; selection is non-dominated sorting, and on the
   critical front an angle-based selection: the corner solutions first, then repeatedly the
   candidate whose smallest vector angle to the selected ones is largest, then a worse-elimination
   pass that swaps a selected solution for a candidate within a tiny angle of it that is closer
   to the ideal point. Mating is uniform random, with wide variation steps.

Variation: simulated binary crossover and polynomial mutation (plus a rare uniform reset of one
gene, since most genes pick one of a few discrete options). The caller keeps every evaluated point
(the front of all evaluations is what :mod:`.front` returns); :func:`maoea_cs` returns the last population.
"""
from __future__ import annotations

import math

import numpy as np


# ---------------------------------------------------------------------------- dominance
def non_dominated_sort(F: np.ndarray) -> list[np.ndarray]:
    """Fronts (index arrays) of ``F`` (rows minimised), best first."""
    n = len(F)
    if n == 0:
        return []
    le = (F[:, None, :] <= F[None, :, :]).all(-1)
    lt = (F[:, None, :] < F[None, :, :]).any(-1)
    dom = le & lt                     # dom[i, j]: i dominates j
    count = dom.sum(0)
    fronts, current = [], np.flatnonzero(count == 0)
    while len(current):
        fronts.append(current)
        count = count - dom[current].sum(0)
        count[current] = -1
        current = np.flatnonzero(count == 0)
    return fronts


def non_dominated(F: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated rows of ``F``."""
    return non_dominated_sort(F)[0] if len(F) else np.array([], dtype=int)


# ---------------------------------------------------------------------------- corners
def _normalise(F: np.ndarray, ideal: np.ndarray, nadir: np.ndarray) -> np.ndarray:
    span = np.where(nadir - ideal > 1e-12, nadir - ideal, 1.0)
    return (F - ideal) / span


def criteria(Fn: np.ndarray) -> np.ndarray:
    """The 2m corner criteria of normalised rows: each objective, then the norm without each one
    (one column when m == 1, the m criteria when m == 2: the norm without one is the other)."""
    m = Fn.shape[1]
    cols = [Fn[:, i] for i in range(m)]
    if m > 2:
        sq = Fn ** 2
        total = sq.sum(1)
        cols += [np.sqrt(np.maximum(total - sq[:, i], 0.0)) for i in range(m)]
    return np.stack(cols, 1)


def corner_ranks(Fn: np.ndarray) -> np.ndarray:
    """Rank of every row under every criterion (0: best; ties broken by the full norm)."""
    C = criteria(Fn)
    norm = np.linalg.norm(Fn, axis=1)
    ranks = np.empty_like(C, dtype=int)
    for j in range(C.shape[1]):
        order = np.lexsort((norm, C[:, j]))
        ranks[order, j] = np.arange(len(order))
    return ranks


def corner_indices(Fn: np.ndarray) -> np.ndarray:
    """The corner solutions: the best row under each criterion (distinct indices)."""
    ranks = corner_ranks(Fn)
    return np.unique(ranks.argmin(0))


def corner_select(Fn: np.ndarray, N: int) -> np.ndarray:
    """Phase 1 selection: the criterion rankings taken in turn, each adding its best unselected row."""
    ranks = corner_ranks(Fn)
    orders = [np.argsort(ranks[:, j], kind="stable") for j in range(ranks.shape[1])]
    chosen, seen, pos = [], set(), [0] * len(orders)
    while len(chosen) < min(N, len(Fn)):
        for j, order in enumerate(orders):
            while pos[j] < len(order) and order[pos[j]] in seen:
                pos[j] += 1
            if pos[j] < len(order) and len(chosen) < N:
                seen.add(order[pos[j]])
                chosen.append(order[pos[j]])
    return np.array(chosen, dtype=int)


# ---------------------------------------------------------------------------- angles
def _cos(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    a = A / np.maximum(np.linalg.norm(A, axis=1, keepdims=True), 1e-12)
    b = B / np.maximum(np.linalg.norm(B, axis=1, keepdims=True), 1e-12)
    return np.clip(a @ b.T, -1.0, 1.0)


def angle_select(Fn: np.ndarray, N: int, corners: np.ndarray | None = None) -> np.ndarray:
    """Phase 2 selection of ``N`` rows of normalised ``Fn``: whole non-dominated fronts while they
    fit, then on the critical front the corners, maximum-vector-angle-first and worse elimination."""
    if len(Fn) <= N:
        return np.arange(len(Fn))
    fronts = non_dominated_sort(Fn)
    chosen: list[int] = []
    for front in fronts:
        if len(chosen) + len(front) > N:
            critical = front
            break
        chosen.extend(front.tolist())
    else:
        return np.array(chosen, dtype=int)
    if len(chosen) == N:
        return np.array(chosen, dtype=int)
    P = np.maximum(Fn, 0.0) + 1e-9      # angles about the ideal point
    cand = [int(i) for i in critical]
    # the critical front's own corners first (the boundary of the front), then the global corners in it
    local = [cand[k] for k in corner_indices(Fn[cand])]
    first = [i for i in (list(corners) if corners is not None else []) if i in cand] + local
    for i in first:
        if i in cand and len(chosen) < N:
            chosen.append(i)
            cand.remove(i)
    if not chosen:   # no selected solution to measure angles from: the one closest to the ideal point
        best = min(cand, key=lambda i: float(np.linalg.norm(P[i])))
        chosen.append(best)
        cand.remove(best)
    if cand and len(chosen) < N:
        ca = np.array(cand)
        theta = np.arccos(_cos(P[ca], P[np.array(chosen)])).min(1)
        alive = np.ones(len(ca), dtype=bool)
        while len(chosen) < N and alive.any():
            k = int(np.where(alive, theta, -1.0).argmax())
            alive[k] = False
            chosen.append(int(ca[k]))
            theta = np.minimum(theta, np.arccos(_cos(P[ca], P[ca[k:k + 1]]))[:, 0])
        # worse elimination: a left-out candidate within a tiny angle of a selected one, but
        # closer to the ideal point (sum of normalised objectives), takes its place
        limit = (math.pi / 2) / (N + 1)
        sel = np.array(chosen)
        fit = P.sum(1)
        for k in np.flatnonzero(alive):
            ang = np.arccos(_cos(P[ca[k:k + 1]], P[sel]))[0]
            j = int(ang.argmin())
            protected = sel[j] in first
            if ang[j] < limit and fit[ca[k]] < fit[sel[j]] and not protected:
                sel[j] = ca[k]
        chosen = sel.tolist()
    return np.array(chosen, dtype=int)


# ---------------------------------------------------------------------------- variation
def _sbx(a: np.ndarray, b: np.ndarray, eta: float, rng) -> tuple[np.ndarray, np.ndarray]:
    u = rng.random(a.shape)
    beta = np.where(u <= 0.5, (2 * u) ** (1 / (eta + 1)), (1 / (2 * (1 - u))) ** (1 / (eta + 1)))
    cross = rng.random(a.shape) < 0.5    # half the genes cross over
    c1 = np.where(cross, 0.5 * ((1 + beta) * a + (1 - beta) * b), a)
    c2 = np.where(cross, 0.5 * ((1 - beta) * a + (1 + beta) * b), b)
    # and, as in Deb's SBX, each gene goes to either child with equal chance: without the exchange a
    # child near one parent on every gene decodes (most genes pick one of a few options) to that
    # parent's plan again
    swap = rng.random(a.shape) < 0.5
    c1, c2 = np.where(swap, c2, c1), np.where(swap, c1, c2)
    return np.clip(c1, 0, 1), np.clip(c2, 0, 1)


def _mutate(x: np.ndarray, eta: float, rng) -> np.ndarray:
    D = len(x)
    x = x.copy()
    for i in np.flatnonzero(rng.random(D) < 1.0 / D):
        u = rng.random()
        delta = (2 * u) ** (1 / (eta + 1)) - 1 if u < 0.5 else 1 - (2 * (1 - u)) ** (1 / (eta + 1))
        x[i] = min(1.0, max(0.0, x[i] + delta))
    if rng.random() < 0.3:               # one gene to a fresh option
        x[rng.integers(D)] = rng.random()
    return x


def _offspring(X: np.ndarray, n: int, parents, eta: float, rng) -> np.ndarray:
    out = []
    while len(out) < n:
        i, j = parents(), parents()
        c1, c2 = _sbx(X[i], X[j], eta, rng) if rng.random() < 0.9 else (X[i].copy(), X[j].copy())
        out += [_mutate(c1, eta, rng), _mutate(c2, eta, rng)]
    return np.array(out[:n])


# ---------------------------------------------------------------------------- the algorithm
def maoea_cs(evaluate, n_var: int, budget: int, pop_size: int = 40, X0=None, seed: int = 0,
             stall: int = 3, corner_share: float = 0.5, log=None) -> tuple[np.ndarray, np.ndarray]:
    """Run MaOEA-CS for ``budget`` evaluations; ``evaluate(X) -> F`` (rows minimised).

    ``X0``: initial vectors (seeds), topped up with uniform random ones to ``pop_size``. Returns the
    last population ``(X, F)``; ``log(phase, evaluations)`` is called once per generation."""
    rng = np.random.default_rng(seed)
    X = np.zeros((0, n_var)) if X0 is None else np.asarray(X0, dtype=float).reshape(-1, n_var)[:pop_size]
    X = np.vstack([X, rng.random((pop_size - len(X), n_var))]) if len(X) < pop_size else X
    X = X[: max(1, min(pop_size, budget))]
    F = np.asarray(evaluate(X), dtype=float)
    used = len(X)
    phase, best_corners, stalled = 1, None, 0
    while used < budget:
        n = min(pop_size, budget - used)
        ideal = F.min(0)
        if phase == 1:
            nd = non_dominated(F)
            Fn = _normalise(F, ideal, F[nd].max(0))
            rank = corner_ranks(Fn).min(1)

            def parents():
                i, j = rng.integers(len(X), size=2)
                return i if rank[i] <= rank[j] else j

            Q = _offspring(X, n, parents, 20.0, rng)
        else:
            Q = _offspring(X, n, lambda: rng.integers(len(X)), 5.0, rng)
        FQ = np.asarray(evaluate(Q), dtype=float)
        used += len(Q)
        RX, RF = np.vstack([X, Q]), np.vstack([F, FQ])
        ideal = RF.min(0)
        nd = non_dominated(RF)
        if phase == 1:
            Fn = _normalise(RF, ideal, RF[nd].max(0))
            keep = corner_select(Fn, pop_size)
            corners = RF[corner_indices(Fn)]
            key = np.sort(corners, axis=0)
            improved = best_corners is None or key.shape != best_corners.shape or not np.allclose(key, best_corners)
            stalled = 0 if improved else stalled + 1
            best_corners = key
            if stalled >= stall or used >= corner_share * budget:
                phase = 2
        else:
            Fn0 = _normalise(RF, ideal, RF[nd].max(0))
            cidx = corner_indices(Fn0[nd])
            nadir = RF[nd][cidx].max(0)       # the corners' nadir normalises the extension
            Fn = _normalise(RF, ideal, np.maximum(nadir, ideal + 1e-12))
            keep = angle_select(Fn, pop_size, nd[cidx])
        X, F = RX[keep], RF[keep]
        if log:
            log(phase, used)
    return X, F


__all__ = ["maoea_cs", "non_dominated", "non_dominated_sort", "angle_select", "corner_select", "corner_indices",
           "criteria"]
