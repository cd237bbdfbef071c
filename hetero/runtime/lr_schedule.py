"""The learning-rate schedule of a run: a linear warm-up, then a constant rate or a cosine or linear
decay to a floor.

The rate of a step is a pure function of (0-based step, the run's total steps, the options), not the
state of a ``torch.optim.lr_scheduler`` object: every rank and every engine computes the same value,
a run resumed with ``--load`` continues the schedule from the checkpoint's step, and an elastic
reshard, which rebuilds optimizers, carries nothing but the trainer's step. The trainer sets the rate
on every parameter group before each step (:meth:`~hetero.runtime.engine_api.Engine.set_lr`).

With ``warmup_steps = W``, peak ``lr`` and ``total_steps = T``, step ``t`` (0-based) applies

- ``t < W``: ``lr * (t + 1) / W`` (the line from 0 before the first step reaches ``lr`` at step W);
- ``constant``: ``lr``;
- ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``;
- ``linear``: ``lr - (lr - min_lr) * p``;

with ``p = (t - W) / (T - W - 1)`` the progress of the decay (0 at the first step after the warm-up,
1 at the last step of the run; 1 when that is the only one), so the decay reaches ``min_lr`` exactly
at the last step.
"""
from __future__ import annotations

import math
import typing
from typing import Literal

ScheduleName = Literal["constant", "cosine", "linear"]
SCHEDULES: tuple[str, ...] = typing.get_args(ScheduleName)


def lr_at(step: int, total_steps: int, lr: float, schedule: str = "constant", warmup_steps: int = 0,
          min_lr: float = 0.0) -> float:
    """The learning rate of 0-based ``step`` of a run of ``total_steps`` steps (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r} (one of {', '.join(SCHEDULES)})")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = total_steps - warmup_steps
    progress = min(1.0, (step - warmup_steps) / (decay_steps - 1)) if decay_steps > 1 else 1.0
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr - (lr - min_lr) * progress


def options_lr(options, step: int, total_steps: int) -> float:
    """:func:`lr_at` with the schedule of run options (:class:`~hetero.runtime.options.RunOptions`)."""
    return lr_at(step, total_steps, options.lr, options.lr_schedule, options.warmup_steps, options.min_lr)


def set_lr(optimizer, lr: float) -> None:
    """Set ``lr`` on every parameter group of ``optimizer`` (a ``torch.optim.Optimizer``)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
