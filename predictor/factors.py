"""Calibration factors: how a calibration corrects the analytical predictor for one device type.

``hetero.predictor.calibration`` fits these on measured runs; :mod:`hetero.predictor.costs`
applies them everywhere a device's time is computed.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CalibrationFactors:
    """Corrections for one device type (all identities by default)."""

    compute: float = 1.0
    """Multiplies every compute time (operators, optimizer step)."""
    communication: float = 1.0
    """Multiplies every communication time (TP collectives, p2p, DP gradient sync)."""
    layer_overhead_s: float = 0.0
    """Added per transformer layer per micro-batch in forward, twice in backward."""
    iteration_overhead_s: float = 0.0
    """Added once per iteration (framework, data loading, synchronisation)."""
    op_floor_s: float = 0.0
    """Host dispatch time of every kernel at least (seconds): the framework's launch rate. Dispatch
    overlaps the device's work (:func:`hetero.predictor.optime.stream_time`), so it bounds small,
    launch-bound models and vanishes behind large kernels, which a per-layer overhead cannot express
    for small and large models at once."""
    network: float = 1.0
    """Multiplies the time of traffic over the inter-node network (one factor per cluster: the
    largest over its device types)."""
    matrix: float = 1.0
    """Multiplies the device work of matrix kernels (linear, bmm) on top of ``compute``: matrix
    units (tensor cores) and the memory system reach different fractions of their peaks, and the
    operator model's GEMM efficiency was learned on other units (fp32 CUDA cores)."""
    op_model: str | None = None
    """Operator model the factors were fitted with: ``learned`` or ``roofline`` (None: the default)."""
    source: str = "calibration"
    """Where these factors come from (shown by ``hetero predict`` as the device's provenance)."""


IDENTITY = CalibrationFactors(source="catalog")

__all__ = ["CalibrationFactors", "IDENTITY"]
