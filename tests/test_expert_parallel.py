"""Expert parallelism: expert ranges, holder sets, the bytes of the exchanges, and an MoE layer whose
experts are spread unevenly over two emulated vendors computing what one device computes."""
import pytest
import torch

import hetero
from hetero.errors import HeteroError
from hetero.runtime.expert_parallel import (ExpertPlacement, exchange_bytes, expert_holders, split_experts)
from helpers import with_communicator

MODEL = {"name": "m", "architecture": "llama", "num_layers": 2, "hidden_size": 16,
         "num_attention_heads": 2, "vocab_size": 32, "seq_length": 8,
         "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 24, "shared_expert_ffn_hidden_size": 8}}


def test_expert_ranges_even_uneven_and_errors():
    assert split_experts(8, 2) == [(0, 4), (4, 8)]
    assert split_experts(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert split_experts(8, 2, [6, 2]) == [(0, 6), (6, 8)]
    assert split_experts(8, 2, [8, 0]) == [(0, 8), (8, 8)]   # a rank may hold none (it still routes)
    for bad in ([7, 2], [9, -1], [8]):
        with pytest.raises(HeteroError, match="expert_parallel.experts"):
            split_experts(8, 2, bad)


def test_expert_holder_sets_are_the_same_place_in_every_group():
    placement = ExpertPlacement({0: [(0, 1), (2, 3)]}, ((0, 6), (6, 8)))
    holders = {"layers.0.mlp.experts.5.w1.weight": (0, 1, 2, 3), "layers.0.mlp.experts.7.w2.weight": (0, 1, 2, 3),
               "layers.0.mlp.router.weight": (0, 1, 2, 3)}
    out = expert_holders(holders, placement)
    assert out == {"layers.0.mlp.experts.5.w1.weight": (0, 2), "layers.0.mlp.experts.7.w2.weight": (1, 3),
                   "layers.0.mlp.router.weight": (0, 1, 2, 3)}
    assert placement.held(3) == {0: 2} and placement.experts_of(0, 2) == (0, 6)


def test_exchange_bytes_matrix():
    counts = torch.tensor([[1, 2, 0, 3], [4, 0, 1, 1]])   # rank i's assignments per expert
    b = exchange_bytes(counts, [(0, 3), (3, 4)], row_bytes=10)
    # rank 0 sends 3 rows to rank 1 (expert 3) and gets back their outputs; rank 1 sends 5 rows to rank 0
    assert b.tolist() == [[0, 8 * 1 + 10 * (3 + 5)], [8 * 3 + 10 * (5 + 3), 0]]


PP2_DP2 = [{"micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 2]}, {"group": "fast", "layers": [2, 4]}]},
           {"micro_batches": 2, "stages": [{"group": "slow", "layers": [0, 2]}, {"group": "slow", "layers": [2, 4]}]}]


def _run_layout(pipelines, **plan_fields):
    from helpers import CLUSTER, tiny_model

    from hetero.layout import build_layout

    model = hetero.load_model(tiny_model("llama", moe={"num_experts": 8, "top_k": 2}))
    plan = hetero.load_plan({"global_batch_size": 4, "micro_batch_size": 1, "pipelines": pipelines,
                             "expert_parallel": {"degree": 2, "experts": [6, 2]}, **plan_fields})
    return model, plan, build_layout(hetero.load_cluster(CLUSTER), plan)


def test_the_run_layout_places_experts_and_their_holders():
    from hetero.runtime.parallel import ParallelLayout
    from hetero.runtime.reshard.space import ParameterSpace

    model, plan, layout = _run_layout(PP2_DP2)
    par = ParallelLayout.build(model, plan, layout, 0)
    ep = par.experts
    first = {r.rank for r in layout.ranks if r.stage == 0}
    assert len(ep.groups[0]) == 1 and set(ep.groups[0][0]) == first   # stage 0 of both pipelines
    a, b = ep.groups[0][0]
    assert ep.experts_of(0, a) == (0, 6) and ep.experts_of(0, b) == (6, 8)
    assert par.holders["layers.0.mlp.experts.5.w1.weight"] == (a,)     # one copy: nothing to sum
    assert par.holders["layers.0.mlp.router.weight"] == tuple(sorted((a, b)))
    assert tuple(sorted((a, b))) in par.group_sets   # a process group for the exchanges
    space = ParameterSpace(model)
    for info in layout.ranks:   # the virtual parameter space sees the same experts on each rank
        regions = space.rank_regions(plan, info)
        lo, hi = ep.experts_of(info.layers[0], info.rank)
        held = {int(n.split(".")[4]) for n in regions if ".experts." in n}
        assert held == set(range(lo, hi)), (info.rank, held)


def test_a_stage_rebuilt_by_a_reshard_keeps_its_own_experts():
    from hetero.runtime.model import build_stage
    from hetero.runtime.reshard.space import ParameterSpace
    from hetero.runtime.reshard.transfer import TensorState, rebuild_stage

    model, plan, layout = _run_layout(PP2_DP2)
    info = next(r for r in layout.ranks if r.pipeline == 1 and r.stage == 1)   # the second group place: 6, 7
    full = dict(build_stage(model, info.layers, False, True, 0).named_parameters())
    regions = ParameterSpace(model).rank_regions(plan, info)
    state = {n: TensorState(box, {"param": full[n].detach().clone(), "exp_avg": torch.zeros_like(full[n]),
                                  "exp_avg_sq": torch.zeros_like(full[n])}, None) for n, box in regions.items()}
    module, _ = rebuild_stage(model, plan, info, state)
    names = dict(module.named_parameters())
    assert set(names) == set(regions)
    assert {int(n.split(".")[4]) for n in names if ".experts." in n} == {6, 7}
    assert all(torch.equal(p, full[n]) for n, p in names.items())


def test_an_expert_parallel_stage_allocates_its_own_experts_with_the_one_device_values():
    from hetero.runtime.expert_parallel import build_expert_stage
    from hetero.runtime.model import build_stage

    model, plan, layout = _run_layout(PP2_DP2)
    model = hetero.load_model({**model.to_dict(), "moe": {**model.to_dict()["moe"], "balance": "bias"}})
    info = next(r for r in layout.ranks if r.pipeline == 0 and r.stage == 0)   # experts 0..5 of layers 0, 1
    whole = build_stage(model, info.layers, True, False, 7)
    mine = build_expert_stage(model, plan, info, 7)
    params = dict(mine.named_parameters())
    assert {int(n.split(".")[4]) for n in params if ".experts." in n} == set(range(6))
    assert all(torch.equal(p, whole.get_parameter(n)) for n, p in params.items())
    buffers = dict(mine.named_buffers())
    assert {n.rsplit(".", 1)[1] for n in buffers} == {"cos", "sin", "expert_bias"}
    assert all(torch.equal(b, whole.get_buffer(n)) for n, b in buffers.items())
    assert set(mine.state_dict()) == {n for n in whole.state_dict() if ".experts." not in n or n in params}


@pytest.mark.parametrize("pipelines,fields,fragment", [
    (PP2_DP2, {"zero_stage": 1}, "expert_parallel with zero_stage 1 is not supported"),
    ([{"micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 4]}]},
      {"micro_batches": 1, "micro_batch_size": 2, "stages": [{"group": "slow", "layers": [0, 4]}]}], {},
     "run different stages or micro-batches"),
])
def test_what_expert_parallelism_does_not_run_is_refused(pipelines, fields, fragment):
    from hetero.runtime.parallel import ParallelLayout

    model, plan, layout = _run_layout(pipelines, **fields)
    with pytest.raises(HeteroError, match=fragment):
        ParallelLayout.build(model, plan, layout, 0)


# ----------------------------------------------------------------------------- the communicator's all-to-all
def _splits(world):
    """Rows rank i sends rank j: uneven, some empty (i == j + 1 sends none)."""
    return [[0 if i == (j + 1) % world else 1 + (3 * i + j) % 4 for j in range(world)] for i in range(world)]


def _all_to_all_rank(comm):
    world, rank = comm.world_size, comm.rank
    sizes = _splits(world)
    rows = torch.cat([torch.full((sizes[rank][j], 3), 100.0 * rank + j) for j in range(world)])
    out = torch.empty(sum(sizes[i][rank] for i in range(world)), 3)
    comm.stats.reset()
    comm.all_to_all_single(out, rows, [sizes[i][rank] for i in range(world)], sizes[rank])
    return {"out": out, "stats": comm.stats.to_dict(), "vendor": comm.vendor}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("vendors", [["emu-a", "emu-a", "emu-a"], ["emu-a", "emu-b", "emu-a"]], ids=["flat", "2+1"])
def test_all_to_all_single_within_and_across_vendors(vendors):
    """Uneven rows (some none) to every rank: each gets every rank's rows for it in rank order; the bytes
    sent to another rank are recorded on the vendor library's path within a vendor, on the bridge across."""
    results = with_communicator(_all_to_all_rank, vendors, timeout=100)
    sizes = _splits(len(vendors))
    for rank, r in enumerate(results):
        want = torch.cat([torch.full((sizes[i][rank], 3), 100.0 * i + rank) for i in range(len(vendors))])
        assert torch.equal(r["out"], want)
        sent = {j: sizes[rank][j] * 3 * 4 for j in range(len(vendors)) if j != rank}
        assert r["stats"]["bridge_bytes"] == sum(b for j, b in sent.items() if vendors[j] != vendors[rank])
        assert sum(r["stats"]["vendor_bytes"].values()) == sum(b for j, b in sent.items() if vendors[j] == vendors[rank])


# ----------------------------------------------------------------------------- two emulated vendors
def _layer(spec):
    from hetero.runtime.model import MLP
    from hetero.runtime.moe import MoEMLP

    torch.manual_seed(0)
    m = MoEMLP(spec, MLP)
    m.expert_compute = "loop"
    m.aux_scale = 0.5 * spec.moe.aux_loss_coef
    return m


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(3, 5, 16, generator=g).requires_grad_() for _ in range(2)]


def _ep_rank(comm, model, experts):
    """One rank: its experts only, two micro-batches of its own tokens; returns its output, the sums the
    data-parallel step would make (router and shared expert over both ranks) and its experts' grads."""
    from hetero.runtime.expert_parallel import ExpertGroup, shard_moe

    spec = hetero.load_model(model)
    m = _layer(spec)
    group = comm.new_group([0, 1])
    ranges = split_experts(8, 2, experts)
    eg = ExpertGroup(lambda o, i, os, ins: comm.all_to_all_single(o, i, os, ins, group=group), ranges, comm.rank)
    shard_moe(m, eg)
    comm.stats.reset()
    outs, counts, inputs = [], [], _inputs(comm.rank)
    for x in inputs:
        y = m(x)
        outs.append(y.detach())
        (y * y).sum().backward()
        index, _, _ = m.route(x.reshape(-1, 16))
        counts.append(torch.bincount(index.reshape(-1), minlength=8))
    sent = comm.stats.to_dict()
    grads = {}
    for name, p in m.named_parameters():
        g = p.grad.clone()
        if not name.startswith("experts."):   # replicated: the data-parallel sum
            comm.all_reduce(g)
        grads[name] = g
    aux = list(m.aux_losses)
    balanced = _balanced_bytes(comm, m)
    return {"balanced": balanced, "outs": outs, "grads": grads, "input_grads": [x.grad for x in inputs], "aux": aux, "sent": sent, "counts": counts,
            "names": sorted(n for n, _ in m.named_parameters() if n.startswith("experts."))}


def _balanced_bytes(comm, m) -> int:
    """Bridge bytes one forward and backward sends when every expert gets the same assignments (token t
    to experts 2t, 2t + 1 mod 8: 4 each of 16 tokens), the routing the predictor charges."""
    def route(x):
        n = x.shape[0]
        index = (torch.arange(2 * n) % 8).view(n, 2)
        return index, torch.full((n, 2), 0.5), torch.full((n, 8), 1 / 8)

    m.route, aux_scale = route, m.aux_scale
    m.aux_scale = 0.0
    comm.stats.reset()
    x = torch.randn(4, 4, 16, requires_grad=True)
    m(x).sum().backward()
    m.zero_grad()
    del m.route
    m.aux_scale = aux_scale
    return comm.stats.to_dict()["bridge_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_uneven_experts_across_two_vendors_match_one_device():
    model = {**MODEL, "moe": {**MODEL["moe"], "balance": "aux", "aux_loss_coef": 0.02}}
    results = with_communicator(_ep_rank, ["emu-a", "emu-b"], args=(model, [6, 2]), timeout=100)
    spec = hetero.load_model(model)
    ref = _layer(spec)
    ref_outs, ref_inputs = [], _inputs(0) + _inputs(1)
    for x in ref_inputs:
        y = ref(x)
        ref_outs.append(y.detach())
        (y * y).sum().backward()
    assert [r["names"][0].split(".")[1] for r in results] == ["0", "6"]   # experts keep their model-wide names
    assert {n.split(".")[1] for n in results[0]["names"]} == {str(e) for e in range(6)}
    assert {n.split(".")[1] for n in results[1]["names"]} == {"6", "7"}
    torch.testing.assert_close(torch.cat(results[0]["outs"] + results[1]["outs"]), torch.cat(ref_outs),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0]["input_grads"] + results[1]["input_grads"],
                               [x.grad for x in ref_inputs], rtol=1e-5, atol=1e-6)
    assert results[0]["aux"] + results[1]["aux"] == pytest.approx(ref.aux_losses, rel=1e-6)
    want = dict(ref.named_parameters())
    for r in results:
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, want[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    # the predictor's all-to-all for balanced routing: rank i's dispatch to j, and j's combine back to i,
    # each again in the backward; plus the expert counts (8 bytes per expert of the receiver)
    from predictor.moe import all_to_all_bytes

    charged = all_to_all_bytes(hetero.load_model(model), [16, 16], [6, 2])
    for rank, other, n_other in ((0, 1, 2), (1, 0, 6)):
        assert results[rank]["balanced"] == 2 * (charged[rank][other] + charged[other][rank]) + 8 * n_other
    # what the communicator recorded sending = the bytes the exchange counts, forward and backward
    for rank, r in enumerate(results):
        counts = [torch.stack([results[0]["counts"][mb], results[1]["counts"][mb]]) for mb in range(2)]
        per_mb = [exchange_bytes(c, split_experts(8, 2, [6, 2]), row_bytes=16 * 4) for c in counts]
        rows = [exchange_bytes(c, split_experts(8, 2, [6, 2]), row_bytes=16 * 4)
                - exchange_bytes(c, split_experts(8, 2, [6, 2]), row_bytes=0) for c in counts]
        want_bytes = sum(int(b[rank].sum()) + int(d[rank].sum()) for b, d in zip(per_mb, rows))   # + backward rows
        sent = r["sent"]
        assert sent["bridge_bytes"] == want_bytes, (rank, sent["bridge_bytes"], want_bytes)
        assert sent["vendor_bytes"] == {}


def test_experts_of_a_rank_that_receives_no_rows_get_zero_gradients():
    """The second place of a group of two, every token routed to the first place's experts: its experts
    receive no rows, yet each gets a gradient of zeros, as one device gives an expert without tokens
    (the peer is simulated: it sends nothing, and zeros for the rows its experts computed)."""
    from hetero.runtime.expert_parallel import ExpertGroup, shard_moe

    def exchange(out, inp, out_splits, in_splits):   # only this rank's own block moves (place 1)
        out.zero_()
        out.narrow(0, out_splits[0], out_splits[1]).copy_(inp.narrow(0, in_splits[0], in_splits[1]))
        return out

    m = _layer(hetero.load_model(MODEL))
    m.route = lambda x: ((torch.arange(2 * x.shape[0]) % 6).view(-1, 2), torch.full((x.shape[0], 2), 0.5),
                         torch.full((x.shape[0], 8), 1 / 8))
    shard_moe(m, ExpertGroup(exchange, split_experts(8, 2, [6, 2]), 1))
    (m(_inputs(1)[0]) ** 2).sum().backward()
    grads = {n: p.grad for n, p in m.experts.named_parameters()}
    assert sorted({n.split(".")[0] for n in grads}) == ["6", "7"]
    assert all(g is not None and not g.any() for g in grads.values()), grads


def test_an_emulated_slower_device_reaches_each_exchange_late():
    """slowdown 2: 50 ms of compute, an exchange (30 ms), 50 ms more. The exchange starts after the
    first compute's slowed 100 ms (not at 50 ms, as when the whole wait came at the end), and the end
    waits for the second compute only: 100 + 30 + 100 ms in all, the exchange never slowed."""
    import time

    from hetero.runtime.expert_parallel import paced
    from hetero.runtime.pipeline import timed

    started = []

    def exchange(out, inp, out_splits, in_splits):
        started.append(time.perf_counter())
        time.sleep(0.03)
        return out

    def forward():
        time.sleep(0.05)
        paced(exchange)(None, None, [], [])
        time.sleep(0.05)

    t0 = time.perf_counter()
    _, _, seconds = timed(forward, 2.0)
    assert started[0] - t0 >= 0.1
    assert 0.23 <= seconds < 0.27


def _no_tokens_rank(comm, model):
    """Every token routed to experts 0..5 (rank 0's): rank 1 receives no rows, yet runs the backward's
    exchanges as rank 0 does; returns the input gradients."""
    from hetero.runtime.expert_parallel import ExpertGroup, shard_moe

    m = _layer(hetero.load_model(model))
    m.aux_scale = 0.0

    def route(x):
        n = x.shape[0]
        return (torch.arange(2 * n) % 6).view(n, 2), torch.full((n, 2), 0.5), torch.full((n, 8), 1 / 8)

    m.route = route
    group = comm.new_group([0, 1])
    shard_moe(m, ExpertGroup(lambda o, i, os, ins: comm.all_to_all_single(o, i, os, ins, group=group),
                             split_experts(8, 2, [6, 2]), comm.rank))
    x = _inputs(comm.rank)[0]
    (m(x) ** 2).sum().backward()
    return x.grad


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_whose_experts_get_no_tokens_still_runs_the_backward_exchanges():
    results = with_communicator(_no_tokens_rank, ["emu-a", "emu-b"], args=(MODEL,), timeout=100)
    ref = _layer(hetero.load_model(MODEL))
    ref.aux_scale = 0.0
    ref.route = lambda x: ((torch.arange(2 * x.shape[0]) % 6).view(-1, 2), torch.full((x.shape[0], 2), 0.5),
                           torch.full((x.shape[0], 8), 1 / 8))
    for rank, got in enumerate(results):
        x = _inputs(rank)[0]
        (ref(x) ** 2).sum().backward()
        torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- launches
EP_MODEL = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32, "aux_loss_coef": 0.1}
DP2 = [{"micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 4]}]},
       {"micro_batches": 2, "stages": [{"group": "slow", "layers": [0, 4]}]}]
LR_MOE = 1e-3   # as the MoE launch test: at 1e-2 the replicas' float order drifts past 1e-3 by step 4


def _launch_ep(tmp_path, pipelines, experts, *extra):
    from helpers import launch_summary, tiny_model

    plan = {"global_batch_size": 4, "micro_batch_size": 1, "pipelines": pipelines,
            "expert_parallel": {"degree": 2, "experts": experts}}
    return launch_summary(tmp_path, tiny_model("llama", moe=EP_MODEL), plan, "--lr", str(LR_MOE), *extra)


def _reference_ep():
    from helpers import STEPS, tiny_model

    from hetero.runtime.reference import reference_run

    steps: list = []
    losses, norms = reference_run(tiny_model("llama", moe=EP_MODEL), 0, STEPS, 4, chunk=1, lr=LR_MOE, moe_steps=steps)
    return losses, norms, [aux for aux, _ in steps]


def _own_experts_state_only(summary):
    """Each rank keeps AdamW state for its own experts only: two fp32 moments and a 4-byte step for each
    of an expert's 3 tensors (3 x 64 x 32 values); what is left is the same on ranks running the same layers."""
    per_expert = 3 * (2 * 4 * 64 * 32 + 4)
    rest = {}
    for r in summary["ranks"]:
        rest.setdefault(tuple(r["experts"]), set()).add(r["optimizer_state_bytes"] - per_expert * sum(r["experts"].values()))
    assert all(len(v) == 1 for v in rest.values()), rest


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_expert_parallel_launch_matches_the_single_process_reference(tmp_path):
    """Two replicas on two vendors, 6 and 2 of 8 experts (aux loss on): the losses, gradient norms and aux
    terms of each step equal the single-process run's with every expert."""
    summary = _launch_ep(tmp_path, DP2, [6, 2])
    losses, norms, aux = _reference_ep()
    assert summary["losses"] == pytest.approx(losses, rel=1e-3)
    assert summary["grad_norms"] == pytest.approx(norms, rel=1e-3)
    assert summary["moe_aux_losses"] == pytest.approx(aux, rel=1e-3)
    assert {r["rank"]: r["experts"] for r in summary["ranks"]} == {0: {str(i): 6 for i in range(4)},
                                                                   1: {str(i): 2 for i in range(4)}}
    _own_experts_state_only(summary)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_expert_parallel_checkpoint_resumes_in_pipelines_with_other_expert_counts(tmp_path):
    """2 steps as two replicas with 6 and 2 experts, saved; 3 more as two 2-stage 1F1B pipelines per vendor
    with 4 and 4, loaded: every expert moves through the checkpoint, and the 5 steps are the reference's."""
    from helpers import launching

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    ckpt = str(tmp_path / "ckpt")
    pp2_dp2 = [{"micro_batches": 2, "stages": [{"group": g, "layers": [0, 2]}, {"group": g, "layers": [2, 4]}]}
               for g in ("fast", "slow")]
    old = launching.STEPS
    try:
        launching.STEPS = 2
        first = _launch_ep(a, DP2, [6, 2], "--save", ckpt)
        launching.STEPS = 3
        second = _launch_ep(b, pp2_dp2, [4, 4], "--load", ckpt)
    finally:
        launching.STEPS = old
    losses, norms, aux = _reference_ep()
    assert first["losses"] + second["losses"] == pytest.approx(losses, rel=1e-3)
    assert first["grad_norms"] + second["grad_norms"] == pytest.approx(norms, rel=1e-3)
    assert first["moe_aux_losses"] + second["moe_aux_losses"] == pytest.approx(aux, rel=1e-3)
    assert sorted(tuple(r["experts"].items()) for r in second["ranks"]) == \
        sorted([(("0", 4), ("1", 4))] * 2 + [(("2", 4), ("3", 4))] * 2)
    _own_experts_state_only(second)
