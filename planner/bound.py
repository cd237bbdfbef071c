"""The planner's upper bound: a throughput no plan of the search can beat, from the predictor's own costs.

Why not the sum of each group's best plan alone: alone, a group holds the whole model (so it may
need recomputation, ZeRO or more tensor parallelism to fit) and runs the embedding and the LM head
itself; in a pipeline across groups each holds only its layers and the head goes where it runs
fastest. A mixed plan can therefore beat that sum (h100-a100 / llama3-8b at batch 256: 1.096x), and
the search keeps it only as a comparison (:attr:`~hetero.planner.search.SearchResults.alone_tokens_per_s`).

The bound relaxes everything but compute. Every plan's step holds, on every device, at least the
forward and backward of each micro-batch through the layers (and embedding / head) it holds, as
:meth:`~hetero.predictor.StageCostModel.stage_times` charges them: bubbles, transfers, the gradient
sync, the optimizer and the step overhead only add to it. So per sample the work is ``num_layers``
layer passes, one embedding and one head, and a group of ``n`` devices does at most ``n`` device
seconds of it per second, each unit at the cheapest device-seconds per sample any setting of the
search gives it (tensor-parallel degree x stage time / micro-batch size, over the search's tp
degrees, micro-batch sizes and recompute settings; ZeRO and interleaving change neither). Shared
among the groups as a fluid (a small linear program), that work takes at least ``s`` seconds per
sample: no plan exceeds ``seq_length / s`` tokens/s. Memory limits are not counted, so where memory
forces recomputation (70B-class models) the bound is loose.
"""
from __future__ import annotations

from dataclasses import dataclass

from .space import mbs_options, tp_options

WORK = ("layer", "embedding", "head")
"""Units of a sample's work: ``num_layers`` layer passes, one embedding, one head (with the loss)."""


@dataclass(frozen=True)
class GroupCosts:
    """Device-seconds per sample of each :data:`WORK` unit on one group, at the cheapest setting."""

    devices: int
    layer: float
    embedding: float
    head: float

    def alone_tokens_per_s(self, num_layers: int, seq_length: int) -> float:
        """The group doing every unit of every sample: its devices' compute-only throughput."""
        return seq_length * self.devices / (num_layers * self.layer + self.embedding + self.head)


def group_costs(cost_model, cluster, model, group: str, mbs_list, recompute) -> GroupCosts:
    """The cheapest device-seconds per sample of a layer, the embedding and the head on ``group``
    over tensor-parallel degrees, micro-batch sizes ``mbs_list`` and recompute settings ``recompute``."""
    layer = emb = head = float("inf")
    for tp in tp_options(cluster, model, group):
        for mbs in mbs_list:
            for rc in recompute:   # what a stage of one layer, and one of no layer but an edge, takes
                f, b = cost_model.stage_times(group, tp, mbs, (0, 1), rc, False, False)
                layer = min(layer, tp * (f + b) / mbs)
                f, b = cost_model.stage_times(group, tp, mbs, (0, 0), rc, True, False)
                emb = min(emb, tp * (f + b) / mbs)
                f, b = cost_model.stage_times(group, tp, mbs, (0, 0), rc, False, True)
                head = min(head, tp * (f + b) / mbs)
    return GroupCosts(cluster.group(group).num_devices, layer, emb, head)


def fluid_seconds_per_sample(costs: dict[str, GroupCosts], num_layers: int) -> float:
    """The least seconds per sample when the groups share the work of each sample as a fluid: the
    linear program min s such that every group's device-seconds fit ``devices * s`` and every unit
    is done once (``num_layers`` layer passes, one embedding, one head)."""
    import numpy as np
    from scipy.optimize import linprog

    names = list(costs)
    k = len(WORK)
    n = len(names) * k + 1   # x[g, unit] (share of the unit's work done on g), then s
    c = np.zeros(n)
    c[-1] = 1.0
    a_ub = np.zeros((len(names), n))
    for i, g in enumerate(names):
        gc = costs[g]
        for j, unit in enumerate(WORK):
            a_ub[i, i * k + j] = getattr(gc, unit) * (num_layers if unit == "layer" else 1) / gc.devices
        a_ub[i, -1] = -1.0
    a_eq = np.zeros((k, n))
    for j in range(k):
        a_eq[j, [i * k + j for i in range(len(names))]] = 1.0
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(len(names)), A_eq=a_eq, b_eq=np.ones(k),
                  bounds=[(0, None)] * n, method="highs")
    if not res.success:   # cannot happen for positive costs; never report a bound that was not solved
        raise RuntimeError(f"upper bound: linear program failed: {res.message}")
    return float(res.x[-1])


def upper_bound(cost_model, cluster, model, global_batch_size: int, micro_batch_sizes, recompute
                ) -> tuple[float, dict[str, float]]:
    """``(bound tokens/s, {group: its devices' compute-only tokens/s alone})`` over the search's
    option space (module docstring). The bound is at least the sum of the per-group figures: the
    fluid may also give the embedding and head to the group that runs them cheapest."""
    mbs_list = mbs_options(global_batch_size, micro_batch_sizes)
    costs = {g.name: group_costs(cost_model, cluster, model, g.name, mbs_list, recompute) for g in cluster.groups}
    L, seq = model.num_layers, model.seq_length
    s = fluid_seconds_per_sample(costs, L)
    by_group = {g: c.alone_tokens_per_s(L, seq) for g, c in costs.items()}
    # the fluid optimum is at least every group working alone in parallel; keep the float noise of
    # the solver from putting it a hair below that feasible point
    return max(seq / s, sum(by_group.values())), by_group


__all__ = ["upper_bound", "group_costs", "fluid_seconds_per_sample", "GroupCosts", "WORK"]
