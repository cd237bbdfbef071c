"""ZeRO slices copied to a peer (hetero.runtime.elastic.slice_copies): a lost rank's slices rebuilt from
its buddy's copy bitwise, and the launcher's word on which losses the copies cover. The launched
run that loses a ZeRO rank and goes on in-process is in tests/test_elastic.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hetero.runtime.elastic.slice_copies import SliceCopies, holder_of, uncovered, whole_state


@pytest.fixture
def one_rank_world():
    """A world of one rank (the copies' group is made in it; nothing is sent)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _rank0_of_two():
    """Rank 0's ZeRO optimizer over a Linear(5, 3) that ranks 0 and 1 hold: 18 elements, 9 a slice, so
    rank 1's slice is the weight's last 6 elements and the whole bias (it spans two tensors)."""
    from hetero.runtime.grads import Bucket
    from hetero.runtime.zero import ShardedAdamW

    torch.manual_seed(0)
    module = torch.nn.Linear(5, 3)
    sharded = ShardedAdamW(module, [Bucket(ranks=(0, 1), names=("weight", "bias"))], comm=None, rank=0,
                           tp_size=1, lr=1e-3, weight_decay=0.0)
    return module, sharded


def test_a_lost_ranks_slices_are_rebuilt_bitwise_from_the_copy_its_buddy_keeps(one_rank_world):
    module, sharded = _rank0_of_two()
    (shard,) = sharded.shards
    whole = {k: torch.randn(18) for k in ("param", "exp_avg", "exp_avg_sq")}   # the state after step 3
    with torch.no_grad():
        shard.master.copy_(whole["param"][:9])   # rank 0's own slice (a view of its parameters)
    sharded.optimizer.state[shard.master] = {"step": torch.tensor(3.0), "exp_avg": whole["exp_avg"][:9].clone(),
                                             "exp_avg_sq": whole["exp_avg_sq"][:9].clone()}
    copies = SliceCopies(sharded, rank=0, world=1, timeout_s=10)
    (link,) = copies.links
    assert (link.buddy, link.source) == (1, 1)   # a ring of two: each keeps the other's copy
    assert [set(b) for b in link.buffers] == [{"param", "exp_avg", "exp_avg_sq", "step"}] * 2   # made at once
    link.buffers[1] = {**{k: v[9:].clone() for k, v in whole.items()}, "step": torch.tensor([3.0])}
    link.steps[1] = 3.0
    link.buffers[0], link.steps[0] = {k: torch.full_like(v, float("nan")) for k, v in link.buffers[1].items()}, 2.0
    assert copies.report() == [["0,1:weight", [0, 1], True]]   # the copy of step 3, not the older one

    regions = {"weight": ((0, 3), (0, 5)), "bias": ((0, 3),)}
    out = whole_state(copies, module, regions, world_rank={0: 0}, survivors=[0])   # rank 1 lost
    for k, v in whole.items():
        assert torch.equal(out["weight"].tensors[k], v[:15].view(3, 5)), k
        assert torch.equal(out["bias"].tensors[k], v[15:18]), k
    assert float(out["weight"].step) == 3.0 and out["bias"].box == ((0, 3),)

    link.steps[1] = 2.0   # only copies older than the survivors' step: not held, and the launcher says so
    assert copies.report() == [["0,1:weight", [0, 1], False]]


def test_holder_of_a_slice_is_its_owner_else_its_buddy():
    assert holder_of((0, 2, 4), 1, {0, 2, 4}) == 2
    assert holder_of((0, 2, 4), 1, {0, 4}) == 4          # 2 lost: its buddy, the next rank of the ring
    assert holder_of((0, 2, 4), 2, {0, 2}) == 0          # the ring wraps around
    assert holder_of((0, 2, 4), 1, {0}) is None          # 2 and its buddy 4 both lost


def _checkin(step, *slices):
    return {"applied_step": step, "slices": [list(s) for s in slices]}


@pytest.mark.parametrize("checkins, lost, words", [
    ({0: _checkin(3, ("k", [0, 1], True))}, {1}, None),
    ({0: _checkin(3, ("k", [0, 1, 2], True)), 1: _checkin(3, ("k", [0, 1, 2], True))}, {2}, None),
    ({0: _checkin(3, ("k", [0, 1], False))}, {1}, "rank 0 holds no copy of lost rank 1's optimizer slices as of step 3"),
    ({0: _checkin(3, ("k", [0, 1, 2], True))}, {1, 2}, "rank 1 was lost together with rank 2"),
    ({0: _checkin(3, ("k", [0, 1, 2], True)), 1: _checkin(4, ("k", [0, 1, 2], True))}, {2},
     "different steps (rank 0: 3, rank 1: 4)"),
    ({0: {"applied_step": 3, "slices": None}}, {1}, "keep no copies"),
])
def test_the_launcher_goes_on_in_process_only_where_the_copies_cover_every_lost_slice(checkins, lost, words):
    got = uncovered(checkins, lost)
    assert got is None if words is None else words in got, got


def test_a_loss_the_copies_cannot_cover_ends_the_run_naming_why_and_the_fix():
    from types import SimpleNamespace

    from hetero.errors import HeteroError
    from hetero.runtime.elastic.policy import refuse_lost_slices

    why = uncovered({0: _checkin(3, ("k", [0, 1, 2], True))}, {1, 2})
    with pytest.raises(HeteroError, match="rank 1 was lost together with rank 2.*fix: a plan with zero_stage: 0"):
        refuse_lost_slices(SimpleNamespace(zero_stage=1), "rank 1 died", why)


def _shadow_worker(rank, world, withhold):
    """Two ZeRO-1 ranks over a Linear(7, 5) (40 elements, 20 a slice), trained 4 steps as the engine
    does (reduce, clip factor, AdamW, gather), the copies waited for before and started after each
    update, the rate changed between steps. Returns this rank's own slice state and its shadow of
    its peer's, both on the host."""
    import os

    from hetero.runtime.collectives import Collectives
    from hetero.runtime.elastic.slice_copies import WITHHOLD_ENV, SliceCopies
    from hetero.runtime.grads import Bucket, clip_coefficient, scaled_step, weighted_squares
    from hetero.runtime.zero import ShardedAdamW

    if withhold is not None:
        os.environ[WITHHOLD_ENV] = str(withhold)
    comm = Collectives.init(rank, world, 30.0)
    torch.manual_seed(0)
    module = torch.nn.Linear(7, 5)
    sharded = ShardedAdamW(module, [Bucket(ranks=(0, 1), names=("weight", "bias"))], comm=comm, rank=rank,
                           tp_size=1, lr=1e-2, weight_decay=0.1)
    (shard,) = sharded.shards
    copies = SliceCopies(sharded, rank, world, 30.0)
    copies.start()
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        sharded.bind_gradient_buffers()
        (module(torch.randn(3, 7, generator=gen)) ** 2).sum().mul(10.0).backward()
        owned = sharded.reduce_gradients()
        sq = torch.tensor([weighted_squares(owned)], dtype=torch.float64)
        comm.all_reduce(sq)
        sharded.coef = clip_coefficient(float(sq[0]) ** 0.5, 1.0)   # clipped: a factor below 1
        copies.wait()
        for g in sharded.optimizer.param_groups:
            g["lr"] = 1e-2 / (step + 1)
        scaled_step(sharded.optimizer, sharded.params(), sharded.coef)
        copies.start()
        sharded.gather_parameters()
        sharded.zero_grad()
    copies.wait()
    st = sharded.optimizer.state[shard.master]
    own = {"param": shard.master.detach().clone(), "exp_avg": st["exp_avg"].clone(),
           "exp_avg_sq": st["exp_avg_sq"].clone(), "step": float(st["step"])}
    (link,) = copies.links
    held = copies._copy_at(link, own["step"])
    shadow = None if held is None else {k: v.clone() for k, v in held.items()}
    return own, shadow, copies.shadows, sharded.coef, copies.report()


@pytest.mark.timeout(120)
def test_a_buddy_updates_a_shadow_of_its_peers_slice_bitwise_as_the_peer_does():
    """On host memory the buddy sends nothing after the first copy: the reduction leaves it its
    peer's slice of the summed gradient and it runs the same clipped AdamW on its shadow, which
    equals the peer's own slice bit for bit after every step (here 4, the rate changing)."""
    from helpers import spawn

    results = spawn(_shadow_worker, 2, args=(None,), timeout=100)
    for me, peer in ((0, 1), (1, 0)):
        own, _, _, _, _ = results[peer]
        _, shadow, shadows, coef, report = results[me]
        assert shadows and coef < 1.0 and report[0][2] is True
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(shadow[k], own[k]), (me, k)
        assert float(shadow["step"][0]) == own["step"] == 4.0


@pytest.mark.timeout(120)
def test_a_withheld_copy_leaves_its_buddy_without_a_shadow_and_the_report_says_so():
    """Rank 1 withholds its copies (as a rank lost before its first copy arrived): rank 0 keeps no
    shadow of it, then or later, and reports that it holds none; rank 1's shadow of rank 0 is
    kept as before, bit for bit."""
    from helpers import spawn

    results = spawn(_shadow_worker, 2, args=(1,), timeout=100)
    assert results[0][1] is None and results[0][4][0][2] is False
    own, shadow = results[0][0], results[1][1]
    assert all(torch.equal(shadow[k], own[k]) for k in ("param", "exp_avg", "exp_avg_sq"))
