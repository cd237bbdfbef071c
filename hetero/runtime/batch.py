"""What a data source hands an engine: a :class:`Batch` of inputs and targets, where
:data:`IGNORE_INDEX` marks a target that carries no loss (:mod:`hetero.runtime.data`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
"""A target that carries no loss (a prompt or padding token): torch's ``cross_entropy`` default."""


class Batch(NamedTuple):
    """Samples as a model trains on them: ``inputs`` and ``targets``, each ``(count, seq_length)``
    int64; ``targets`` holds :data:`IGNORE_INDEX` where a position carries no loss."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def loss_tokens(self) -> int:
        """Targets that carry loss in these samples."""
        return int((self.targets != IGNORE_INDEX).sum())
