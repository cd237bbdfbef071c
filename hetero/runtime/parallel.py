"""Every process group of a run, worked out in one place.

A :class:`ParallelLayout` is built once per rank from the run's model, plan and rank layout (in
:class:`~hetero.runtime.context.RunContext`), before any engine exists. It owns the rank sets the run
communicates over: the tensor-parallel sets of every stage (each a DTensor mesh), and, for the native
engine, which ranks hold each parameter (the holder sets whose gradients are summed together, see
:mod:`hetero.runtime.grads`) with the tp-rank peer and chunk sets inside them. The trainer creates
their process groups once (:meth:`ParallelLayout.create_groups`, the same list in the same order on
every rank, as torch.distributed requires); the engine then asks it for its mesh and holders.
"""
from __future__ import annotations

from dataclasses import dataclass

from hetero.runtime.expert_parallel import ExpertPlacement, expert_holders
from hetero.runtime.grads import all_holder_sets, all_peer_sets, param_holders


def tp_sets(layout) -> list[list[int]]:
    """The ranks of every stage with tp > 1 (ordered by tp rank), each stage once, in layout order."""
    seen = set()
    out = []
    for r in layout.ranks:
        key = (r.pipeline, r.replica, r.stage)
        if r.tp_size > 1 and key not in seen:
            seen.add(key)
            out.append(layout.stage_ranks(*key))
    return out


@dataclass(frozen=True)
class ParallelLayout:
    """The rank sets of one run and this rank's place in them (see the module docstring)."""

    rank: int
    layout: object
    """The run's :class:`~hetero.layout.RankLayout`."""
    holders: dict[str, tuple[int, ...]]
    """Native engine: global parameter name -> the ranks holding it (every tp rank, pipeline and replica);
    empty for DeepSpeed, which reduces over its own data-parallel group."""
    tp_sets: tuple[tuple[int, ...], ...]
    """Every tensor-parallel stage's ranks, ordered by tp rank."""
    group_sets: tuple[tuple[int, ...], ...]
    """Every process group any rank needs: tp sets, holder sets, their peer and chunk sets."""
    mesh_sets: tuple[tuple[int, ...], ...]
    """The rank sets of DTensor meshes (tensor-parallel stages)."""
    experts: object = None
    """MoE models with ``expert_parallel``: the :class:`~hetero.runtime.expert_parallel.ExpertPlacement`
    (which rank holds which routed experts; their holder sets follow it); None: every rank holds all."""

    @classmethod
    def build(cls, model, plan, layout, rank: int, engine: str = "native") -> ParallelLayout:
        """The layout of a run of ``plan`` with ``engine``, seen from ``rank``."""
        tp = tuple(tuple(s) for s in tp_sets(layout))
        if engine != "native":   # DeepSpeed: pure data parallelism, groups of its own (ds_engine.PlanMPU)
            ExpertPlacement.build(model, plan, layout, engine)   # refuses expert parallelism
            return cls(rank, layout, {}, tp, (), ())
        placement = ExpertPlacement.build(model, plan, layout, engine)
        holders = param_holders(model, plan, layout)
        if placement is not None:   # an expert's gradient sums over the ranks holding it only
            holders = expert_holders(holders, placement)
        groups = (list(tp) + all_holder_sets(holders)
                  + all_peer_sets(holders, layout, chunks=plan.zero_stage == 0)
                  + (placement.rank_sets() if placement is not None else []))
        return cls(rank, layout, holders, tp, tuple(tuple(g) for g in groups), tp, placement)

    @property
    def me(self):
        """This rank's :class:`~hetero.layout.RankInfo`."""
        return self.layout.ranks[self.rank]

    def tp_ranks(self) -> list[int]:
        """This rank's tensor-parallel set (itself alone at tp 1), ordered by tp rank."""
        me = self.me
        return self.layout.stage_ranks(me.pipeline, me.replica, me.stage)

    def create_groups(self, comm) -> None:
        """Create every process group of the run on ``comm`` (a collective: every rank calls it once)."""
        comm.create_groups(self.group_sets, mesh_sets=self.mesh_sets)

    def tp_mesh(self, comm, device_type: str):
        """This rank's DTensor mesh over its tp set, on the group ``comm`` made for it; None at tp 1."""
        if self.me.tp_size <= 1:
            return None
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(comm.mesh_group(self.tp_ranks()), device_type)
