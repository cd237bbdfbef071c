"""Candidate plans from shapes, the planner's second step: shapes combined into sets of pipelines,
and the global batch shared between them.

For every partition of the groups into pipelines (and every subset, so a slow group may also be
left idle), the best few shapes of each part are combined and the global batch is shared so that
all pipelines finish together (sum replicas x micro_batches x mbs == global batch).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from hetero.specs.plan import Pipeline, Plan, Stage

from .blocks import Block
from .options import Options
from .space import set_partitions
from .split import uniform_split


def allocate(blocks: list[Block], B: int) -> tuple[list[int], float] | None:
    """Micro-batches per replica for each block: sum(units x m) == B exactly, min max time.

    Exact. For a time bound ``tau`` each block may run 1 .. ``most(tau)`` micro-batches (those it
    finishes by ``tau``); whether some such choice takes exactly ``B`` samples is a bounded subset sum,
    kept as a bitset (bit s set: s samples reachable). Bisection on ``tau`` stops when one block's
    finishing time separates an infeasible bound from a feasible one: that time is the optimum.
    """
    k = len(blocks)
    if k == 1:
        b = blocks[0]
        if B % b.units:
            return None
        m = B // b.units
        return [m], b.time(m)
    caps = [B // b.units for b in blocks]
    if min(caps) < 1:
        return None
    mask = (1 << (B + 1)) - 1

    def most(tau: float) -> list[int]:
        out = []
        for b, c in zip(blocks, caps):
            if tau < b.fill:
                out.append(0)
            elif b.bottleneck <= 0:
                out.append(c)
            else:
                out.append(min(c, int((tau - b.fill) / b.bottleneck * (1 + 1e-12)) + 1))
        return out

    def reach(M: list[int]) -> list[int] | None:
        """Reachable sample counts after each prefix of the blocks; None if B is not reachable."""
        R, out = 1, [1]
        for b, n in zip(blocks, M):
            if n < 1:
                return None
            R = (R << b.units) & mask
            rest, step = n - 1, 1
            while rest > 0:  # 0 .. n-1 more micro-batches as sums of 1, 2, 4, ..., the rest
                t = min(step, rest)
                R |= (R << (b.units * t)) & mask
                rest -= t
                step *= 2
            out.append(R)
        return out if (R >> B) & 1 else None

    lo, hi = min(b.fill for b in blocks) - 1.0, max(b.time(c) for b, c in zip(blocks, caps))
    if reach(most(hi)) is None:
        return None
    for _ in range(200):
        if sum(most(hi)) - sum(most(lo)) <= 1:
            break
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            break
        if reach(most(mid)) is None:
            lo = mid
        else:
            hi = mid
    M = most(hi)
    prefix = reach(M)
    m, target = [0] * k, B
    for i in reversed(range(k)):
        u = blocks[i].units
        for x in range(min(M[i], target // u), 0, -1):
            if (prefix[i] >> (target - u * x)) & 1:
                m[i], target = x, target - u * x
                break
    assert target == 0 and min(m) >= 1
    return m, max(b.time(x) for b, x in zip(blocks, m))


@dataclass(frozen=True)
class Candidate:
    """A plan before prediction: one shape per pipeline, its micro-batches, and a ranking key."""

    blocks: tuple[Block, ...]
    micro_batches: tuple[int, ...]
    time: float
    """Ranking key (seconds); the prediction decides."""
    uniform: bool = False

    @property
    def structure(self) -> tuple:
        return tuple(b.groups for b in self.blocks)

    def to_plan(self, B: int, L: int) -> Plan:
        rc = self.blocks[0].recompute
        zero = max(b.zero for b in self.blocks)
        default_mbs = self.blocks[0].mbs
        pipes = []
        for b, m in zip(self.blocks, self.micro_batches):
            counts = uniform_split(b.num_stages, L) if self.uniform else b.counts
            stages, a = [], 0
            for (g, tp), n in zip(b.stages, counts):
                stages.append(Stage(group=g, layers=(a, a + n), tp=tp))
                a += n
            pipes.append(Pipeline(micro_batches=m, stages=stages, replicas=b.replicas,
                                  micro_batch_size=None if b.mbs == default_mbs else b.mbs))
        return Plan(global_batch_size=B, micro_batch_size=default_mbs, pipelines=pipes, schedule="1f1b",
                    recompute=rc, zero_stage=zero)


def combine(by_key: dict, groups: list[str], B: int, opts: Options) -> list[Candidate]:
    """Plans from shapes: every partition of the groups into pipelines, every non-empty subset."""
    out: list[Candidate] = []
    seen = set()
    for part in set_partitions(groups):
        parts = [tuple(sorted(p)) for p in part]
        for r in range(1, len(parts) + 1):
            for subset in itertools.combinations(parts, r):
                lists = [by_key.get(p) for p in subset]
                if any(not x for x in lists):
                    continue
                budget = opts.combos_budget or (300 if len(groups) <= 2 else 64)
                c = max(opts.combos_per_block, int(budget ** (1 / len(subset))))
                for blocks in itertools.product(*[x[:c] for x in lists]):
                    sig = tuple(blocks)
                    if sig in seen:
                        continue
                    seen.add(sig)
                    alloc = allocate(list(blocks), B)
                    if alloc is None:
                        continue
                    out.append(Candidate(blocks=tuple(blocks), micro_batches=tuple(alloc[0]), time=alloc[1]))
    return out


def candidates_from_shapes(enumerated: dict, cluster, B: int, mbs_list: list[int], opts: Options
                           ) -> tuple[list[Candidate], int]:
    """Every candidate over the shapes of :func:`~hetero.planner.shapes.enumerate_all`, best ranking key first.

    Returns ``(candidates, shapes considered)``.
    """
    shapes = 0
    # Combine per recompute setting (recompute is plan-wide; mbs may differ between pipelines).
    groups = [g.name for g in cluster.groups]
    candidates: list[Candidate] = []
    for rc in opts.recompute:
        by_key: dict[tuple, list[Block]] = {}
        for mbs in mbs_list:
            for k, blocks in enumerated.get((rc, mbs), {}).items():
                by_key.setdefault(k, []).extend(blocks)
                shapes += len(blocks)
        for k in by_key:
            by_key[k] = _rank_blocks(by_key[k], B, cluster)
        candidates.extend(combine(by_key, groups, B, opts))
    candidates.sort(key=lambda c: c.time)
    return candidates, shapes


def _rank_blocks(blocks: list[Block], B: int, cluster) -> list[Block]:
    def rate(b):
        m = max(1, B // max(1, b.units) // 2)
        return b.units * m / b.time(m)

    blocks = sorted(set(blocks), key=lambda b: -rate(b))
    return blocks
