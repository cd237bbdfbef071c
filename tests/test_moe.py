"""Mixture of experts: the model file's ``moe:`` block, the MoE MLP (routing, capacity, balancing)
and its place in the model."""
import pytest

import hetero
from hetero.specs.errors import SpecError

MODEL = {"name": "m", "architecture": "llama", "num_layers": 4, "hidden_size": 32,
         "num_attention_heads": 4, "vocab_size": 64, "seq_length": 16}


def moe_model(**moe):
    return hetero.load_model({**MODEL, "moe": {"num_experts": 4, "top_k": 2, **moe}})


def test_moe_block_defaults_and_round_trip(tmp_path):
    m = moe_model()
    assert m.moe.expert_ffn_hidden_size == m.ffn_hidden_size   # default: the dense width
    assert (m.moe.router, m.moe.balance, m.moe.capacity_factor, m.moe.norm_topk_prob) == ("softmax", "aux", None, True)
    assert m.moe_layers() == (0, 1, 2, 3)
    m.save(tmp_path / "m.yaml")
    assert hetero.load_model(tmp_path / "m.yaml") == m
    assert hetero.load_model(MODEL).moe is None and hetero.load_model(MODEL).moe_layers() == ()


def test_which_layers_are_moe():
    assert moe_model(every=2).moe_layers() == (1, 3)           # (l + 1) % every == 0, as Qwen2-MoE
    assert moe_model(dense_layers=[0]).moe_layers() == (1, 2, 3)
    assert moe_model(every=2, dense_layers=[3]).moe_layers() == (1,)


def test_moe_parameter_count():
    m = moe_model(expert_ffn_hidden_size=24, shared_expert_ffn_hidden_size=40, dense_layers=[0])
    h = 32
    attn_norms = m.params_per_layer() - 3 * h * m.ffn_hidden_size
    moe_layer = attn_norms + h * 4 + 4 * 3 * h * 24 + 3 * h * 40 + h
    assert m.moe_layer_params() == moe_layer
    assert m.total_params() == m.params_per_layer() + 3 * moe_layer + m.embedding_params() + m.head_params()


@pytest.mark.parametrize("moe,fragment", [
    ({"top_k": 5}, "moe.top_k: must be in [1, num_experts (4)], got 5"),
    ({"routr": "sigmoid"}, "moe.routr: unknown field 'routr' (fix: did you mean 'router'?)"),
    ({"router": "sigmod"}, "moe.router: 'sigmod' is not one of 'softmax', 'sigmoid' (fix: did you mean 'sigmoid'?)"),
    ({"balance": "bias2"}, "(fix: did you mean 'bias'?)"),
    ({"capacity_factor": 0}, "moe.capacity_factor: must be positive or null, got 0"),
    ({"every": 0}, "moe.every: must be >= 1, got 0"),
    ({"dense_layers": [0, 1, 2, 3]}, "moe: no layer is an MoE layer"),
    ({"dense_layers": [4]}, "moe.dense_layers: layers [4] are outside 0..3"),
    ({"num_experts": 0, "top_k": 1}, "moe.num_experts: must be >= 1, got 0"),
    ({"aux_loss_coef": -1}, "moe.aux_loss_coef: must be >= 0"),
])
def test_moe_block_errors_name_field_and_fix(moe, fragment):
    with pytest.raises(SpecError) as e:
        moe_model(**moe)
    assert any(fragment in str(p) and "(fix: " in str(p) for p in e.value.problems), e.value.problems


# ---------------------------------------------------------------------------- the MoE MLP

@pytest.fixture
def one_thread():
    """Tiny matrices: a second thread only waits for a core the other tests share."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def moe_mlp(seed: int = 0, architecture: str = "llama", **moe):
    """One MoE MLP of width 16, 4 experts of width 8, top-2 (``moe`` replaces fields)."""
    import torch

    from hetero.runtime.model import MLP
    from hetero.runtime.moe import MoEMLP

    spec = hetero.load_model({**MODEL, "architecture": architecture, "hidden_size": 16, "num_layers": 1,
                              "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 8, **moe}})
    torch.manual_seed(seed)
    m = MoEMLP(spec, MLP)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    return spec, m


def in_a_stage(m):
    """``m`` as layer 0's MLP of a module, the way finish_step finds it (``layers.0.mlp``)."""
    from torch import nn

    block = nn.Module()
    block.mlp = m
    stage = nn.Module()
    stage.layers = nn.ModuleDict({"0": block})
    return stage


def test_capacity_drops_the_later_tokens_and_counts_them(one_thread):
    """capacity_factor 0.5 of 16 tokens x top-2 over 4 experts: 4 assignments per expert. The output is
    each token's kept experts' weighted outputs, the kept ones the first 4 per expert in token order,
    computed here token by token; the same input drops the same assignments again."""
    import torch

    _, m = moe_mlp(capacity_factor=0.5)
    with torch.no_grad():
        m.router.weight[0] += 1.0   # a skewed router: most tokens want expert 0
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)) + 0.5
    index, weights, _ = m.route(x.reshape(-1, 16))
    counts = torch.bincount(index.reshape(-1), minlength=4).tolist()
    assert max(counts) > 4   # the case drops something
    taken = [0] * 4
    expected = torch.zeros(16, 16)
    for t in range(16):
        for j in range(2):
            e = int(index[t, j])
            if taken[e] < 4:
                taken[e] += 1
                expected[t] += weights[t, j] * m.experts[e](x.reshape(-1, 16)[t])
    out = m(x)
    torch.testing.assert_close(out.reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)
    assert m.dropped == sum(max(0, c - 4) for c in counts) > 0
    first = m.dropped
    assert torch.equal(m(x), out) and m.dropped == 2 * first
    m.eval()   # evaluation and generation route dropless
    with torch.no_grad():
        dropless = torch.stack([sum(weights[t, j] * m.experts[int(index[t, j])](x.reshape(-1, 16)[t])
                                    for j in range(2)) for t in range(16)])
        torch.testing.assert_close(m(x).reshape(-1, 16), dropless, rtol=1e-5, atol=1e-6)


def test_aux_loss_by_hand_and_its_gradient_reaches_the_router():
    """num_experts x sum_i f_i P_i with f_i the fraction of tokens routed to i and P_i its mean
    probability, computed with loops; the gradient the layer's backward adds equals that of
    coef x aux added to the loss."""
    import torch

    from hetero.runtime.moe import set_aux_scale

    spec, m = moe_mlp(aux_loss_coef=0.1)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(2))
    logits = x @ m.router.weight.detach().t()
    probs = [[float(torch.exp(v) / torch.exp(row).sum()) for v in row] for row in logits]
    top = [sorted(range(4), key=lambda e: -p[e])[:2] for p in probs]
    f = [sum(e in chosen for chosen in top) / 12 for e in range(4)]
    P = [sum(p[e] for p in probs) / 12 for e in range(4)]
    by_hand = 4 * sum(f[e] * P[e] for e in range(4))
    index, _, router_probs = m.route(x)
    assert float(m.aux_loss(index, router_probs).detach()) == pytest.approx(by_hand, rel=1e-6)

    set_aux_scale(in_a_stage(m), 1.0)   # aux_scale = coef
    m(x).sum().backward()
    injected = m.router.weight.grad.clone()
    assert m.aux_losses == [pytest.approx(by_hand, rel=1e-6)]
    m.zero_grad()
    m.aux_scale = 0.0
    out = m(x)
    index, _, router_probs = m.route(x)
    (out.sum() + 0.1 * m.aux_loss(index, router_probs)).backward()
    torch.testing.assert_close(injected, m.router.weight.grad)


def _balance_run(balance: str) -> tuple[float, float]:
    """A deliberately skewed router (experts 0 and 1 favoured), 80 training steps of 1024 tokens with
    plain SGD; returns max / mean expert load of the first step and of the last 10 steps together."""
    import torch

    spec, m = moe_mlp(balance=balance, bias_update_rate=0.004, num_experts=8)
    with torch.no_grad():
        m.router.weight.normal_(0.0, 0.1)
        m.router.weight[0] += 0.15
        m.router.weight[1] += 0.1
    stage, data = in_a_stage(m), torch.Generator().manual_seed(3)
    from hetero.runtime.moe import finish_step

    loads = []
    for _ in range(80):
        x = torch.randn(1024, 16, generator=data) + 0.5
        m.zero_grad()
        m(x).pow(2).mean().backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.01 * p.grad
        loads.append(m.load.float())
        finish_step(stage, spec)
    window = sum(loads[-10:])
    return float(loads[0].max() / loads[0].mean()), float(window.max() / window.mean())


def test_bias_balancing_evens_a_skewed_router(one_thread):
    """Aux-loss-free balancing (sign updates of the expert biases) takes the skewed router from over 3x
    the mean load on its busiest expert to below 1.2; without it the skew stays."""
    start, end = _balance_run("bias")
    assert start > 3.0 and end < 1.2, (start, end)
    start, end = _balance_run("none")
    assert start > 3.0 and end > 3.0, (start, end)


@pytest.mark.parametrize("architecture", ["llama", "gpt"])
def test_grouped_gemm_equals_the_loop_over_experts(architecture):
    """torch._grouped_mm (the grouped-GEMM path; torch has a CPU fallback) gives the loop's outputs and
    gradients: SwiGLU experts (llama), gelu experts with biases (gpt)."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    _, m = moe_mlp(architecture=architecture)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(4))
    results = []
    for mode in ("loop", "grouped"):
        m.expert_compute = mode
        m.zero_grad()
        out = m(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for name, g in results[0][1].items():
        torch.testing.assert_close(g, results[1][1][name], rtol=1e-5, atol=1e-6)


def test_the_cpu_backend_loops_over_experts():
    import torch

    from hetero.runtime.moe import uses_grouped_gemm

    assert uses_grouped_gemm(torch.device("cpu"), torch.bfloat16) is False
    assert uses_grouped_gemm(torch.device("cpu"), torch.float32) is False


def test_parameter_names_give_every_expert_its_own_tensor():
    from hetero.runtime.model import stage_param_shapes

    spec = moe_model(every=2, shared_expert_ffn_hidden_size=8, expert_ffn_hidden_size=24)
    shapes = stage_param_shapes(spec, (0, 4), True, True)
    assert "layers.0.mlp.w1.weight" in shapes and "layers.1.mlp.w1.weight" not in shapes
    assert shapes["layers.1.mlp.router.weight"] == (4, 32)
    assert shapes["layers.3.mlp.experts.3.w2.weight"] == (32, 24)
    assert shapes["layers.1.mlp.shared_expert.w1.weight"] == (8, 32)
    assert shapes["layers.1.mlp.shared_expert_gate.weight"] == (1, 32)
    assert sum(n.startswith("layers.1.mlp.experts.") for n in shapes) == 4 * 3


def test_tensor_parallel_moe_layers_are_refused():
    from hetero.errors import HeteroError
    from hetero.runtime.model import apply_tensor_parallel, build_stage

    stage = build_stage(moe_model(), (0, 1), True, False, 0)
    with pytest.raises(HeteroError, match="tensor parallelism .* of mixture-of-experts layers is not supported"):
        apply_tensor_parallel(stage, mesh=None)


def test_a_launch_refuses_what_the_runtime_does_not_run_for_moe():
    """Before any process starts: tp on MoE layers, the DeepSpeed engine, expert parallelism with ZeRO."""
    from types import SimpleNamespace

    from hetero.errors import HeteroError
    from hetero.runtime.moe_checks import check_moe_run

    spec = moe_model(dense_layers=[0, 1])
    stages = [SimpleNamespace(layers=(0, 2), tp=2), SimpleNamespace(layers=(2, 4), tp=1)]
    plan = SimpleNamespace(pipelines=[SimpleNamespace(stages=stages)], expert_parallel=None, zero_stage=0)
    check_moe_run(plan, spec, "native")   # tp 2 on the dense layers alone
    stages[1].tp = 2
    with pytest.raises(HeteroError, match=r"pipelines\[0\]\.stages\[1\]: tp 2 with MoE layers \[2, 3\]"):
        check_moe_run(plan, spec, "native")
    stages[1].tp = 1
    with pytest.raises(HeteroError, match="--engine deepspeed: model m is a mixture of experts"):
        check_moe_run(plan, spec, "deepspeed")
    plan.expert_parallel, plan.zero_stage = SimpleNamespace(degree=2, experts=None), 0
    check_moe_run(plan, spec, "native")
    plan.zero_stage = 1
    with pytest.raises(HeteroError, match="expert_parallel with zero_stage 1 is not supported"):
        check_moe_run(plan, spec, "native")


def test_an_expert_that_gets_no_token_has_a_zero_gradient(one_thread):
    """Every token routed to experts 0 and 1: experts 2 and 3 still get a gradient, of zeros, so one
    device's AdamW moves them on their moments as a data-parallel run does (its gradient sum fills a
    missing gradient with zeros); the grouped GEMM gives every expert one too."""
    import torch

    for compute in ("loop", "grouped"):
        _, m = moe_mlp()
        m.expert_compute = compute
        m.route = lambda x: (torch.arange(2 * x.shape[0]).view(-1, 2) % 2, torch.full((x.shape[0], 2), 0.5),
                             torch.full((x.shape[0], 4), 0.25))
        (m(torch.randn(6, 16, generator=torch.Generator().manual_seed(1))) ** 2).sum().backward()
        for e, expert in enumerate(m.experts):
            for name, p in expert.named_parameters():
                assert p.grad is not None, f"{compute}: experts.{e}.{name} has no gradient"
                assert bool(p.grad.abs().sum() > 0) == (e < 2), f"{compute}: experts.{e}.{name}"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_gives_the_same_gradients_and_records_each_forward_once(mode):
    """Full recomputation runs each MoE forward again inside the backward: the gradients (aux term
    included) equal those without, and the aux terms and drops are counted once."""
    import torch

    from hetero.runtime.model import build_stage, loss_fn
    from hetero.runtime.moe import finish_step, set_aux_scale

    spec = moe_model(capacity_factor=1.0, aux_loss_coef=0.1)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    for recompute in ("none", mode):
        stage = build_stage(spec, (0, 4), True, True, 0)
        stage.set_recompute(recompute)
        set_aux_scale(stage, 1.0)
        loss_fn(stage(x), x).backward()
        runs.append(({n: p.grad for n, p in stage.named_parameters()}, finish_step(stage, spec)))
    (plain, plain_stats), (again, stats) = runs
    assert stats == plain_stats and stats[1] > 0
    for name, g in plain.items():
        torch.testing.assert_close(again[name], g, rtol=0, atol=0)


def test_a_checkpoint_keeps_the_expert_biases(tmp_path):
    """balance: bias: the biases the steps have moved are saved and loaded with the weights."""
    import warnings

    import torch

    from hetero.runtime.checkpoint import load_checkpoint, save_checkpoint
    from hetero.runtime.grads import make_optimizer
    from hetero.runtime.model import build_stage

    spec = moe_model(balance="bias", every=2)
    saved, loaded = build_stage(spec, (0, 4), True, True, 0), build_stage(spec, (0, 4), True, True, 0)
    for name, b in saved.named_buffers():
        if name.endswith("expert_bias"):
            b.copy_(torch.arange(4.0) * (1 + int(name.split(".")[1])))
    holders = {name: [0] for name, _ in saved.named_parameters()}
    with warnings.catch_warnings():   # no process group: torch says it saves and loads as one process
        warnings.simplefilter("ignore")
        save_checkpoint(str(tmp_path / "ckpt"), saved, make_optimizer(saved.parameters(), 1e-3, 0.0), holders, 0, 1)
        load_checkpoint(str(tmp_path / "ckpt"), loaded, None, spec.num_layers)
    biases = {n: b for n, b in loaded.named_buffers() if n.endswith("expert_bias")}
    assert sorted(biases) == ["layers.1.mlp.expert_bias", "layers.3.mlp.expert_bias"]
    assert torch.equal(biases["layers.3.mlp.expert_bias"], torch.arange(4.0) * 4)


def test_the_reference_trains_with_the_aux_term_and_reports_drops(one_thread):
    """The single-process reference (what launches are compared with) adds the aux term to the loss's
    gradient, and reports each step's term and drops."""
    from hetero.runtime.reference import reference_run

    spec = moe_model(capacity_factor=1.0, aux_loss_coef=0.5)
    steps: list = []
    losses, norms = reference_run(spec, 0, 2, 4, chunk=2, moe_steps=steps)
    without, norms_without = reference_run(moe_model(capacity_factor=1.0, aux_loss_coef=0.0), 0, 2, 4, chunk=2)
    assert len(steps) == 2 and all(aux > 0 and dropped > 0 for aux, dropped in steps)
    # 4 MoE layers' aux terms, each at least coef x top_k = 1 (its minimum, at perfect balance)
    assert all(aux >= 4 * 0.5 * 2 - 1e-6 for aux, _ in steps)
    assert losses[0] == pytest.approx(without[0]) and norms[0] != pytest.approx(norms_without[0])


# ---------------------------------------------------------------------------- launches

@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("moe,pipelines", [
    # aux loss and capacity drops in a pipeline over two vendors (a dense first layer)
    ({"capacity_factor": 1.0, "aux_loss_coef": 0.1, "dense_layers": [0]},
     [{"micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 2]}, {"group": "slow", "layers": [2, 4]}]}]),
    # aux-loss-free biases kept equal on two replicas of two vendors (the loads summed over both), with
    # capacity drops
    ({"balance": "bias", "bias_update_rate": 0.05, "capacity_factor": 1.0},
     [{"micro_batches": 1, "stages": [{"group": "fast", "layers": [0, 4]}]},
      {"micro_batches": 1, "stages": [{"group": "slow", "layers": [0, 4]}]}]),
], ids=["pp2-aux-capacity", "dp2-bias"])
def test_an_moe_launch_matches_the_single_process_reference(tmp_path, moe, pipelines):
    """Losses, gradient norms, aux terms and drop counts of each step equal the single-process run's."""
    from helpers import STEPS, launch_summary, tiny_model

    from hetero.runtime.reference import reference_run

    # lr 1e-3: at the suite's 1e-2 this model's gradient norm jumps fourfold by step 4, and the replicas'
    # summed gradients (another float order than one process's) drift apart by more than 1e-3 after it
    lr = 1e-3
    model = tiny_model("llama", moe={"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32, **moe})
    summary = launch_summary(tmp_path, model, {"global_batch_size": 4, "micro_batch_size": 2, "pipelines": pipelines},
                             "--lr", str(lr))
    steps: list = []
    losses, norms = reference_run(model, 0, STEPS, 4, chunk=2, lr=lr, moe_steps=steps)
    assert summary["losses"] == pytest.approx(losses, rel=1e-3)
    assert summary["grad_norms"] == pytest.approx(norms, rel=1e-3)
    assert summary["moe_aux_losses"] == pytest.approx([aux for aux, _ in steps], rel=1e-3)
    assert summary["moe_dropped"] == [dropped for _, dropped in steps]
    if "capacity_factor" in moe:
        assert all(d > 0 for d in summary["moe_dropped"])
    if moe.get("balance", "aux") == "aux":
        assert all(a > 0 for a in summary["moe_aux_losses"])
    expected = {0: {"1": 4}, 1: {"2": 4, "3": 4}} if "dense_layers" in moe else \
        {0: {str(i): 4 for i in range(4)}, 1: {str(i): 4 for i in range(4)}}
    assert {r["rank"]: r["experts"] for r in summary["ranks"]} == expected
