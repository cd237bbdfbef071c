"""Evaluate pipeline shapes (blocks) with the predictor's stage costs: split layers, check memory.

Everything here asks :class:`hetero.predictor.costs.StageCostModel` for numbers (per-layer times,
first/last-stage extras, stage memory, capacity, point-to-point time). The only arithmetic of its
own is the min-max layer split and a 1F1B-shaped ranking key (fill + (m - 1) x slowest stage) used
to prune; every plan the planner returns is scored by ``predict()``.
"""
from __future__ import annotations

from dataclasses import dataclass

from hetero.predictor.memory import stage_params

from .space import Segment
from .split import min_max_split


@dataclass(frozen=True)
class Block:
    """One evaluated pipeline shape: ``replicas`` copies of ``segments`` with a concrete layer split."""

    segments: tuple[Segment, ...]
    replicas: int
    mbs: int
    recompute: str
    zero: int
    """The lowest ZeRO stage under which every stage fits."""
    counts: tuple[int, ...]
    """Layers per stage, in order."""
    bottleneck: float
    """Slowest stage (forward + backward + its outgoing p2p) for one micro-batch, seconds."""
    fill: float
    """One micro-batch through the whole pipeline forward and backward (the 1F1B fill + drain)."""

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(s.group for s in self.segments)

    @property
    def stages(self) -> list[tuple[str, int]]:
        return [(s.group, s.tp) for s in self.segments for _ in range(s.stages)]

    @property
    def num_stages(self) -> int:
        return sum(s.stages for s in self.segments)

    @property
    def units(self) -> int:
        """Samples per micro-batch step over all replicas."""
        return self.replicas * self.mbs

    def time(self, m: int) -> float:
        """Ranking key: iteration time of ``m`` micro-batches under 1F1B (no DP sync)."""
        return (m - 1) * self.bottleneck + self.fill

    def layer_ranges(self) -> list[tuple[int, int]]:
        out, a = [], 0
        for n in self.counts:
            out.append((a, a + n))
            a += n
        return out


def _last_fitting(spare, lo: int, lo_spare: float, hi: int, hi_spare: float) -> int:
    """The largest ``n`` in [lo, hi) with ``spare(n) >= 0``, given ``spare(lo) >= 0 > spare(hi)``
    and ``spare`` non-increasing (what bisection finds). A stage's memory is close to affine in its
    layer count, so the line through the bracket's ends usually names ``n`` at once and its
    neighbour confirms it: two calls of ``spare`` where bisection takes about seven. Where the line
    misses, a bisection step follows, so the worst case stays logarithmic."""
    while hi - lo > 1:
        guess = lo + int(lo_spare / (lo_spare - hi_spare) * (hi - lo))
        guess = min(max(guess, lo + 1), hi - 1)
        g = spare(guess)
        if g >= 0:
            lo, lo_spare, probe = guess, g, guess + 1
        else:
            hi, hi_spare, probe = guess, g, guess - 1
        if lo < probe < hi:
            g = spare(probe)
            if g >= 0:
                lo, lo_spare = probe, g
            else:
                hi, hi_spare = probe, g
        if hi - lo > 1:
            mid = (lo + hi) // 2
            g = spare(mid)
            if g >= 0:
                lo, lo_spare = mid, g
            else:
                hi, hi_spare = mid, g
    return lo


class BlockEvaluator:
    """Memoised evaluation of shapes against one cost model."""

    def __init__(self, cluster, model, cost_model):
        self.cluster, self.model, self.cm = cluster, model, cost_model
        self.L = model.num_layers
        self._profile: dict = {}
        self._cap: dict = {}
        self._split: dict = {}
        self.splits_computed = 0

    # --- numbers from the predictor -------------------------------------------------------------
    def profile(self, group: str, tp: int, mbs: int, rc: str) -> tuple[float, float, float, float]:
        """(per-layer f+b, extra as first stage, extra as last stage, extra as only stage)."""
        key = (group, tp, mbs, rc)
        hit = self._profile.get(key)
        if hit is None:
            f, b = self.cm.layer_times(group, tp, mbs, rc)
            per = f + b
            ex = []
            for first, last in ((True, False), (False, True), (True, True)):
                sf, sb = self.cm.stage_times(group, tp, mbs, (0, 1) if first else (self.L - 1, self.L), rc, first, last)
                ex.append(max(0.0, sf + sb - per))
            hit = self._profile[key] = (per, ex[0], ex[1], ex[2])
        return hit

    def cap(self, group, tp, mbs, rc, zero, dp, in_flight, first, last) -> int:
        """Most layers a stage can hold within the device memory (0 if not even one)."""
        if zero == 0:
            dp = 1
        key = (group, tp, mbs, rc, zero, dp, in_flight, first, last)
        hit = self._cap.get(key)
        if hit is not None:
            return hit
        capacity = self.cm.capacity(group)
        L = self.L

        def spare(n):
            """Bytes left on the device by a stage of ``n`` layers (negative: it does not fit)."""
            layers = (0, n) if first else ((L - n, L) if last else (1, 1 + n))
            # the gradient sum's buffer counted as if every gradient is summed (the plan's other
            # pipelines are not known yet; predict() decides for the plan)
            summed = stage_params(self.model, n, tp, first, last)
            return capacity - self.cm.stage_memory(group, tp, mbs, layers, rc, zero, dp, in_flight, first,
                                                   last, summed)

        # Monotone in in_flight: a deeper in-flight count can hold no more layers than a shallower one.
        hi_bound = L
        prev = self._cap.get((group, tp, mbs, rc, zero, dp, in_flight - 1, first, last))
        if prev is not None:
            hi_bound = prev
        lo_spare = spare(1)
        if lo_spare < 0:
            n = 0
        else:
            hi_spare = spare(hi_bound)
            n = hi_bound if hi_spare >= 0 else _last_fitting(spare, 1, lo_spare, hi_bound, hi_spare)
        self._cap[key] = n
        return n

    # --- shapes -----------------------------------------------------------------------------
    def split(self, segments: tuple[Segment, ...], mbs: int, rc: str, zero: int, dp: int):
        """Best layer split of a shape: (counts, max stage time) or None when it cannot fit."""
        key = (segments, mbs, rc, zero, dp if zero else 1)
        if key in self._split:
            return self._split[key]
        self.splits_computed += 1
        stages = [(s.group, s.tp) for s in segments for _ in range(s.stages)]
        S = len(stages)
        out = None
        if S <= self.L:
            per, extra, cap = [], [], []
            ok = True
            for i, (g, tp) in enumerate(stages):
                p, ef, el, eb = self.profile(g, tp, mbs, rc)
                first, last = i == 0, i == S - 1
                per.append(p)
                extra.append(eb if first and last else ef if first else el if last else 0.0)
                c = self.cap(g, tp, mbs, rc, zero, dp, S - i, first, last)
                if c < 1:
                    ok = False
                    break
                cap.append(c)
            if ok:
                out = min_max_split(per, extra, cap, self.L)
        self._split[key] = out
        return out

    def evaluate(self, segments: tuple[Segment, ...], replicas: int, mbs: int, rc: str,
                 zero_stages=(0, 1, 2)) -> Block | None:
        """The shape with its best split under the lowest ZeRO stage that fits; None if none fits."""
        for zero in zero_stages:
            res = self.split(segments, mbs, rc, zero, replicas)
            if res is None:
                continue
            counts, _ = res
            stages = [(s.group, s.tp) for s in segments for _ in range(s.stages)]
            S = len(stages)
            times = []
            fill = 0.0
            for i, (g, tp) in enumerate(stages):
                p, ef, el, eb = self.profile(g, tp, mbs, rc)
                first, last = i == 0, i == S - 1
                t = p * counts[i] + (eb if first and last else ef if first else el if last else 0.0)
                p2p = (2 * self.cm.p2p_time(g, stages[i + 1][0], mbs, tp_a=tp, tp_b=stages[i + 1][1])
                       if i + 1 < S else 0.0)
                times.append(t + p2p)
                fill += t + p2p
            return Block(segments=segments, replicas=replicas, mbs=mbs, recompute=rc, zero=zero,
                         counts=tuple(counts), bottleneck=max(times), fill=fill)
        return None


__all__ = ["Block", "BlockEvaluator"]
