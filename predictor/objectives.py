"""Plan objectives beyond throughput: cost, memory headroom and energy, from a prediction and the
device catalog's price and power figures.

- ``throughput``: tokens/s (higher is better), the prediction's own figure.
- ``cost``: USD per million tokens: the price per device-hour of every device the plan uses (devices
  it leaves idle are not charged) over the tokens one hour trains. Catalog prices are indicative
  on-demand list prices, not quotes.
- ``memory_headroom``: the smallest free fraction of device memory over all stages (higher is
  better; negative when a stage does not fit).
- ``energy``: joules per token. A used device draws its board power (``tdp``) while busy and its
  ``idle_power`` otherwise; busy is its compute in the predicted step (every micro-batch's forward and
  backward of each chunk it holds) plus its optimizer step, at most the whole step.

Directions: :data:`MAXIMISE` up, the others down.
"""
from __future__ import annotations

OBJECTIVES = ("throughput", "cost", "memory_headroom", "energy")
"""What one prediction gives; plan fronts add ``resilience`` (:mod:`hetero.planner.front`)."""
MAXIMISE = frozenset({"throughput", "memory_headroom", "resilience"})
UNITS = {"throughput": "tokens/s", "cost": "USD/Mtok", "memory_headroom": "free", "energy": "J/token",
         "resilience": "kept"}
_NEEDS = {"cost": ("price_per_hour",), "energy": ("tdp", "idle_power")}
_FIX = {"price_per_hour": "price_per_hour: <USD per device-hour>", "tdp": "tdp: <board power> W",
        "idle_power": "idle_power: <idle draw> W"}


def missing_data(cluster, names, groups=None) -> list[tuple[str, str, str]]:
    """``(objective, device, field)`` for every objective in ``names`` whose catalog figure a device
    of ``groups`` (default: all of the cluster's) lacks."""
    out = []
    for g in cluster.groups:
        if groups is not None and g.name not in groups:
            continue
        dev = cluster.device_types[g.name]
        for obj in names:
            for fld in _NEEDS.get(obj, ()):
                if getattr(dev, fld, None) is None and (obj, g.device, fld) not in out:
                    out.append((obj, g.device, fld))
    return out


def missing_message(missing: list[tuple[str, str, str]]) -> str:
    """One line naming the first device without the figure an objective needs, and the fix."""
    obj, device, fld = missing[0]
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (f"objective '{obj}' needs {fld} of device '{device}', which has none{more} "
            f"(fix: add '{_FIX[fld]}' under devices.{device} in the cluster file, or leave '{obj}' out)")


def busy_seconds(plan, prediction) -> list[tuple[str, int, float]]:
    """``(group, devices, busy seconds per device)`` per physical stage of every pipeline: its
    chunks' forward and backward over all micro-batches, plus its optimizer step."""
    out = []
    for p, pp in zip(plan.pipelines, prediction.pipelines):
        phys = len(plan.physical_stages(p))
        for i in range(phys):
            chunks = pp.stages[i::phys]
            s = chunks[0]
            busy = pp.micro_batches * sum(c.forward_time_s + c.backward_time_s for c in chunks) + s.optimizer_time_s
            out.append((s.group, p.replicas * s.tp, busy))
    return out


def objectives(cluster, plan, prediction) -> dict[str, float | None]:
    """``{throughput, cost, memory_headroom, energy}`` of ``plan`` from its ``prediction``; an
    objective whose catalog figures a used device lacks is None."""
    T = prediction.iteration_time_s
    tokens = prediction.tokens_per_s * T
    used = plan.devices_by_group()
    lacking = {obj for obj, _, _ in missing_data(cluster, ("cost", "energy"), used)}
    out: dict[str, float | None] = {"throughput": prediction.tokens_per_s}
    if "cost" in lacking or tokens <= 0:
        out["cost"] = None
    else:
        usd_per_s = sum(n * cluster.device_types[g].price_per_hour / 3600.0 for g, n in used.items())
        out["cost"] = usd_per_s * T / tokens * 1e6
    free = [1.0 - s.peak_memory_bytes / s.memory_capacity_bytes
            for pp in prediction.pipelines for s in pp.stages if s.memory_capacity_bytes]
    out["memory_headroom"] = min(free) if free else None
    if "energy" in lacking or tokens <= 0:
        out["energy"] = None
    else:
        joules = 0.0
        for g, n, busy in busy_seconds(plan, prediction):
            dev = cluster.device_types[g]
            b = min(max(busy, 0.0), T)
            joules += n * (dev.idle_power * T + (dev.tdp - dev.idle_power) * b)
        out["energy"] = joules / tokens
    return out


__all__ = ["OBJECTIVES", "MAXIMISE", "UNITS", "objectives", "missing_data", "missing_message", "busy_seconds"]
