"""The rank layout of a plan: which device of which node runs which pipeline, replica, stage, tp rank.

Ranks are numbered group by group (cluster order), node by node, device by device, so the ranks
of one node are contiguous (what a per-node torchrun expects). Inside a group, tp blocks are packed
into nodes first-fit decreasing (the same rule :func:`hetero.specs.plan.check_plan` enforces), so
a tensor-parallel group never spans two nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .specs.cluster import Cluster
from .specs.plan import Plan, pack_blocks


@dataclass(frozen=True)
class RankInfo:
    """Everything one process needs to know about its place in the plan."""

    rank: int
    group: str
    vendor: str
    node: int
    """Node index inside the group."""
    local_rank: int
    """Device index inside the node."""
    pipeline: int
    replica: int
    stage: int
    """Physical stage index inside the pipeline (interleaved: the device's first chunk)."""
    tp_rank: int
    tp_size: int
    layers: tuple[int, int]
    """Layers of the (first) stage this rank runs."""
    chunks: tuple[int, ...] = ()
    """Interleaved schedule: every virtual stage index this rank runs (else just ``(stage,)``)."""

    @property
    def virtual_stages(self) -> tuple[int, ...]:
        """The stages of the plan's list this rank runs, in pipeline order (its model chunks when
        interleaved; a layout without ``chunks`` means its one stage)."""
        return self.chunks or (self.stage,)

    def holds_ends(self, plan) -> tuple[bool, bool]:
        """(runs the pipeline's first stage: the embedding, runs its last: final norm, head, loss)."""
        vs = self.virtual_stages
        return vs[0] == 0, vs[-1] == len(plan.pipelines[self.pipeline].stages) - 1

    def chunk_layers(self, plan) -> tuple[tuple[int, int], ...]:
        """Layer ranges of the stages this rank runs in ``plan`` (see :attr:`virtual_stages`)."""
        stages = plan.pipelines[self.pipeline].stages
        return tuple(tuple(stages[k].layers) for k in self.virtual_stages)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "group": self.group, "vendor": self.vendor, "node": self.node,
                "local_rank": self.local_rank, "pipeline": self.pipeline, "replica": self.replica,
                "stage": self.stage, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "layers": list(self.layers), "chunks": list(self.chunks)}


@dataclass(frozen=True)
class NodeSlot:
    """One node that runs at least one rank: what its launcher needs."""

    group: str
    node: int
    host: str | None
    first_rank: int
    num_ranks: int


@dataclass(frozen=True)
class RankLayout:
    ranks: tuple[RankInfo, ...]
    nodes: tuple[NodeSlot, ...]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def stage_ranks(self, pipeline: int, replica: int, stage: int) -> list[int]:
        """The tp group of one stage (ordered by tp rank)."""
        return [r.rank for r in sorted(self.ranks, key=lambda r: r.tp_rank)
                if (r.pipeline, r.replica, r.stage) == (pipeline, replica, stage)]

    def pipeline_ranks(self, pipeline: int, replica: int, tp_rank: int = 0) -> list[int]:
        """The ranks along one replica's pipeline at one tp rank, in stage order."""
        return [r.rank for r in sorted(self.ranks, key=lambda r: r.stage)
                if (r.pipeline, r.replica, r.tp_rank) == (pipeline, replica, tp_rank)]

    def vendors(self) -> list[str]:
        return [r.vendor for r in self.ranks]


def build_layout(cluster: Cluster, plan: Plan) -> RankLayout:
    """Assign every (pipeline, replica, stage, tp rank) of ``plan`` to a device of ``cluster``.

    The plan must already satisfy :func:`hetero.specs.plan.check_plan`.
    """
    # Collect tp blocks per group, in plan order.
    blocks: dict[str, list[tuple[int, int, int, int]]] = {}  # group -> [(pipeline, replica, stage, tp)]
    for pi, p in enumerate(plan.pipelines):
        for r in range(p.replicas):
            for si, s in enumerate(plan.physical_stages(p)):
                blocks.setdefault(s.group, []).append((pi, r, si, s.tp))
    ranks: list[RankInfo] = []
    nodes: list[NodeSlot] = []
    for g in cluster.groups:
        group_blocks = blocks.get(g.name, [])
        if not group_blocks:
            continue
        where = pack_blocks([b[3] for b in group_blocks], g.nodes, g.devices_per_node)
        if where is None:
            raise ValueError(f"plan does not fit group {g.name}; run check_plan first")
        vendor = cluster.vendor(g.name)
        for node in range(g.nodes):
            on_node = [b for b, n in zip(group_blocks, where) if n == node]
            if not on_node:
                continue
            first = len(ranks)
            local = 0
            for pi, r, si, tp in on_node:
                p = plan.pipelines[pi]
                per = len(plan.physical_stages(p))
                chunks = tuple(range(si, len(p.stages), per))
                for t in range(tp):
                    ranks.append(RankInfo(rank=len(ranks), group=g.name, vendor=vendor, node=node,
                                          local_rank=local, pipeline=pi, replica=r, stage=si, tp_rank=t,
                                          tp_size=tp, layers=tuple(p.stages[si].layers), chunks=chunks))
                    local += 1
            host = g.hosts[node] if g.hosts else None
            nodes.append(NodeSlot(group=g.name, node=node, host=host, first_rank=first, num_ranks=local))
    return RankLayout(ranks=tuple(ranks), nodes=tuple(nodes))
