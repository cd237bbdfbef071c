"""The RL weight sync and sample channel, in one process: the transition from an actor layout (pp2 with
tied embeddings, tp2) to whole copies moves every element exactly once per copy, the buckets put
every value where it belongs, and the checksums catch a changed bit."""
from __future__ import annotations

import collections

import pytest
import torch

import hetero
from hetero.layout import build_layout
from hetero.rl.channel import readers
from hetero.rl.sync import WeightSync, checksums_match, whole_model
from hetero.runtime.model import build_stage
from hetero.runtime.reshard.space import relative
from helpers.specs import CLUSTER, GPT, LLAMA, plan_dict, stage_dict

PLANS = {
    "pp2": plan_dict(stages=[stage_dict("fast", 0, 2), stage_dict("fast", 2, 4)], micro_batches=4),
    "tp2": plan_dict(stages=[stage_dict("fast", 0, 4, tp=2)], micro_batches=4),
    "pp2-dp2": plan_dict(stages=[stage_dict("fast", 0, 3), stage_dict("slow", 3, 4)], replicas=2, micro_batches=2),
}


class LoopbackComm:
    """send / recv between the ranks of one process: one queue per (src, dst, tag), as ordered p2p."""

    def __init__(self):
        self.queues = collections.defaultdict(collections.deque)
        self.me = None

    def as_rank(self, rank):
        self.me = rank
        return self

    def send(self, tensor, dst, tag=0):
        self.queues[(self.me, dst, tag)].append(tensor.clone())

    def recv(self, tensor, src, tag=0):
        tensor.copy_(self.queues[(src, self.me, tag)].popleft())
        return tensor


def _sync(model_dict, plan_dict_, corrupt=False, bucket_mb=0.01):
    model, plan = hetero.load_model(model_dict), hetero.load_plan(plan_dict_)
    cluster = hetero.load_cluster(CLUSTER)
    layout = build_layout(cluster, plan)
    A = layout.world_size
    receivers = [A, A + 1]   # two whole copies beyond the actor's ranks, of the other vendor
    vendors = {**{r.rank: r.vendor for r in layout.ranks}, A: "emu-b", A + 1: "emu-b"}
    sync = WeightSync(model, plan, layout, receivers, vendors, bucket_mb=bucket_mb)
    full = dict(build_stage(model, (0, model.num_layers), True, True, seed=5).named_parameters())
    comm = LoopbackComm()
    for r in range(A):   # each actor rank's local tensors: its box of every tensor it holds
        params = {n: full[n].detach()[relative(box, tuple((0, s) for s in full[n].shape))].clone()
                  for n, box in sync.held[r].items()}
        sync.send(comm.as_rank(r), r, params, version=0)
    copies = []
    for dst in receivers:
        _, whole = whole_model(model, "cpu")
        for t in whole.values():
            t.fill_(float("nan"))
        if corrupt and dst == receivers[-1]:   # one bit of one bucket flipped on the wire
            key = next(k for k in comm.queues if k[1] == dst)
            flat = comm.queues[key][0]
            flat.view(torch.int32)[0] ^= 1
        sync.receive(comm.as_rank(dst), dst, whole, version=0)
        copies.append(whole)
    return sync, full, copies


@pytest.mark.parametrize("model,plan", [(GPT, "pp2"), (LLAMA, "tp2"), (LLAMA, "pp2-dp2")])
def test_every_copy_equals_the_actor_weights_bit_for_bit(model, plan):
    sync, full, copies = _sync(model, PLANS[plan])
    for whole in copies:
        assert set(whole) == set(full)
        for name, t in whole.items():
            assert torch.equal(t, full[name].detach()), name
    assert checksums_match([sync.log]) == (True, len(sync.log.sent))
    assert sync.log.bytes_received == 2 * sum(t.numel() * 4 for t in full.values())
    # each element of a copy comes once; the small cap cuts the pieces into several buckets
    for dst in (p.dst for p in sync.pieces):
        for name, t in full.items():
            assert sum(p.numel for p in sync.pieces if p.dst == dst and p.name == name) == t.numel()
    assert max(len(sync.buckets(p.src, p.dst)) for p in sync.pieces) > 1


def test_a_changed_bit_fails_the_checksums():
    sync, _, _ = _sync(GPT, PLANS["pp2"], corrupt=True)
    assert checksums_match([sync.log])[0] is False


def test_channel_readers_are_the_last_stages_and_the_first_stage_of_the_group():
    plan = hetero.load_plan(PLANS["pp2-dp2"])   # 2 replicas x 4 samples: groups of 2 -> groups 0-1, 2-3
    layout = build_layout(hetero.load_cluster(CLUSTER), plan)
    first = {(r.replica): r.rank for r in layout.ranks if r.stage == 0}
    last = sorted(r.rank for r in layout.ranks if r.stage == 1)
    assert readers(plan, layout, 0, 2) == sorted([first[0], *last])
    assert readers(plan, layout, 3, 2) == sorted([first[1], *last])
