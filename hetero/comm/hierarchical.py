"""Hierarchical (cross-vendor) collectives over a :class:`~hetero.comm.group.Group` of several vendors.

Each works in three steps: inside each vendor's part of the group over the vendor library, between
the vendor leaders over the host bridge (device tensors staged through the communicator's reusable
host buffers), and back inside each vendor. Every function runs to completion before it returns
(the communicator calls them on its ordered worker thread for ``async_op=True``) and records its
sub-operations in the communicator's statistics. ``comm`` is that communicator
(:class:`hetero.comm.communicator.Communicator`, which imports this module: not imported back).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .bridge import StagingPool, wait_work
from .errors import ReduceOp, divide_
from .group import Group


def all_reduce(comm, tensor, rop: ReduceOp, g: Group, deadline: float, op: str) -> None:
    """All-reduce in place: vendor reduce, leaders over the bridge, vendor broadcast."""
    nbytes = tensor.numel() * tensor.element_size()
    pg = g.vendor_pg
    if pg is not None:
        comm._rec(op, "vendor", g, nbytes)
        wait_work(dist.reduce(tensor, dst=g.leader, op=rop.torch_op(), group=pg, async_op=True), deadline)
    if g.is_leader:
        host = _to_host(comm._staging, tensor)
        comm._rec(op, "bridge", g, nbytes)
        g.bridge.all_reduce(host, rop, deadline)
        if rop is ReduceOp.AVG:
            divide_(host, g.size)
        _from_host(tensor, host)
    if pg is not None:
        comm._rec(op, "vendor", g, nbytes)
        wait_work(dist.broadcast(tensor, src=g.leader, group=pg, async_op=True), deadline)


def broadcast(comm, tensor, src: int, g: Group, deadline: float) -> None:
    """Broadcast from global rank ``src``: inside its vendor, leaders over the bridge, inside the others."""
    nbytes = tensor.numel() * tensor.element_size()
    src_vendor = comm.vendor_of_rank[src]
    root_leader = g.leaders[src_vendor]
    pg = g.vendor_pg
    mine = comm.vendor == src_vendor
    if mine and pg is not None:
        comm._rec("broadcast", "vendor", g, nbytes)
        wait_work(dist.broadcast(tensor, src=src, group=pg, async_op=True), deadline)
    if g.is_leader:
        host = _to_host(comm._staging, tensor, copy=mine)
        comm._rec("broadcast", "bridge", g, nbytes)
        g.bridge.broadcast(host, root_leader, deadline)
        if not mine:
            _from_host(tensor, host)
    if not mine and pg is not None:
        comm._rec("broadcast", "vendor", g, nbytes)
        wait_work(dist.broadcast(tensor, src=g.leader, group=pg, async_op=True), deadline)


def all_gather(comm, out2d, inp, g: Group, deadline: float) -> None:
    """All-gather of ``inp`` (flat) into ``out2d`` (group size x ``inp.numel()``, group order).

    Vendor gather to the leader (padded to the largest vendor part), leaders' blocks over the
    bridge, then the whole result broadcast inside each vendor.
    """
    nbytes = inp.numel() * inp.element_size()
    pg = g.vendor_pg
    n_max = max(len(v) for v in g.vendor_ranks.values())
    if n_max == 1:   # one rank per vendor: the bridge group is the group itself, in its order
        host_out = out2d if out2d.device.type == "cpu" else torch.empty(out2d.shape, dtype=out2d.dtype)
        comm._rec("all_gather", "bridge", g, nbytes)
        g.bridge.all_gather(host_out, _to_host(comm._staging, inp, slot=0), deadline)
        _from_host(out2d, host_out)
        return
    mine = g.my_vendor_ranks
    block = None
    if g.is_leader:
        block = torch.zeros((n_max, inp.numel()), dtype=inp.dtype, device=inp.device)
    if pg is not None:
        comm._rec("all_gather", "vendor", g, nbytes)
        gl = list(block[: len(mine)].unbind(0)) if g.is_leader else None
        wait_work(dist.gather(inp.contiguous(), gather_list=gl, dst=g.leader, group=pg, async_op=True),
                  deadline)
    elif g.is_leader:
        block[0].copy_(inp)
    if g.is_leader:
        leaders = g.bridge.ranks
        host_in = _to_host(comm._staging, block, slot=0)
        host_out = torch.empty((len(leaders), n_max, inp.numel()), dtype=inp.dtype)
        comm._rec("all_gather", "bridge", g, host_in.numel() * host_in.element_size())
        g.bridge.all_gather(host_out, host_in, deadline)
        leader_vendor = {g.leaders[v]: v for v in g.vendors}
        for j, lr in enumerate(leaders):
            for k, r in enumerate(g.vendor_ranks[leader_vendor[lr]]):
                out2d[g.index(r)].copy_(host_out[j, k])
    if pg is not None:
        comm._rec("all_gather", "vendor", g, out2d.numel() * out2d.element_size())
        wait_work(dist.broadcast(out2d, src=g.leader, group=pg, async_op=True), deadline)


def _to_host(staging: StagingPool, t, slot: int = 0, copy: bool = True):
    """A contiguous host tensor with ``t``'s data (``t`` itself when already one)."""
    if t.device.type == "cpu":
        return t if t.is_contiguous() else t.contiguous()
    host = staging.get(t.numel(), t.dtype, slot).view(t.shape)
    if copy:
        host.copy_(t, non_blocking=True)
        _sync(t)
    return host


def _from_host(t, host) -> None:
    if host is not t:
        t.copy_(host)


def _sync(t) -> None:
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    elif t.device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


#: the bridge tag of an all-to-all's cross-vendor transfers (apart from the runtime's point-to-point tags)
ALL_TO_ALL_TAG = 0x7A2A


def all_to_all(comm, output, inp, out_splits: list[int], in_splits: list[int], g: Group, deadline: float) -> None:
    """All-to-all of rows (``in_splits[i]`` rows of ``inp`` to the group's i-th rank, ``out_splits[j]`` rows
    of ``output`` from its j-th): one ``all_to_all_single`` over this rank's vendor part of the group
    on the vendor library, and one host-staged transfer over the bridge to and from each rank of another
    vendor (pairwise, empty ones skipped: both sides know the sizes)."""
    ins, outs = inp.split(in_splits), output.split(out_splits)
    row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
    mine = [g.index(r) for r in g.my_vendor_ranks]
    if g.vendor_pg is not None:
        send = torch.cat([ins[i] for i in mine])
        recv = torch.empty((sum(out_splits[i] for i in mine),) + tuple(output.shape[1:]),
                           dtype=output.dtype, device=output.device)
        comm._rec("all_to_all", "vendor", g, row * sum(in_splits[i] for i in mine if i != g.rank))
        wait_work(dist.all_to_all_single(recv, send, [out_splits[i] for i in mine], [in_splits[i] for i in mine],
                                         group=g.vendor_pg, async_op=True), deadline)
        for i, part in zip(mine, recv.split([out_splits[i] for i in mine])):
            outs[i].copy_(part)
    else:
        outs[g.rank].copy_(ins[g.rank])
    sends, recvs = [], []
    for i, r in enumerate(g.ranks):
        if comm.vendor_of_rank[r] == comm.vendor:
            continue
        if out_splits[i]:
            host = torch.empty(outs[i].shape, dtype=output.dtype)
            recvs.append((comm.bridge.irecv(host, r, ALL_TO_ALL_TAG), host, outs[i]))
        if in_splits[i]:
            host = ins[i].detach().to("cpu").contiguous()
            comm.stats.record("all_to_all", "bridge", None, sorted((comm.rank, r)), host.numel() * host.element_size())
            sends.append((comm.bridge.isend(host, r, ALL_TO_ALL_TAG), host))
    for work, _host in sends:
        wait_work(work, deadline)
    for work, host, out in recvs:
        wait_work(work, deadline)
        out.copy_(host)
