"""Dynamic loss scaling for fp16 mixed precision, decided once for the whole job.

fp16 has 5 exponent bits: small activation gradients underflow to zero unless the loss is scaled
up before backward, and a scale too large overflows to inf. The rule is torch.amp.GradScaler's
(start at 2^16, halve and skip the step on overflow, double after 2,000 clean steps). GradScaler
itself is not used because it decides per process from its own gradients, while a pipeline's
stages and replicas hold different parameters and must all skip the same step: here the decision
comes from the global gradient norm the engine all-reduces anyway, which is inf or nan on every
rank as soon as any rank overflowed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_INITIAL_SCALE = 2.0 ** 16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


@dataclass
class DynamicLossScale:
    """The current scale and how many clean steps ran at it."""

    scale: float = DEFAULT_INITIAL_SCALE
    clean_steps: int = 0
    growth_interval: int = GROWTH_INTERVAL

    def __post_init__(self):
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"loss scale must be a positive finite number, got {self.scale}")

    def unscale(self, scaled_norm: float) -> tuple[float, bool]:
        """(true gradient norm, whether the gradients are finite) from the norm of scaled gradients."""
        finite = math.isfinite(scaled_norm)
        return (scaled_norm / self.scale if finite else scaled_norm), finite

    def update(self, finite: bool) -> None:
        """After a step: back off on overflow (the step was skipped), grow after a clean streak."""
        if not finite:
            self.scale *= BACKOFF_FACTOR
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= GROWTH_FACTOR
            self.clean_steps = 0


__all__ = ["DEFAULT_INITIAL_SCALE", "DynamicLossScale"]
