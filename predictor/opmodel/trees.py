"""Gradient-boosted regression trees in a safe JSON form, with fast evaluation.

A fitted scikit-learn ``HistGradientBoostingRegressor`` is exported to plain node arrays
(feature, threshold, left, right, value; leaves have feature -1). Evaluation does not need
scikit-learn: ``predict_matrix`` walks all rows through each tree with numpy; ``compile_scalar``
generates a Python function of nested comparisons (from numbers only, validated on load) so a
single prediction costs a few microseconds.
"""
from __future__ import annotations

import numpy as np


def export_hgb(model, precision: int = 7) -> dict:
    """Node arrays of a fitted ``HistGradientBoostingRegressor`` (no categorical features)."""
    trees = []
    for (pred,) in model._predictors:
        nodes = pred.nodes
        if np.any(nodes["is_categorical"]):
            raise ValueError("categorical splits are not supported")
        leaf = nodes["is_leaf"].astype(bool)
        trees.append({
            "feature": np.where(leaf, -1, nodes["feature_idx"]).astype(int).tolist(),
            "threshold": [0.0 if lf else float(f"{t:.{precision}g}") for t, lf in zip(nodes["num_threshold"], leaf)],
            "left": np.where(leaf, -1, nodes["left"]).astype(int).tolist(),
            "right": np.where(leaf, -1, nodes["right"]).astype(int).tolist(),
            "value": [float(f"{v:.{precision}g}") if lf else 0.0 for v, lf in zip(nodes["value"], leaf)],
        })
    base = float(np.ravel(model._baseline_prediction)[0])
    return {"kind": "gbt", "base": base, "n_features": int(model.n_features_in_), "trees": trees}


def validate(ens: dict) -> dict:
    """Coerce and check an ensemble read from JSON (types, index ranges); raises ValueError."""
    if ens.get("kind") != "gbt":
        raise ValueError("not a tree ensemble")
    nf = int(ens["n_features"])
    out = {"kind": "gbt", "base": float(ens["base"]), "n_features": nf, "trees": []}
    if not np.isfinite(out["base"]):
        raise ValueError("non-finite base")
    for t in ens["trees"]:
        feat = [int(v) for v in t["feature"]]
        n = len(feat)
        tree = {"feature": feat, "threshold": [float(v) for v in t["threshold"]],
                "left": [int(v) for v in t["left"]], "right": [int(v) for v in t["right"]],
                "value": [float(v) for v in t["value"]]}
        if not all(len(tree[k]) == n for k in tree) or n == 0:
            raise ValueError("ragged or empty tree arrays")
        if not all(np.isfinite(tree["threshold"])) or not all(np.isfinite(tree["value"])):
            raise ValueError("non-finite threshold or value")
        for i in range(n):
            if feat[i] >= nf or feat[i] < -1:
                raise ValueError("feature index out of range")
            if feat[i] >= 0 and not (i < tree["left"][i] < n and i < tree["right"][i] < n):
                raise ValueError("child index out of range")
        out["trees"].append(tree)
    return out


class PackedTrees:
    """All trees padded into 2-D arrays for vectorised evaluation."""

    def __init__(self, ens: dict):
        trees = ens["trees"]
        width = max(len(t["feature"]) for t in trees)
        nt = len(trees)
        self.base = ens["base"]
        self.feature = np.full((nt, width), -1, dtype=np.int64)
        self.threshold = np.zeros((nt, width))
        self.left = np.zeros((nt, width), dtype=np.int64)
        self.right = np.zeros((nt, width), dtype=np.int64)
        self.value = np.zeros((nt, width))
        for i, t in enumerate(trees):
            n = len(t["feature"])
            self.feature[i, :n] = t["feature"]
            self.threshold[i, :n] = t["threshold"]
            self.left[i, :n] = t["left"]
            self.right[i, :n] = t["right"]
            self.value[i, :n] = t["value"]
        self.depths = [_depth(t) for t in trees]
        self.depth = max(self.depths)
        idx = np.arange(width)[None, :]
        leaf = self.feature < 0
        self._left_self = np.where(leaf, idx, self.left)
        self._right_self = np.where(leaf, idx, self.right)
        self.feature = np.maximum(self.feature, 0)

    def predict(self, X: np.ndarray, chunk: int = 4096) -> np.ndarray:
        X = np.asarray(X, dtype=float)
        out = np.empty(X.shape[0])
        for s in range(0, X.shape[0], chunk):
            out[s:s + chunk] = self._predict(X[s:s + chunk])
        return out

    def _predict(self, X: np.ndarray) -> np.ndarray:
        n = X.shape[0]
        out = np.full(n, self.base)
        rows = np.arange(n)
        for t in range(self.feature.shape[0]):
            feat, thr = self.feature[t], self.threshold[t]
            left, right = self._left_self[t], self._right_self[t]
            node = np.zeros(n, dtype=np.int64)
            for _ in range(self.depths[t]):
                node = np.where(X[rows, feat[node]] <= thr[node], left[node], right[node])
            out += self.value[t][node]
        return out


def _depth(t: dict) -> int:
    best, stack = 0, [(0, 0)]
    while stack:
        i, d = stack.pop()
        best = max(best, d)
        if t["feature"][i] >= 0:
            stack.append((t["left"][i], d + 1))
            stack.append((t["right"][i], d + 1))
    return best


def _expr(t: dict, i: int) -> str:
    f = t["feature"][i]
    if f < 0:
        return repr(float(t["value"][i]))
    return (f"({_expr(t, t['left'][i])} if x[{int(f)}] <= {float(t['threshold'][i])!r} "
            f"else {_expr(t, t['right'][i])})")


def compile_scalar(ens: dict):
    """A function ``f(x: sequence of floats) -> float`` evaluating the (validated) ensemble.

    The source is generated from validated ints and floats only, never from strings in the file.
    """
    lines = ["def _f(x):", f"    s = {float(ens['base'])!r}"]
    for t in ens["trees"]:
        lines.append(f"    s += {_expr(t, 0)}")
    lines.append("    return s")
    namespace: dict = {}
    exec(compile("\n".join(lines), "<opmodel-trees>", "exec"), {"__builtins__": {}}, namespace)
    return namespace["_f"]
