"""Plans as vectors for evolutionary search: a fixed-length vector in [0, 1]^D decodes to a plan,
repaired until it is valid (hetero's plan rules) and fits in memory.

Genes (G = the cluster's groups; a gene picks option ``min(int(x * n), n - 1)`` of ``n``):

- per group: how many of its devices the plan uses (0: the group stays idle; else a divisor of
  its node size or a whole number of nodes), its tp degree, and which pipeline it joins (groups
  given the same label share one pipeline whose stages span them);
- per pipeline label: its replica count (one of :func:`~.space.replica_options`), its layer split
  (the min-max split of :class:`~.blocks.BlockEvaluator`, blended towards the even split by the
  upper half of the gene) and its group order (one of :func:`~.space.group_orders`);
- plan-wide: micro-batch size, recompute, the lowest ZeRO stage to try, and model chunks per device
  (1: 1F1B; else an interleaved twin, :mod:`~.interleave`).

Shapes are evaluated by the planner's own :class:`~.blocks.BlockEvaluator` (memory caps, min-max
split, lowest fitting ZeRO stage) and the global batch shared by :func:`~.candidates.allocate`.
Repair, in order: another replica count of the same pipeline (nearest first), stronger
recomputation, pipelines dropped until the batch can be shared, the min-max split without
interleaving when the prediction does not fit, and last the fallback plan (the planner's best).
"""
from __future__ import annotations

import dataclasses

from hetero.specs.errors import SpecError
from hetero.specs.plan import check_plan

from .blocks import BlockEvaluator
from .candidates import Candidate, allocate
from .interleave import interleaved_twin
from .options import Options
from .space import RECOMPUTE, Segment, divisors, group_orders, mbs_options, replica_options, tp_options
from .split import uniform_split

_PER_GROUP = 3      # devices used, tp, pipeline label
_PER_LABEL = 3      # replicas, split blend, group order
_PLAN = 4           # mbs, recompute, lowest ZeRO stage, chunks per device


def _pick(x: float, n: int) -> int:
    return min(int(max(x, 0.0) * n), n - 1)


def _gene(i: int, n: int) -> float:
    """The gene value that picks option ``i`` of ``n`` (the middle of its interval)."""
    return (i + 0.5) / n


class PlanEncoding:
    """Decode vectors to plans (and plans to vectors, approximately) for one cluster, model and batch."""

    def __init__(self, cluster, model, global_batch_size: int, cost_model, opts: Options | None = None):
        self.cluster, self.model, self.B = cluster, model, int(global_batch_size)
        self.L = model.num_layers
        self.opts = opts or Options()
        self.ev = BlockEvaluator(cluster, model, cost_model)
        self.groups = [g.name for g in cluster.groups]
        self.G = len(self.groups)
        self.levels = {}
        for g in cluster.groups:
            lv = set(divisors(g.devices_per_node)) | {g.devices_per_node * k for k in range(1, g.nodes + 1)}
            self.levels[g.name] = [0] + sorted(lv)
        self.tps = {g: tp_options(cluster, model, g) or [1] for g in self.groups}
        self.mbs = mbs_options(self.B, self.opts.micro_batch_sizes)
        self.recompute = [r for r in RECOMPUTE if r in self.opts.recompute] or ["none"]
        self.zeros = sorted(self.opts.zero_stages) or [0]
        self.chunks = [1] + [v for v in self.opts.interleaves if v > 1]
        self.n_var = _PER_GROUP * self.G + _PER_LABEL * self.G + _PLAN
        self.repairs = 0

    # ------------------------------------------------------------------ decoding
    def decode(self, x) -> tuple:
        """``(plan, split_blend_used)`` for vector ``x``, or ``(None, ...)`` when no repair finds a
        shape that fits (the caller falls back to its own plan)."""
        G = self.G
        used, tp_of, label = {}, {}, {}
        for i, g in enumerate(self.groups):
            lv = self.levels[g]
            n = lv[_pick(x[3 * i], len(lv))]
            tp = self.tps[g][_pick(x[3 * i + 1], len(self.tps[g]))]
            if n == 0:
                continue
            n = max(tp, n - n % tp)
            used[g], tp_of[g], label[g] = n, tp, _pick(x[3 * i + 2], G)
        if not used:   # nothing chosen: the largest group
            g = max(self.groups, key=lambda n: self.cluster.group(n).num_devices)
            used[g], tp_of[g], label[g] = self.levels[g][-1], self.tps[g][0], 0
        base = _PER_GROUP * G
        plan_genes = x[base + _PER_LABEL * G:]
        mbs = self.mbs[_pick(plan_genes[0], len(self.mbs))]
        rc_i = _pick(plan_genes[1], len(self.recompute))
        z_i = _pick(plan_genes[2], len(self.zeros))
        chunks = self.chunks[_pick(plan_genes[3], len(self.chunks))]
        pipes = []
        for j in range(G):
            members = tuple(g for g in self.groups if label.get(g) == j)
            if members:
                lx = x[base + _PER_LABEL * j: base + _PER_LABEL * (j + 1)]
                orders = group_orders(self.cluster, members)
                pipes.append((orders[_pick(lx[2], len(orders))], lx[0], lx[1]))
        for rc in self.recompute[rc_i:]:
            blocks = self._blocks(pipes, tp_of, used, mbs, rc, self.zeros[z_i:])
            if blocks is None:
                continue
            alloc = self._share(blocks)
            if alloc is None:
                continue
            blocks, m = alloc
            if rc != self.recompute[rc_i]:
                self.repairs += 1
            return self._plan(blocks, m, chunks), (blocks, m)
        self.repairs += 1
        return None, None

    def _blocks(self, pipes, tp_of, used, mbs, rc, zeros):
        units = self.B // mbs
        out = []
        for order, r_gene, split_gene in pipes:
            tps = {g: tp_of[g] for g in order}
            sizes = {g: used[g] for g in order}
            options = replica_options(tps, sizes, units, self.L)
            if not options:
                self.repairs += 1
                continue
            want = _pick(r_gene, len(options))
            for k in sorted(range(len(options)), key=lambda k: (abs(k - want), k)):
                r = options[k]
                segs = tuple(Segment(g, tps[g], sizes[g] // (r * tps[g])) for g in order)
                blk = self.ev.evaluate(segs, r, mbs, rc, zeros)
                if blk is not None and blk.units <= self.B:
                    if k != want:
                        self.repairs += 1
                    out.append((self._blend(blk, split_gene), blk))
                    break
            else:
                self.repairs += 1
        return out or None

    def _blend(self, blk, gene: float):
        """The block with its layer split blended from min-max towards even (gene above 0.5)."""
        lam = max(0.0, (gene - 0.5) * 2.0)
        if lam <= 0.0:
            return blk
        even = uniform_split(blk.num_stages, self.L)
        raw = [(1 - lam) * a + lam * b for a, b in zip(blk.counts, even)]
        counts = [max(1, int(v)) for v in raw]
        order = sorted(range(len(raw)), key=lambda i: -(raw[i] - int(raw[i])))
        k = 0
        while sum(counts) < self.L:
            counts[order[k % len(order)]] += 1
            k += 1
        while sum(counts) > self.L:
            i = max(range(len(counts)), key=lambda i: counts[i])
            counts[i] -= 1
        return dataclasses.replace(blk, counts=tuple(counts))

    def _share(self, pairs):
        """Blocks whose micro-batches share the global batch exactly, dropping the smallest
        pipelines until they can; None when no subset can."""
        pairs = sorted(pairs, key=lambda p: -p[1].replicas * sum(s.tp * s.stages for s in p[1].segments))
        while pairs:
            alloc = allocate([p[1] for p in pairs], self.B)
            if alloc is not None:
                return [p[0] for p in pairs], alloc[0]
            pairs = pairs[:-1]
            self.repairs += 1
        return None

    def _plan(self, blocks, m, chunks: int):
        plan = Candidate(blocks=tuple(blocks), micro_batches=tuple(m), time=0.0).to_plan(self.B, self.L)
        if chunks > 1:
            twin = interleaved_twin(plan, chunks)
            try:   # some pipelines cannot interleave (two stages of one tag-less vendor): stay 1F1B
                if twin is not None:
                    check_plan(twin, self.cluster, self.model, "<encoding>")
                    return twin
            except SpecError:
                self.repairs += 1
        return plan

    def plain(self, decoded):
        """The repair of a decoded plan that did not fit: min-max split, 1F1B."""
        blocks, m = decoded
        plain = [self.ev.evaluate(b.segments, b.replicas, b.mbs, b.recompute, (b.zero,)) or b for b in blocks]
        return self._plan(plain, m, 1)

    # ------------------------------------------------------------------ encoding
    def encode(self, plan) -> list[float]:
        """A vector that decodes to ``plan``'s structure (devices per group, tp, pipelines, replicas,
        micro-batch size, recompute, ZeRO, chunks): the layer split decodes to the min-max one and the
        micro-batches to the balanced share, so the decoded plan is close to, not always equal to, ``plan``."""
        G = self.G
        x = [0.0] * self.n_var
        used = plan.devices_by_group()
        label_of, info = {}, {}
        for pi, p in enumerate(plan.pipelines):
            phys = plan.physical_stages(p)
            order = []
            for s in phys:
                if s.group not in order:
                    order.append(s.group)
            for g in order:
                label_of[g] = pi
            info[pi] = (tuple(order), p.replicas, {s.group: s.tp for s in phys})
        for i, g in enumerate(self.groups):
            lv = self.levels[g]
            if g not in used:
                x[3 * i] = _gene(0, len(lv))
                continue
            n = used[g]
            k = min(range(1, len(lv)), key=lambda k: (lv[k] < n, abs(lv[k] - n)))
            x[3 * i] = _gene(k, len(lv))
            tp = info[label_of[g]][2][g]
            x[3 * i + 1] = _gene(self.tps[g].index(tp) if tp in self.tps[g] else 0, len(self.tps[g]))
            x[3 * i + 2] = _gene(label_of[g], G)
        base = _PER_GROUP * G
        mbs = plan.micro_batch_size
        for pi, (order, r, tps) in info.items():
            if pi >= G:
                break
            sizes = {g: used[g] for g in order}
            options = replica_options(tps, sizes, self.B // mbs, self.L) or [r]
            k = min(range(len(options)), key=lambda k: abs(options[k] - r))
            orders = group_orders(self.cluster, tuple(g for g in self.groups if g in order))   # as decode lists them
            o = orders.index(order) if order in orders else 0
            x[base + _PER_LABEL * pi: base + _PER_LABEL * (pi + 1)] = [_gene(k, len(options)), 0.25,
                                                                       _gene(o, len(orders))]
        for pi in range(len(info), G):
            x[base + _PER_LABEL * pi: base + _PER_LABEL * (pi + 1)] = [0.5, 0.25, 0.5]
        p0 = base + _PER_LABEL * G
        x[p0] = _gene(self.mbs.index(mbs) if mbs in self.mbs else 0, len(self.mbs))
        x[p0 + 1] = _gene(self.recompute.index(plan.recompute) if plan.recompute in self.recompute else 0,
                          len(self.recompute))
        x[p0 + 2] = _gene(self.zeros.index(plan.zero_stage) if plan.zero_stage in self.zeros else 0, len(self.zeros))
        v = plan.interleave if plan.schedule == "interleaved" else 1
        x[p0 + 3] = _gene(self.chunks.index(v) if v in self.chunks else 0, len(self.chunks))
        return x


__all__ = ["PlanEncoding"]
