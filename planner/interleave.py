"""Interleaved twins: a 1F1B plan turned into Megatron's interleaved 1F1B with ``v`` model chunks
per device, for the scorer to weigh against the original.

Interleaving divides the pipeline bubble by ``v`` at the price of ``v`` times the stage-to-stage
transfers and more activations held by the first devices; which wins depends on the stage times,
the micro-batch count and the links, so the planner lets ``predict()`` decide (it simulates the
interleaved order the runtime executes, and its memory). Each device keeps the layers the 1F1B plan
gave it, split into ``v`` chunks as evenly as they go; the hill climb then moves single layers
across virtual-stage boundaries like any other.
"""
from __future__ import annotations

import dataclasses

from hetero.specs.plan import Plan


def interleaved_twin(plan: Plan, v: int) -> Plan | None:
    """``plan`` (one model chunk per device) with ``v`` chunks per device, or None when a pipeline
    cannot interleave: one physical stage, or a device with fewer than ``v`` layers."""
    if plan.schedule == "interleaved" or v < 2:
        return None
    pipelines = []
    for p in plan.pipelines:
        stages = p.stages
        sizes = [s.layers[1] - s.layers[0] for s in stages]
        if len(stages) < 2 or min(sizes) < v:
            return None
        # chunk c of device j is virtual stage c * len(stages) + j; layers go to virtual stages in order
        chunks = [[n // v + (c < n % v) for c in range(v)] for n in sizes]
        virtual, start = [], stages[0].layers[0]
        for c in range(v):
            for j, s in enumerate(stages):
                virtual.append(dataclasses.replace(s, layers=(start, start + chunks[j][c])))
                start += chunks[j][c]
        pipelines.append(dataclasses.replace(p, stages=virtual))
    return dataclasses.replace(plan, pipelines=pipelines, schedule="interleaved", interleave=v)


def one_chunk_twin(plan: Plan) -> Plan:
    """The 1F1B plan on the same devices with the same number of layers each (the inverse of
    :func:`interleaved_twin`); ``plan`` itself when it is not interleaved."""
    if plan.schedule != "interleaved":
        return plan
    pipelines = []
    for p in plan.pipelines:
        physical = plan.physical_stages(p)
        stages, start = [], p.stages[0].layers[0]
        for j, s in enumerate(physical):
            n = sum(c.layers[1] - c.layers[0] for c in p.stages[j::len(physical)])
            stages.append(dataclasses.replace(s, layers=(start, start + n)))
            start += n
        pipelines.append(dataclasses.replace(p, stages=stages))
    return dataclasses.replace(plan, pipelines=pipelines, schedule="1f1b", interleave=2)


def interleaved_twins(plan: Plan, interleaves) -> list[Plan]:
    """:func:`interleaved_twin` for each ``v`` in ``interleaves`` that applies."""
    return [t for t in (interleaved_twin(plan, v) for v in interleaves) if t is not None]


__all__ = ["interleaved_twin", "interleaved_twins", "one_chunk_twin"]
