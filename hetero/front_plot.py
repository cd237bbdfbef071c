"""The picture of a plan front (``hetero plan --objectives ... --plot front.png``): parallel
coordinates over every objective (each axis scaled to the front's range, better up), beside the
throughput-cost projection. matplotlib is imported through :mod:`hetero.plots` only."""
from __future__ import annotations

from hetero.plots import load_pyplot

LABELS = {"throughput": "throughput\n(tokens/s)", "cost": "cost\n(USD/Mtok, indicative)",
          "memory_headroom": "memory\nheadroom", "energy": "energy\n(J/token)", "resilience": "resilience\n(kept)"}


def front_figure(front: list, names, title: str = "", picked=None):
    """Figure of ``front`` (items with ``.objectives``); ``picked`` (one of them) is drawn bold."""
    from hetero.predictor.objectives import MAXIMISE

    plt = load_pyplot("--plot")
    names = list(names)
    both = "throughput" in names and "cost" in names
    fig, axes = plt.subplots(1, 2 if both else 1, figsize=(13 if both else 8, 4.8), squeeze=False,
                             gridspec_kw={"width_ratios": [1.6, 1]} if both else None)
    ax = axes[0][0]
    vals = {n: [p.objectives[n] for p in front] for n in names}
    tput = vals.get("throughput") or [0.0] * len(front)
    lo_t, hi_t = min(tput), max(tput)
    cmap = plt.get_cmap("viridis")
    for k, p in enumerate(front):
        ys = []
        for n in names:
            lo, hi = min(vals[n]), max(vals[n])
            y = (p.objectives[n] - lo) / (hi - lo) if hi > lo else 0.5
            ys.append(y if n in MAXIMISE else 1 - y)
        c = cmap((tput[k] - lo_t) / (hi_t - lo_t) if hi_t > lo_t else 0.5)
        bold = p is picked
        ax.plot(range(len(names)), ys, color="#c44e52" if bold else c, lw=3 if bold else 1.2,
                alpha=1 if bold else 0.75, zorder=3 if bold else 2, marker="o", ms=3)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([LABELS.get(n, n) for n in names], fontsize=8)
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["worst", "best"])
    for i in range(len(names)):
        ax.axvline(i, color="#bbbbbb", lw=0.8, zorder=1)
        lo, hi = min(vals[names[i]]), max(vals[names[i]])
        top, bottom = (hi, lo) if names[i] in MAXIMISE else (lo, hi)
        ax.annotate(_fmt(top), (i, 1.02), ha="center", fontsize=7)
        ax.annotate(_fmt(bottom), (i, -0.07), ha="center", fontsize=7)
    ax.set_ylim(-0.1, 1.08)
    ax.set_title(f"{len(front)} plans, each objective scaled to the front's range", fontsize=9)
    if both:
        bx = axes[0][1]
        # the plans no other beats on both throughput and cost: the projection's own front, as a staircase
        order = sorted(range(len(front)), key=lambda k: (vals["cost"][k], -tput[k]))
        stairs, best = [], -1.0
        for k in order:
            if tput[k] > best:
                stairs.append(k)
                best = tput[k]
        bx.step([vals["cost"][k] for k in stairs], [tput[k] for k in stairs], where="post", color="#999999",
                lw=1, zorder=1, label="throughput-cost front")
        bx.scatter(vals["cost"], tput, c=tput, cmap=cmap, s=28, zorder=2)
        if picked is not None:
            bx.scatter([picked.objectives["cost"]], [picked.objectives["throughput"]], s=90, facecolors="none",
                       edgecolors="#c44e52", linewidths=2, zorder=3, label="picked")
        bx.legend(fontsize=8)
        bx.set_xlabel("cost (USD per million tokens, indicative)")
        bx.set_ylabel("throughput (tokens/s)")
        bx.set_title("throughput-cost projection", fontsize=9)
        bx.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


__all__ = ["front_figure"]
