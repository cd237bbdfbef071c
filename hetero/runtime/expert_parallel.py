"""Expert parallelism: the routed experts of an MoE layer spread over a group of ranks.

The plan's ``expert_parallel: {degree: k, experts: [n0, n1, ...]}`` puts the routed experts of each
MoE layer on groups of ``k`` data-parallel ranks that hold that layer (the layer's holders in order of
pipeline, then replica, cut into consecutive groups of ``k``). The i-th rank of a group holds ``n_i``
consecutive experts (uneven, by device speed; default an even split). Everything else of the layer
(router, shared expert, norms, attention) stays replicated as in plain data parallelism.

A forward on one rank (:class:`ExpertGroup`, the hook :class:`hetero.runtime.moe.MoEMLP` calls with
its token assignments sorted by expert): the counts per expert go to the ranks holding them (one
all-to-all of integers), then the assigned rows (one all-to-all of ``rows x hidden``, the dispatch),
each rank runs its experts on what it received from every rank, and the outputs return the same way
(the combine). The backward runs the two row exchanges in reverse (:class:`_AllToAll`). All
exchanges go through the run's communicator (:meth:`hetero.runtime.collectives.Collectives.all_to_all_single`,
or a :class:`hetero.comm.Communicator` group): across vendors, host-staged over the bridge.

Gradients: a rank holds only its experts, named as without expert parallelism
(``layers.<l>.mlp.experts.<e>.*``), so the virtual parameter space and checkpoints see which rank holds
which expert. Each expert's gradient already sums every rank's tokens routed to it (the combine's
backward brings them); the data-parallel sum then runs over the ranks holding the same expert (the
same place in the other groups: :func:`expert_holders`), while the router and every other parameter
keeps its holder set. Tensor parallelism of MoE layers is refused (by the model); ZeRO with expert
parallelism is refused (:func:`check_supported`).

Bytes: :func:`exchange_bytes` says what one forward's exchanges put on each link for a given
routing, which is what the communicator records (the test compares them) and what the predictor charges.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from hetero.errors import HeteroError
from hetero.runtime.moe_checks import refuse_zero_with_experts

#: ``all_to_all(output, input, output_splits, input_splits)`` over one expert group
AllToAll = Callable[[torch.Tensor, torch.Tensor, list, list], torch.Tensor]

_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def split_experts(num_experts: int, degree: int, experts: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The expert range ``[start, stop)`` of each rank of a group of ``degree``: ``experts`` counts in
    order, or an even split (the first ``num_experts % degree`` ranks one more)."""
    if experts is None:
        base, extra = divmod(num_experts, degree)
        experts = [base + (i < extra) for i in range(degree)]
    if len(experts) != degree or sum(experts) != num_experts or min(experts) < 0:
        raise HeteroError(f"plan: expert_parallel.experts {list(experts)} must give each of the {degree} ranks of a "
                          f"group a count >= 0, {num_experts} in all (fix: counts that add up to moe.num_experts)")
    out, start = [], 0
    for n in experts:
        out.append((start, start + n))
        start += n
    return out


def layer_groups(plan, layout, layer: int, degree: int) -> list[tuple[int, ...]]:
    """The expert groups of model layer ``layer``: its holders (every rank whose stage runs it) in order of
    pipeline, then replica, cut into consecutive groups of ``degree``."""
    holders = [r for r in layout.ranks
               if any(a <= layer < b for a, b in r.chunk_layers(plan))]
    holders.sort(key=lambda r: (r.pipeline, r.replica, r.rank))
    if len(holders) % degree:
        raise HeteroError(f"plan: expert_parallel.degree {degree} does not divide the {len(holders)} ranks "
                          f"holding layer {layer}; use a degree that divides the data-parallel ranks of every MoE layer")
    ranks = [r.rank for r in holders]
    return [tuple(ranks[i:i + degree]) for i in range(0, len(ranks), degree)]


@dataclass(frozen=True)
class ExpertPlacement:
    """Who holds which routed experts of every MoE layer (the plan's ``expert_parallel`` on a layout)."""

    groups: dict[int, list[tuple[int, ...]]]
    """MoE layer -> its expert groups (global ranks, in group order)."""
    ranges: tuple[tuple[int, int], ...]
    """The expert range ``[start, stop)`` of each place in a group."""

    @classmethod
    def build(cls, model, plan, layout, engine: str = "native") -> ExpertPlacement | None:
        """The placement of the plan's ``expert_parallel`` (None: absent, degree 1, or a dense model),
        refusing what it does not run with (:func:`check_supported`)."""
        ep = getattr(plan, "expert_parallel", None)
        if ep is None or ep.degree <= 1 or model.moe is None:
            return None
        ranges = tuple(split_experts(model.moe.num_experts, ep.degree, ep.counts(model.moe.num_experts)))
        placement = cls({layer: layer_groups(plan, layout, layer, ep.degree) for layer in model.moe_layers()}, ranges)
        check_supported(plan, layout, placement, engine)
        return placement

    def group_of(self, layer: int, rank: int) -> tuple[int, ...]:
        """The expert group of ``rank`` for ``layer``."""
        return next(g for g in self.groups[layer] if rank in g)

    def experts_of(self, layer: int, rank: int) -> tuple[int, int]:
        """The expert range ``rank`` holds of ``layer``."""
        return self.ranges[self.group_of(layer, rank).index(rank)]

    def held(self, rank: int) -> dict[int, int]:
        """MoE layer -> the number of routed experts ``rank`` holds (layers it runs only)."""
        ranges = {layer: self.experts_of(layer, rank) for layer, gs in self.groups.items() if any(rank in g for g in gs)}
        return {layer: stop - start for layer, (start, stop) in ranges.items()}

    def rank_sets(self) -> list[tuple[int, ...]]:
        """Every expert group (the process groups the exchanges need)."""
        return sorted({tuple(sorted(g)) for gs in self.groups.values() for g in gs})

    def holders(self, layer: int, expert: int) -> tuple[int, ...]:
        """Every rank holding ``expert`` of ``layer``: its place in each group."""
        place = next(i for i, (a, b) in enumerate(self.ranges) if a <= expert < b)
        return tuple(sorted(g[place] for g in self.groups[layer]))


def rank_experts(model, plan, info) -> tuple[int, int] | None:
    """The routed experts ``[start, stop)`` that rank ``info`` (a :class:`hetero.layout.RankInfo` of ``plan``)
    holds of each of its MoE layers; None: every expert (no expert parallelism). Its place in a group
    is its data-parallel index (pipelines, then replicas) modulo the degree, as :func:`layer_groups`
    orders a layer's holders."""
    ep = getattr(plan, "expert_parallel", None)
    if ep is None or ep.degree <= 1 or model.moe is None:
        return None
    n = model.moe.num_experts
    return split_experts(n, ep.degree, ep.counts(n))[ep.slot(plan, info.pipeline, info.replica)]


def holds_tensor(name: str, experts: tuple[int, int] | None) -> bool:
    """Whether a rank holding routed experts ``experts`` (None: all) holds the tensor ``name``."""
    m = _EXPERT.match(name)
    return experts is None or m is None or experts[0] <= int(m.group(2)) < experts[1]


def expert_holders(holders: dict[str, tuple[int, ...]], placement: ExpertPlacement) -> dict[str, tuple[int, ...]]:
    """The holder sets of a run (global parameter name -> ranks; :func:`hetero.runtime.grads.param_holders`)
    with each routed expert's tensors held by the ranks holding that expert only, so their gradients
    are summed over the groups and not inside one."""
    out = dict(holders)
    for name in holders:
        m = _EXPERT.match(name)
        if m:
            out[name] = placement.holders(int(m.group(1)), int(m.group(2)))
    return out


def check_supported(plan, layout, placement: ExpertPlacement, engine: str = "native") -> None:
    """Refuse what expert parallelism does not run with, in one line naming the field and the fix: ZeRO,
    the DeepSpeed engine, and a group whose ranks run different schedules (each exchange is a collective
    of the group, so its ranks must run the layer's forwards and backwards in the same order: the same
    layers, micro-batch count and size)."""
    if engine != "native":
        raise HeteroError(f"plan: expert_parallel runs on the native engine only (fix: drop --engine {engine})")
    refuse_zero_with_experts(plan)
    info = {r.rank: r for r in layout.ranks}

    def schedule(rank: int):
        r = info[rank]
        p = plan.pipelines[r.pipeline]
        return r.chunk_layers(plan), p.micro_batches, plan.mbs(p), r.virtual_stages

    for layer, groups in placement.groups.items():
        for g in groups:
            if len({schedule(r) for r in g}) > 1:
                raise HeteroError(f"plan: expert_parallel groups ranks {list(g)} for layer {layer}, whose pipelines "
                                  f"run different stages or micro-batches (fix: a degree that groups replicas "
                                  f"of the same pipeline shape, or pipelines split alike)")


class ExpertSubset(nn.ModuleDict):
    """The routed experts one rank holds, keyed by their model-wide index (so parameter names stay
    ``experts.<e>.*``); indexed by an int and iterated as the local experts in order, like the
    ``ModuleList`` of all experts that :class:`~hetero.runtime.moe.MoEMLP` computes with."""

    def __getitem__(self, key):
        if isinstance(key, int):
            return list(self._modules.values())[key]
        return super().__getitem__(key)

    def __iter__(self):
        return iter(self._modules.values())


class _AllToAll(torch.autograd.Function):
    """Rows exchanged by an all-to-all; the backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x, exchange: AllToAll, out_splits: list, in_splits: list):
        ctx.exchange, ctx.splits = exchange, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        return exchange(out, x.contiguous(), out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        return ctx.exchange(back, grad.contiguous(), in_splits, out_splits), None, None, None


class ExpertGroup:
    """One MoE layer's expert group seen from one rank: ``exchange`` runs an all-to-all over the group's
    ranks in group order; ``ranges`` is each place's expert range, ``place`` this rank's."""

    def __init__(self, exchange: AllToAll, ranges: Sequence[tuple[int, int]], place: int):
        self.exchange, self.ranges, self.place = exchange, list(ranges), place
        self.sent_rows = 0
        """Rows this rank dispatched to other ranks since created (its own stay)."""

    def __call__(self, moe, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs of the rows ``xs`` (sorted by expert, ``counts[e]`` rows for expert e, all experts
        of the model), computed by the ranks holding the experts; same order as ``xs``."""
        g = len(self.ranges)
        lo, hi = self.ranges[self.place]
        counts = counts.to(torch.int64).cpu()
        recv_counts = counts.new_empty(g * (hi - lo))
        self.exchange(recv_counts, counts, [hi - lo] * g, [b - a for a, b in self.ranges])
        recv_counts = recv_counts.view(g, hi - lo)
        in_splits = [int(counts[a:b].sum()) for a, b in self.ranges]
        out_splits = recv_counts.sum(1).tolist()
        self.sent_rows += sum(in_splits) - in_splits[self.place]
        got = _AllToAll.apply(xs, self.exchange, out_splits, in_splits)
        # rows arrive by source rank, then by expert: regroup them by expert for the expert compute
        local = torch.arange(hi - lo).repeat(g).repeat_interleave(recv_counts.reshape(-1))
        order = torch.argsort(local, stable=True).to(xs.device)
        # no rows received (no experts here, or none of the group's tokens routed to them): the empty
        # rows stay in the graph, so this rank runs the backward's exchanges as the others do, and its
        # experts run on no rows, so each gets a zero gradient as on one device (MoEMLP._experts)
        rows = got[order]
        y = moe._experts(rows, recv_counts.sum(0).to(xs.device)) if hi > lo else rows
        back = torch.empty_like(y).index_copy(0, order, y)
        return _AllToAll.apply(back, self.exchange, in_splits, out_splits)


def apply_expert_parallel(module: nn.Module, placement: ExpertPlacement, rank: int, comm) -> None:
    """Keep only ``rank``'s experts in every MoE layer of the stage ``module``, their exchanges over
    ``comm`` (the run's :class:`~hetero.runtime.collectives.Collectives`, with a group for every
    expert group: :meth:`ExpertPlacement.rank_sets`)."""
    from hetero.runtime.moe import moe_layers_of

    for name, moe in moe_layers_of(module).items():
        layer = int(name.split(".")[1])
        g = placement.group_of(layer, rank)
        shard_moe(moe, ExpertGroup(paced(in_rank_order(comm, g)), placement.ranges, g.index(rank)))


def paced(exchange: AllToAll) -> AllToAll:
    """``exchange`` met as an emulated slower device reaches it (:func:`hetero.runtime.pacing.meeting`):
    the group meets at every exchange, so a slower rank must arrive late at each."""
    from hetero.runtime.pacing import meeting

    return lambda out, inp, out_splits, in_splits: meeting(lambda: exchange(out, inp, out_splits, in_splits))


def in_rank_order(comm, group: Sequence[int]) -> AllToAll:
    """An all-to-all over ``group`` whose splits and blocks are in the group's order (its places), on a
    communicator whose all-to-all takes them in ascending rank order."""
    order = sorted(range(len(group)), key=lambda i: group[i])
    if order == list(range(len(group))):
        return lambda out, inp, out_splits, in_splits: comm.all_to_all_single(out, inp, out_splits, in_splits, group)

    def exchange(out, inp, out_splits, in_splits):
        blocks = inp.split(in_splits)
        got = out.new_empty(out.shape)
        comm.all_to_all_single(got, torch.cat([blocks[i] for i in order]), [out_splits[i] for i in order],
                               [in_splits[i] for i in order], group)
        parts = dict(zip(order, got.split([out_splits[i] for i in order])))
        return out.copy_(torch.cat([parts[i] for i in range(len(group))]))

    return exchange


def shard_moe(moe, group: ExpertGroup) -> None:
    """Keep only this rank's experts of the MoE layer ``moe`` (if it still holds all) and route its
    expert compute through ``group``."""
    _keep(moe, group.ranges[group.place])
    moe.expert_group = group


def keep_experts(module: nn.Module, experts: tuple[int, int] | None) -> None:
    """Keep only the routed experts ``[start, stop)`` in every MoE layer of the stage ``module`` (None:
    all): a stage rebuilt for an expert-parallel plan (:func:`hetero.runtime.reshard.transfer.rebuild_stage`),
    whose exchanges the engine then attaches (:func:`apply_expert_parallel`)."""
    from hetero.runtime.moe import moe_layers_of

    if experts is not None:
        for moe in moe_layers_of(module).values():
            _keep(moe, experts)


def build_expert_stage(model, plan, info, seed: int) -> nn.Module:
    """Rank ``info``'s stage for an expert-parallel ``plan`` with only its own routed experts ever
    allocated (built on the meta device, its experts kept, then materialised on the host), initialised
    as :func:`hetero.runtime.model.build_stage` initialises the whole stage: every parameter's value
    depends only on the seed and its name, so each expert equals the one-device model's."""
    from hetero.runtime.model import StageModel, init_weights, rope_tables, skip_init

    chunks = info.chunk_layers(plan)
    with torch.device("meta"), skip_init():
        module = StageModel(model, chunks[0], *info.holds_ends(plan), chunks)
    keep_experts(module, rank_experts(model, plan, info))
    module.to_empty(device="cpu")
    tables = None
    for name, _ in list(module.named_buffers()):   # computed, not initialised: rope tables, expert biases
        owner, leaf = name.rsplit(".", 1)
        if leaf in ("cos", "sin"):
            tables = tables or rope_tables(model.seq_length, model.head_dim, model.rope_theta)
            value = tables[leaf == "sin"]
        elif leaf == "expert_bias":
            value = torch.zeros(model.moe.num_experts)
        else:
            raise RuntimeError(f"{name}: a buffer an expert-parallel stage does not know how to build")
        module.get_submodule(owner).register_buffer(leaf, value, persistent=leaf == "expert_bias")
    init_weights(module, seed)
    return module


def _keep(moe, experts: tuple[int, int]) -> None:
    lo, hi = experts
    if isinstance(moe.experts, ExpertSubset):
        if list(moe.experts.keys()) != [str(e) for e in range(lo, hi)]:
            raise RuntimeError(f"MoE layer holds experts {list(moe.experts.keys())}, not {lo}..{hi - 1}")
        return
    moe.experts = ExpertSubset({str(e): moe.experts[e] for e in range(lo, hi)})


def exchange_bytes(counts: torch.Tensor, ranges: Sequence[tuple[int, int]], row_bytes: int) -> torch.Tensor:
    """Bytes one MoE layer's forward puts on each link of an expert group: ``[i, j]`` what the group's
    i-th rank sends its j-th (diagonal 0: a rank's rows to itself move nowhere). ``counts[i, e]``: the
    token assignments of rank i's tokens to expert e (after capacity drops); ``row_bytes``: one row
    (hidden x element size). Counts out (8 bytes per expert of the receiver), rows out to the experts'
    ranks, outputs back: the combine carries the transposed dispatch. The backward moves the two row
    exchanges again, transposed."""
    counts = counts.to(torch.int64)
    g = len(ranges)
    rows = torch.stack([counts[:, a:b].sum(1) for a, b in ranges], dim=1)   # [i, j] rows i sends j
    sizes = torch.tensor([b - a for a, b in ranges], dtype=torch.int64)
    out = 8 * sizes.expand(g, g) + row_bytes * (rows + rows.T)
    out.fill_diagonal_(0)
    return out
