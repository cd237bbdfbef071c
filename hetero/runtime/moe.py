"""The mixture-of-experts MLP of an MoE layer (the model file's ``moe:`` block).

A router scores every token against ``num_experts`` experts (softmax or sigmoid of one linear
map), the token goes to its ``top_k`` best experts, and their outputs are summed with the gate
weights (renormalised to sum to 1 with ``norm_topk_prob``). Routed experts are the dense MLP of
the model (SwiGLU for llama, gelu / relu for gpt) at ``expert_ffn_hidden_size``; an optional shared
expert sees every token, its output scaled by a sigmoid of one learned score (Qwen2-MoE).

Parameter names (under ``layers.<l>.mlp.``): ``router.weight`` (experts x hidden),
``experts.<e>.w1/w2/w3.<weight|bias>`` (one tensor per expert, so checkpoints, the virtual
parameter space and reshards see every expert), ``shared_expert.w1/w2/w3.*`` and
``shared_expert_gate.weight`` (1 x hidden). ``balance: bias`` adds the buffer ``expert_bias``.

Load balancing: ``aux`` adds ``aux_loss_coef x num_experts x sum_i f_i P_i`` (f_i: the fraction of
tokens routed to expert i, summing to top_k; P_i: its mean router probability; transformers'
``load_balancing_loss_func``) to the training loss through the backward of the layer's output
(:class:`_AuxLossGradient`), so no stage needs the loss of another. ``bias`` (aux-loss-free,
DeepSeek-V3): the bias is added to the scores for the top-k choice only, and after each step moves
by ``bias_update_rate x sign(mean load - load)`` (:func:`update_expert_biases`).

Capacity: dropless by default; with ``capacity_factor`` each expert keeps the first
``capacity`` token assignments in token order (then in the token's top-k order) and drops the
rest, counted in :attr:`MoEMLP.dropped`. Only in training mode: an ``eval()`` module (evaluation,
generation) routes dropless.

Expert compute: ``torch._grouped_mm`` over the tokens sorted by expert where the device's backend
has a grouped GEMM for the compute dtype (:meth:`hetero.backends.base.Backend.has_grouped_gemm`:
Hopper CUDA in bf16, i.e. bf16 models), a loop over the experts elsewhere (CPU, A100, ROCm, fp32).
The MoE MLP runs eagerly inside a compiled block (its shapes depend on the routing). The outputs are
placed back per (token, k) and summed over k, so the result does not depend on atomic adds' order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero.specs.model import ModelSpec


class _AuxLossGradient(torch.autograd.Function):
    """Identity on the layer's output; its backward also gives the aux loss the gradient ``scale``, so
    the aux term joins the training loss's gradient wherever the layer's stage runs backward (as
    Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class MoEMLP(nn.Module):
    """Router, routed experts and optional shared expert of one MoE layer (see the module docstring)."""

    eager_under_compile = True
    """Data-dependent shapes and host-side counts: :func:`hetero.runtime.model.compile_blocks` keeps
    this layer eager inside its compiled block."""

    def __init__(self, spec: ModelSpec, mlp: type[nn.Module]):
        """``mlp``: the model's dense MLP class, built as ``mlp(spec, width)`` for each expert."""
        super().__init__()
        moe, h = spec.moe, spec.hidden_size
        self.moe = moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.router = nn.Linear(h, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(mlp(spec, moe.expert_ffn_hidden_size) for _ in range(moe.num_experts))
        if moe.shared_expert_ffn_hidden_size:
            self.shared_expert = mlp(spec, moe.shared_expert_ffn_hidden_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        if moe.balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts))
        self.expert_compute: str | None = None
        """``grouped`` or ``loop``; None: the device's backend decides (:func:`uses_grouped_gemm`)."""
        self.expert_group = None
        """Expert parallelism: the :class:`hetero.runtime.expert_parallel.ExpertGroup` that runs the experts
        (this rank holds only its own); None: every expert here."""
        self.aux_scale = 0.0
        """The aux loss's gradient weight per forward: ``aux_loss_coef`` x (the loss scale, the
        micro-batch's share of the step): set by the engine (:func:`set_aux_scale`); 0: not trained."""
        self.reset_stats()

    def reset_stats(self) -> None:
        """Clear what the forwards since the last call recorded (aux losses, loads, drops)."""
        self.aux_losses: list[float] = []
        """The aux loss (unweighted) of each training forward since the last reset."""
        self.load: torch.Tensor | None = None
        """Token assignments each expert received (before capacity drops) since the last reset (None: none)."""
        self.dropped = 0
        """Token assignments dropped over capacity since the last reset."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens (N, h) -> (expert indices (N, k), gate weights (N, k) fp32, router probabilities
        (N, E) fp32: softmax, or the sigmoid scores normalised per token)."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.moe.router == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.moe.balance == "bias" else scores
        index = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, index)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        probs = scores if self.moe.router == "softmax" else scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
        return index, weights, probs

    def aux_loss(self, index: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """num_experts x sum_i f_i P_i (fp32 scalar): f_i the fraction of the tokens routed to expert i
        (the top-k choices, before capacity), P_i expert i's mean router probability."""
        n = index.shape[0]
        f = torch.bincount(index.reshape(-1), minlength=self.num_experts).to(probs.dtype) / n
        return self.num_experts * (f * probs.mean(0)).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        n, k = xf.shape[0], self.top_k
        index, weights, probs = self.route(xf)
        flat = index.reshape(-1)                          # assignment a = token * k + choice
        counts = torch.bincount(flat, minlength=self.num_experts)
        keep = None
        # capacity is a training rule: evaluation and generation (eval mode) route dropless, so a cached
        # decode step and a full forward see the same experts whatever the batch around a token
        capacity = self.moe.capacity(n) if self.training else None
        if capacity is not None:
            # each assignment's place in its expert's queue, in token order: the first `capacity` stay
            place = F.one_hot(flat, self.num_experts).cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1
            keep = place < capacity
        order = torch.argsort(flat, stable=True)          # assignments grouped by expert, token order inside
        if keep is not None:
            order = order[keep[order]]
        kept = counts if keep is None else torch.bincount(flat[keep], minlength=self.num_experts)
        xs = xf[order // k]
        y = self._experts(xs, kept) if self.expert_group is None else self.expert_group(self, xs, kept)
        placed = torch.zeros(n * k, shape[-1], dtype=y.dtype, device=y.device).index_copy(0, order, y)
        out = (placed.view(n, k, -1) * weights.to(y.dtype).unsqueeze(-1)).sum(1)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(xf)) * self.shared_expert(xf)
        out = out.to(x.dtype).view(shape)
        train = torch.is_grad_enabled() and self.training
        aux = None
        if train and self.moe.balance == "aux" and self.aux_scale:
            aux = self.aux_loss(index, probs)
            out = _AuxLossGradient.apply(out, aux, self.aux_scale)
        if train and torch._C._current_graph_task_id() == -1:
            # a training forward, not its recomputation inside a backward (full recompute): record it
            self.load = counts.detach() + (0 if self.load is None else self.load)
            self.dropped += 0 if keep is None else int((~keep).sum())
            if self.moe.balance == "aux":
                with torch.no_grad():
                    self.aux_losses.append(float(aux if aux is not None else self.aux_loss(index, probs)))
        return out

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs of the rows ``xs`` sorted by expert, ``counts[e]`` rows for expert e."""
        dtype = torch.get_autocast_dtype(xs.device.type) if torch.is_autocast_enabled(xs.device.type) else xs.dtype
        if self.expert_compute:
            grouped = self.expert_compute == "grouped"
        else:   # the kernel needs 16-byte aligned rows: widths a multiple of 8 bf16 elements
            widths = (xs.shape[-1], self.moe.expert_ffn_hidden_size)
            grouped = uses_grouped_gemm(xs.device, dtype) and all(w % 8 == 0 for w in widths)
        if grouped:
            return self._grouped(xs, counts, dtype)
        # with gradients on, every expert runs, an expert with no rows on an empty chunk: its weights get
        # a zero gradient rather than none, so the optimizer steps every expert every step (AdamW moves
        # an expert that saw no token on its moments) on one device as in any data- or expert-parallel
        # run, whose gradient sums fill a missing gradient with zeros; without (generation) it is skipped
        grad = torch.is_grad_enabled()
        sizes = counts.tolist()
        parts = [self.experts[e](chunk) for e, chunk in enumerate(xs.split(sizes)) if sizes[e] or grad]
        return torch.cat(parts) if parts else xs.new_zeros(0, xs.shape[-1])

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One grouped GEMM per projection over every expert's rows (weights stacked per call), in
        ``dtype`` (the autocast dtype where autocast is on, as the loop's linear layers compute)."""
        offs = counts.cumsum(0).to(torch.int32)
        first = self.experts[0]

        def project(name: str, rows: torch.Tensor) -> torch.Tensor:
            w = torch.stack([getattr(e, name).weight for e in self.experts]).to(dtype).transpose(1, 2)
            out = torch._grouped_mm(rows.to(dtype), w, offs=offs)
            if getattr(first, name).bias is not None:
                bias = torch.stack([getattr(e, name).bias for e in self.experts]).to(dtype)
                out = out + bias.repeat_interleave(counts, dim=0, output_size=rows.shape[0])
            return out

        if first.gated:
            a = F.silu(project("w1", xs)) * project("w3", xs)
        else:
            a = project("w1", xs)
            a = F.gelu(a, approximate="tanh") if first.act == "gelu" else F.relu(a)
        return project("w2", a)


def uses_grouped_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether expert compute on ``device`` in ``dtype`` takes the grouped GEMM (its backend's capability)."""
    from hetero.backends import backend_of

    return backend_of(device).has_grouped_gemm(device, dtype)


def moe_layers_of(module: nn.Module) -> dict[str, MoEMLP]:
    """The MoE MLPs of a stage by their module name (``layers.<l>.mlp``)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, MoEMLP)}


def set_aux_scale(module: nn.Module, scale: float) -> None:
    """Set the aux-loss gradient weight of every MoE layer of ``module``: ``scale`` x aux_loss_coef
    (the engine gives the loss scale times one micro-batch's share of the step)."""
    for m in moe_layers_of(module).values():
        m.aux_scale = scale * m.moe.aux_loss_coef


def finish_step(module: nn.Module, model: ModelSpec, comm=None, share: float = 1.0) -> tuple[float, int]:
    """After a step's schedule on one rank: returns (this rank's part of the step's aux loss term, the
    token assignments its MoE layers dropped over capacity), and clears what the forwards recorded.
    The aux term: ``aux_loss_coef x`` each MoE layer's aux loss of each micro-batch, weighted by
    ``share`` (micro-batch size / global batch size, as the gradient weighs it); summed over every rank,
    the mean over the step's micro-batches of the whole model's aux term. With ``balance: bias`` the
    expert loads are summed over every rank first (one all-reduce of layers x experts counts through
    ``comm``, which every rank of the run calls; None: one process) and move the expert biases."""
    layers = moe_layers_of(module)
    aux = share * sum(m.moe.aux_loss_coef * sum(m.aux_losses) for m in layers.values())
    dropped = sum(m.dropped for m in layers.values())
    if model.moe is not None and model.moe.balance == "bias":
        loads = torch.zeros(model.num_layers, model.moe.num_experts, dtype=torch.float64)
        for name, m in layers.items():
            if m.load is not None:
                loads[_layer_of(name)] += m.load.cpu()
        if comm is not None:
            loads = comm.all_reduce(loads)
        update_expert_biases(module, {name: loads[_layer_of(name)] for name in layers})
    for m in layers.values():
        m.reset_stats()
    return aux, dropped


def _layer_of(name: str) -> int:
    """The model layer of an MoE module name ``layers.<l>.mlp``."""
    return int(name.split(".")[1])


@torch.no_grad()
def update_expert_biases(module: nn.Module, loads: dict[str, torch.Tensor]) -> None:
    """Aux-loss-free balancing (DeepSeek-V3) after a step: each ``balance: bias`` layer's bias moves by
    ``bias_update_rate x sign(mean load - load)``. ``loads``: the step's assignments per expert by layer
    name, summed over every rank that ran the layer (so the replicas' biases stay equal)."""
    for name, m in moe_layers_of(module).items():
        if m.moe.balance == "bias" and name in loads:
            load = loads[name].to(torch.float32)
            m.expert_bias += m.moe.bias_update_rate * torch.sign(load.mean() - load).to(m.expert_bias.device)
