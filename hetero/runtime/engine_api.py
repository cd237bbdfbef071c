"""What the trainer asks of an engine: the one interface the native and DeepSpeed engines implement.

An engine owns one rank's share of the model, its optimizer and its step; the
:class:`~hetero.runtime.trainer.Trainer` builds it as ``engine_cls(ctx, comm)`` (a
:class:`~hetero.runtime.context.RunContext` and the rank's
:class:`~hetero.runtime.collectives.Collectives`, whose process groups the run's
:class:`~hetero.runtime.parallel.ParallelLayout` created) and then calls only what :class:`Engine`
lists. Engines: :class:`hetero.runtime.engine.NativeEngine` (``--engine native``) and
:class:`hetero.runtime.ds_engine.DeepSpeedEngine` (``--engine deepspeed``).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from hetero.runtime.pipeline import Timings


@runtime_checkable
class Engine(Protocol):
    """One rank's training engine (see the module docstring)."""

    name: str
    """The engine's name as the run summary records it (``native``, ``deepspeed``)."""
    step_loss_scale: float | None
    """The loss scale the last step ran with (fp16 with dynamic loss scaling), else None."""
    step_skipped: bool
    """Whether the last step's update was skipped (an fp16 gradient overflowed on some rank)."""

    def train_step(self, step: int, timings: Timings) -> tuple[float, float]:
        """One optimizer step (0-based ``step``) over the step's micro-batches, filling ``timings``;
        returns (this rank's share of the loss, the global gradient norm). Every rank calls it."""
        ...

    def set_lr(self, lr: float) -> None:
        """Apply ``lr`` to every parameter group from the next step on (the trainer sets each step's rate
        of the run's schedule, :mod:`hetero.runtime.lr_schedule`)."""
        ...

    def save(self, path: str, step: int) -> None:
        """Write this rank's part of a checkpoint of the run after ``step`` steps (a collective)."""
        ...

    def load(self, path: str) -> int:
        """Read this rank's part of the checkpoint at ``path`` (a collective); returns its step."""
        ...

    def optimizer_state_bytes(self) -> int | None:
        """Bytes of optimizer state this rank keeps (None: the engine does not say)."""
        ...
