"""The planner's search knobs (:class:`Options`); :func:`hetero.planner.search` takes them as keywords."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .space import RECOMPUTE


@dataclass(frozen=True)
class Options:
    """Search knobs; :func:`~hetero.planner.search` takes each field as a keyword."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = RECOMPUTE
    zero_stages: tuple[int, ...] = (0, 1, 2)
    interleaves: tuple[int, ...] = (2, 3, 4)
    """Model chunks per device tried for the interleaved 1F1B schedule (twins of the best 1F1B
    plans, :mod:`hetero.planner.interleave`); ``()`` plans 1F1B only."""
    keep_per_block: int = 6
    """Shapes kept per group set (by the ranking key) for the combination step."""
    combos_per_block: int = 3
    combos_budget: int | None = None
    """Shape combinations tried per set of pipelines (the best ``budget ** (1/k)`` of each of k parts)."""
    max_predictions: int = 64
    """Plans sent to ``predict()`` before refinement."""
    refine_top: int = 3
    refine_rounds: int = 2
    workers: int | None = None
    """Processes for the shape enumeration and the predictions (None: 2 on big clusters, else 1)."""
    mixed: bool = True
    """Consider pipelines whose stages span several groups."""


def workers_for(opts: Options, cluster) -> int:
    """Processes the search uses: ``opts.workers``, or by default 2 for clusters of 256 devices and
    more where the machine has two cores (smaller searches take less than a pool's start-up)."""
    if opts.workers is not None:
        return opts.workers
    return 2 if cluster.num_devices >= 256 and (os.cpu_count() or 1) > 1 else 1
