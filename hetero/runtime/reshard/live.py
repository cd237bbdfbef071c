"""The control plane of an in-process reconfiguration: who is left, the new plan, the new groups.

The coordinator (the launcher's process: it replans and never holds a tensor) hosts a ``TCPStore``
that outlives any worker. After a failure every survivor

1. aborts its broken process group (:func:`regroup` destroys it),
2. checks in under the next *generation* (:func:`report_alive`: its id, pid and applied step),
3. waits, with a timeout, for the coordinator's decision (:func:`await_decision`): the members and
   their new ranks, and the new plan;

while the coordinator waits for the check-ins of every process it still believes alive
(:meth:`Coordinator.await_survivors`, with a timeout: one that never checks in is lost too),
replans, and publishes the decision (:meth:`Coordinator.publish`). The survivors then build the new
world in-process on a fresh key prefix of the same store (``gen<g>/``), so nothing of the broken
group's keys is reused, and reshard (:mod:`hetero.runtime.reshard.transfer`).

A survivor that waits longer than its timeout ends with :class:`ReconfigurationError` naming what
it waited for, never a hang.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass

import torch.distributed as dist

from hetero.runtime.reshard import ReconfigurationError


def _key(gen: int, what: str) -> str:
    return f"hetero/reconfig/gen{gen}/{what}"


def alive_key(gen: int, rank: int) -> str:
    """Where rank ``rank`` of the generation before ``gen`` checks in for it, with where its state is
    (:func:`report_alive`); the coordinator decides once every live rank has."""
    return _key(gen, f"alive/{rank}")


def reserve_key(gen: int) -> str:
    """Where the ranks of generation ``gen`` find, by rank, the most state their exchange would
    allocate after any single loss (set by the launcher once it planned for each)."""
    return _key(gen, "reserve")


class Coordinator:
    """The store every worker's reconfiguration goes through, hosted in this process."""

    def __init__(self, port: int = 0, timeout_s: float = 60.0):
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.port = self.store.port

    def await_survivors(self, gen: int, candidates: list[int], timeout_s: float) -> dict[int, dict]:
        """The check-ins of generation ``gen`` among ``candidates`` (process ids): returns as soon as
        every candidate checked in, else at the timeout with those that did."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, dict] = {}
        while True:
            for c in candidates:
                if c not in got and self.store.check([alive_key(gen, c)]):
                    got[c] = json.loads(self.store.get(alive_key(gen, c)))
            if len(got) == len(candidates) or time.monotonic() > deadline:
                return got
            time.sleep(0.005)

    def publish(self, gen: int, members: dict[int, int], decision: dict) -> None:
        """The decision of generation ``gen``: ``members`` (process id -> new rank) and what else the
        workers need (the plan, the cluster, the step to go on from)."""
        self.store.set(_key(gen, "decision"), json.dumps({**decision, "members": {str(k): v for k, v in
                                                                                   members.items()}}))

    def close(self) -> None:
        del self.store


def connect(port: int, timeout_s: float = 60.0, host: str = "127.0.0.1") -> dist.TCPStore:
    """A worker's client of the coordinator's store (on ``host``: the launching machine, or node
    slot 0's when every machine's launcher takes part, :mod:`hetero.runtime.elastic.agent`)."""
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def report_alive(store, gen: int, me: int, **info) -> None:
    """Check in as a survivor of generation ``gen - 1``'s failure (``info``: the applied step, ...)."""
    store.set(alive_key(gen, me), json.dumps({"pid": os.getpid(), **info}))


def await_decision(store, gen: int, timeout_s: float) -> dict:
    """The coordinator's decision for generation ``gen`` (``members`` keyed by process id)."""
    key = _key(gen, "decision")
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - the store says 'timeout' in several ways
        raise ReconfigurationError(f"reconfiguration {gen}: no decision from the coordinator within {timeout_s:g} s "
                                   f"({str(e).splitlines()[0][:200]})") from None
    d = json.loads(store.get(key))
    d["members"] = {int(k): v for k, v in d["members"].items()}
    return d


def regroup(store, gen: int, rank: int, world: int, timeout_s: float, prefix: str | None = None) -> None:
    """Leave the broken world (if any) and join generation ``gen``'s as ``rank`` of ``world``, on the
    key prefix ``gen<g>/`` (or ``prefix``) of the coordinator's store."""
    if dist.is_initialized():
        dist.destroy_process_group()
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix or f"gen{gen}/", store), rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - a member lost before it joined: said, not hung
        raise ReconfigurationError(f"reconfiguration {gen}: the new world of {world} ranks did not form within "
                                   f"{timeout_s:g} s (a member was lost before joining?): "
                                   f"{str(e).splitlines()[0][:200]}") from None


def decision_for(model: dict, old: tuple[dict, dict], new: tuple[dict, dict], survivors: list[int],
                 step: int, checkpoint: str | None = None, transport: str = "p2p",
                 pids: dict[int, int] | None = None, lost_slices: bool | str = False) -> dict:
    """What the coordinator publishes besides the members: the model, the (cluster, plan) before and
    after as dicts, every survivor (old ranks: one the new plan leaves out still serves its state
    in the exchange, then leaves), the step the state is at, the last ``--save`` checkpoint (the
    fallback when no survivor holds some region), the exchange's transport (:func:`choose_transport`)
    and the process id of every process in it (the launcher's; a same-host exchange watches its
    peers by them). ``lost_slices``: a ZeRO run lost a rank whose optimizer slices the survivors'
    copies cannot rebuild (True, or the reason in words): every region comes from ``checkpoint``."""
    return {"model": model, "old": {"cluster": old[0], "plan": old[1]}, "new": {"cluster": new[0], "plan": new[1]},
            "survivors": sorted(survivors), "step": step, "checkpoint": checkpoint, "transport": transport,
            "pids": {str(k): v for k, v in (pids or {}).items()}, "lost_slices": lost_slices}


TRANSPORT_ENV = "HETERO_RESHARD_TRANSPORT"
"""``p2p``: the exchange goes over torch.distributed even where every rank is on this machine."""


def choose_transport(checkins: dict[int, dict]) -> str:
    """The exchange's transport, the same for every rank: ``same-host`` (receivers read the senders'
    memory, :mod:`hetero.runtime.reshard.cma`) when every rank that checked in keeps its state in
    host memory (``host_memory`` in its check-in) and this machine allows it; the workers of the
    in-process path all run on the launcher's machine. Else ``p2p`` (torch.distributed)."""
    from hetero.runtime.reshard import cma

    if os.environ.get(TRANSPORT_ENV, "").lower() == "p2p":
        return "p2p"
    if checkins and all(c.get("host_memory") for c in checkins.values()) and cma.usable():
        return "same-host"
    return "p2p"


def host_memory(live: dict) -> bool:
    """Whether all of a rank's live state (:func:`~.transfer.live_state`) is in host memory."""
    return all(t.device.type == "cpu" for st in live.values() for t in st.tensors.values())


def exchange_ranks(members: dict[int, int], survivors: list[int]) -> dict[int, int]:
    """Old rank -> rank in the exchange's world: a member's new rank; survivors the new plan leaves
    out take the ranks after its world (they serve their state, then leave)."""
    helpers = [r for r in sorted(survivors) if r not in members]
    return {**members, **{r: len(members) + i for i, r in enumerate(helpers)}}


def transition_between(space, old_plan, old_layout, targets: dict, world_rank: dict[int, int], new_layout=None):
    """The :class:`~hetero.runtime.reshard.transition.Transition` that gives every rank of the new
    layout its ``targets`` (:meth:`ParameterSpace.layout_regions`) from what the ranks of
    ``old_layout`` hold (old rank -> rank in the exchange's world: ``world_rank``), preferring
    sources of the receiver's vendor. The workers and the launcher's prediction compute it alike.
    A process that joins (an id past the old layout's ranks) holds nothing; its vendor is its rank's
    in ``new_layout``."""
    from hetero.runtime.reshard.transition import plan_transition

    held = [r for r in world_rank if r < len(old_layout.ranks)]   # a joining process (an id past them) holds nothing
    sources = {world_rank[r]: space.rank_regions(old_plan, old_layout.ranks[r]) for r in held}
    vendors = {world_rank[r]: old_layout.ranks[r].vendor for r in held}
    if new_layout is not None:
        vendors.update({world_rank[r]: new_layout.ranks[world_rank[r]].vendor for r in world_rank if r not in held})
    return plan_transition(sources, targets, vendors)


@dataclass
class Resolved:
    """What a decision means for every rank alike: the model, the (old, new) plans and layouts, each
    survivor's rank in the exchange (:func:`exchange_ranks`), the new plan's regions by rank and the
    transition (:func:`resolve`)."""

    model: object
    space: object
    plans: list
    layouts: list
    world_rank: dict
    targets: dict
    transition: object


_RESOLVED: dict[str, Resolved] = {}
_RESOLVED_MAX = 16


def resolve(d: dict, space=None) -> Resolved:
    """:class:`Resolved` for decision ``d`` (:func:`decision_for`'s fields and ``members``),
    computed once per distinct (model, old, new, survivors, members): a worker resolves the
    decisions the launcher made ahead for each single loss (:func:`ahead_key`) at a step boundary,
    so that after a loss the transition is already there. ``space``: the model's
    :class:`~hetero.runtime.reshard.space.ParameterSpace`, if made already."""
    import hetero
    from hetero.layout import build_layout
    from hetero.runtime.reshard.space import ParameterSpace

    members = {int(k): v for k, v in d["members"].items()}
    survivors = sorted(d.get("survivors", sorted(members)))
    key = json.dumps([d["model"], d["old"], d["new"], survivors, sorted(members.items())], sort_keys=True)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    model = hetero.load_model(d["model"])
    plans = [hetero.load_plan(d["old"]["plan"]), hetero.load_plan(d["new"]["plan"])]
    layouts = [build_layout(hetero.load_cluster(d["old"]["cluster"]), plans[0]),
               build_layout(hetero.load_cluster(d["new"]["cluster"]), plans[1])]
    space = space or ParameterSpace(model)
    world_rank = exchange_ranks(members, survivors)
    targets = space.layout_regions(plans[1], layouts[1])
    transition = transition_between(space, plans[0], layouts[0], targets, world_rank, layouts[1])
    if len(_RESOLVED) >= _RESOLVED_MAX:   # an earlier generation's: not asked again
        _RESOLVED.clear()
    hit = _RESOLVED[key] = Resolved(model, space, plans, layouts, world_rank, targets, transition)
    return hit


def ahead_key(gen: int) -> str:
    """Where the ranks of generation ``gen`` find the decisions the launcher made ahead, one per
    single loss (:func:`decision_for`'s plan fields, ``survivors`` and ``members``), to
    :func:`resolve` them at a step boundary."""
    return _key(gen, "ahead")


class NewPlace:
    """A survivor's place in the new world after :func:`reconfigure`: its rank, whether the new plan
    has it (``member``; if not, it served its state and leaves), its ``info``
    (:class:`hetero.layout.RankInfo`), the plan and layout, its tp mesh, its state and the timings."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def reconfigure(store, gen: int, me: int, live: dict, *, timeout_s: float = 30.0, max_bytes: int | None = None,
                applied_step: int = 0, detected_at: float | None = None, meshes: bool = True,
                on_checked_in=None, space=None, decision: dict | None = None,
                prepared: dict | None = None, checkin: dict | None = None, whole_state=None) -> NewPlace:
    """Everything a survivor (rank ``me`` of the broken world, holding ``live``:
    :func:`hetero.runtime.reshard.transfer.live_state`) does after a failure, up to its new state:
    check in, take the coordinator's decision, rebuild the world, exchange the intersections. The
    caller rebuilds its stage from the result (:func:`~hetero.runtime.reshard.transfer.rebuild_stage`).
    ``detected_at``: when this rank saw the failure (told the coordinator); ``meshes``: build the new
    plan's tp meshes in the exchange's world (False: the caller builds them in its own);
    ``on_checked_in``: called right after the check-in (tests lose a rank there); ``space``: the
    model's :class:`~hetero.runtime.reshard.space.ParameterSpace`, made before the failure;
    ``decision``: the coordinator's, already taken (a pause: checked in before leaving the world);
    ``prepared``: state tensors allocated (and touched) ahead for the regions this process expects
    to hold (:func:`~hetero.runtime.reshard.transfer.exchange`); ``checkin``: more of this rank's
    check-in (a ZeRO rank's slices and copies); ``whole_state(world_rank, survivors, describe)``: a
    ZeRO rank that lost a peer, whose ``live`` is empty, makes its whole live state with it in the
    new world before the exchange (:func:`hetero.runtime.elastic.slice_copies.whole_state`)."""
    from hetero.runtime.reshard.transfer import DEFAULT_MAX_BYTES, exchange

    t0 = time.perf_counter()
    if decision is None:
        report_alive(store, gen, me, applied_step=applied_step, detected_at=detected_at or time.time(),
                     host_memory=host_memory(live), **(checkin or {}))
        if on_checked_in:
            on_checked_in()
    d = decision or await_decision(store, gen, timeout_s)
    members = d["members"]
    known = resolve(d, space)   # made ahead at a step boundary where the launcher planned this loss
    model, space, plans, layouts = known.model, known.space, known.plans, known.layouts
    world_rank, targets, transition = known.world_rank, known.targets, known.transition
    if me not in world_rank:
        raise ReconfigurationError(f"reconfiguration {gen}: this process (rank {me}) is not among the survivors")
    t1 = time.perf_counter()
    rank, world = world_rank[me], len(world_rank)
    regroup(store, gen, rank, world, timeout_s)
    mesh = _tp_meshes(layouts[1], rank) if meshes else None
    t2 = time.perf_counter()
    if transition.missing or d.get("lost_slices"):
        if transition.missing:
            _, region = transition.missing[0]
            what = f"no survivor holds {region.name} (and {len(transition.missing) - 1} more regions)"
            fix = "a plan whose stages have data-parallel replicas, or run with --save"
        else:   # ZeRO: the lost rank's optimizer slices cannot be rebuilt (the launcher says why)
            why = d["lost_slices"] if isinstance(d["lost_slices"], str) else "the lost rank's optimizer slices have no copy"
            what = f"zero_stage {plans[0].zero_stage}: {why}"
            fix = "run with --save, or a plan with zero_stage: 0"
        if not d.get("checkpoint"):
            raise ReconfigurationError(f"reconfiguration {gen}: {what}: the live state cannot be rebuilt (fix: {fix})")
        from hetero.runtime.reshard.transfer import ExchangeStats, load_regions

        state, step = load_regions(d["checkpoint"], targets.get(rank, {}), space.shapes)
        if me == min(members):
            print(f"elastic: {what}; going on from the checkpoint {d['checkpoint']} at step {step}: steps "
                  f"{step + 1}-{d['step']} are lost and will be trained again", flush=True)
        return NewPlace(rank=rank, world=world, member=me in members,
                        info=layouts[1].ranks[rank] if me in members else None, plan=plans[1], layout=layouts[1],
                        cluster=d["new"]["cluster"],
                        model=model, mesh=mesh, state=state, stats=ExchangeStats(), transition=transition, step=step,
                        fallback=d["checkpoint"], timings={"agree_replan_s": t1 - t0, "regroup_s": t2 - t1,
                                                           "transfer_s": time.perf_counter() - t2})
    old_of = {v: k for k, v in world_rank.items()}
    describe = lambda r: f"rank {r} (rank {old_of.get(r, '?')} before)"   # noqa: E731
    if whole_state is not None:   # ZeRO after a loss: the stage's whole state from slices and copies
        live = whole_state(world_rank, d["survivors"], describe)
    same_host = None
    if d.get("transport") == "same-host":   # every peer's process id: the launcher's, else its check-in's
        pids = {world_rank[int(k)]: v for k, v in d.get("pids", {}).items() if int(k) in world_rank}
        pids.update({world_rank[r]: json.loads(store.get(alive_key(gen, r)))["pid"] for r in world_rank
                     if world_rank[r] not in pids and store.check([alive_key(gen, r)])})
        same_host = (store, _key(gen, "same-host"), pids, timeout_s)
    state, stats = exchange(rank, transition, live, targets.get(rank, {}), describe=describe,
                            max_bytes=max_bytes or DEFAULT_MAX_BYTES, same_host=same_host, prepared=prepared)
    t3 = time.perf_counter()
    member = me in members
    return NewPlace(rank=rank, world=world, member=member, info=layouts[1].ranks[rank] if member else None,
                    plan=plans[1], layout=layouts[1], fallback=None, cluster=d["new"]["cluster"],
                    model=model, mesh=mesh, state=state, stats=stats, transition=transition, step=d["step"],
                    timings={"agree_replan_s": t1 - t0, "regroup_s": t2 - t1, "transfer_s": t3 - t2})


def _tp_meshes(layout, rank: int):
    """A process group for every tp group of ``layout`` (every rank, same order); this rank's mesh."""
    mine = None
    seen = set()
    for info in layout.ranks:
        key = tuple(layout.stage_ranks(info.pipeline, info.replica, info.stage))
        if len(key) > 1 and key not in seen:
            seen.add(key)
            group = dist.new_group(list(key))
            if rank in key:
                from torch.distributed.device_mesh import DeviceMesh

                mine = DeviceMesh.from_group(group, "cpu")
    return mine
