"""The single-device reference: the whole model in one process, same data, init and optimizer.

``reference_losses(model, seed, steps, global_batch)`` is what every plan's losses must match
(tests: fp32, 1e-3 relative). It splits the global batch into chunks of ``chunk`` samples, each
loss the chunk's summed token losses over the step's loss tokens, exactly the rule the distributed
runtime follows (the mean over the global batch's loss tokens: :mod:`hetero.runtime.data`). The learning
rate follows the run's schedule (``lr_schedule``, ``warmup_steps``, ``min_lr``: :mod:`hetero.runtime.lr_schedule`).
An MoE model's chunks must be the run's micro-batches (routing, the aux loss and capacity are per micro-batch).

fp16 / bf16 models run as the runtime runs them: forward under autocast to that dtype with fp32
master weights, and fp16 with a static loss scale (``loss_scale``, the runtime's default initial
scale unless given) that backward's gradients are unscaled from. The reference does not skip
overflowed steps: pick a scale that does not overflow.
"""
from __future__ import annotations

import math

import torch

from hetero.runtime.data import data_source
from hetero.runtime.grads import clip_coefficient, make_optimizer, scale_grads
from hetero.runtime.lr_schedule import lr_at, set_lr
from hetero.runtime.model import build_stage, loss_sum
from hetero.runtime.moe import finish_step, set_aux_scale


def reference_losses(model, seed: int, steps: int, global_batch: int, *, chunk: int | None = None,
                     lr: float = 1e-3, weight_decay: float = 0.0, clip: float = 1.0, data: str | None = None,
                     return_model: bool = False, return_norms: bool = False, loss_scale: float | None = None,
                     lr_schedule: str = "constant", warmup_steps: int = 0, min_lr: float = 0.0,
                     tokenizer: str | None = None, moe_steps: list | None = None):
    """``moe_steps``: a list that takes each step's (aux loss term, dropped token assignments) of an MoE
    model (what a run's summary gives as ``moe_aux_losses`` and ``moe_dropped``)."""
    import contextlib

    import hetero
    from hetero.runtime.engine import AUTOCAST
    from hetero.runtime.loss_scale import DEFAULT_INITIAL_SCALE

    model = hetero.load_model(model) if not hasattr(model, "num_layers") else model
    low = AUTOCAST[model.dtype]
    S = (loss_scale or DEFAULT_INITIAL_SCALE) if model.dtype == "fp16" else 1.0

    def autocast():
        return torch.autocast("cpu", dtype=low) if low is not None else contextlib.nullcontext()

    torch.manual_seed(seed)
    m = build_stage(model, (0, model.num_layers), True, True, seed)
    opt = make_optimizer(m.parameters(), lr, weight_decay)
    src = data_source(model.vocab_size, model.seq_length, seed, data, tokenizer)
    chunk = chunk or global_batch
    losses, norms = [], []
    for step in range(steps):
        set_lr(opt, lr_at(step, steps, lr, lr_schedule, warmup_steps, min_lr))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        tokens = max(1, src.loss_tokens(step * global_batch, global_batch))
        for first in range(0, global_batch, chunk):
            n = min(chunk, global_batch - first)
            x, y = src.batch(step * global_batch + first, n)
            set_aux_scale(m, S * n / global_batch)   # MoE: each chunk's aux term, as the runtime weighs it
            with autocast():
                out = m(x)
            loss = loss_sum(out, y) * (S / tokens)
            loss.backward()
            total += float(loss.detach()) / S
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in m.parameters() if p.grad is not None)) / S
        scale_grads(m, clip_coefficient(norm, clip) / S)
        opt.step()
        moe = finish_step(m, model, share=chunk / global_batch)   # MoE: balance: bias moves the expert biases
        if moe_steps is not None:
            moe_steps.append(moe)
        losses.append(total)
        norms.append(norm)
    if return_norms:
        return losses, norms
    return (losses, m) if return_model else losses


def reference_run(model, seed: int, steps: int, global_batch: int, **kw) -> tuple[list[float], list[float]]:
    """(losses, gradient norms before clipping) of the single-device reference."""
    return reference_losses(model, seed, steps, global_batch, return_norms=True, **kw)
