"""A small stand-in predictor with the interface of ``hetero.predictor`` (for planner unit tests).

It follows the same contract as the real one (``StageCostModel`` methods, ``predict`` returning an
object with ``to_dict()``, ``tokens_per_s``, ``fits_memory`` ...) with deliberately simple formulas:
roofline-free FLOP counts at a fixed efficiency, 1F1B fill/drain, a ring all-reduce per layer group.
The planner never uses it unless a test passes it in (``cost_model=``, ``predict_fn=``).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field


class FakeCostModel:
    """Per-layer times from peak FLOP/s (50 % efficiency), memory from 16 B/param + activations."""

    def __init__(self, cluster, model, calibration=None):
        self.cluster, self.model = cluster, model

    def _flops_per_layer(self, mbs: int) -> float:
        m = self.model
        return 2 * mbs * m.seq_length * m.params_per_layer() + 4 * mbs * m.seq_length ** 2 * m.hidden_size

    def _speed(self, group: str) -> float:
        return 0.5 * self.cluster.device_type(group).matrix_flops(self.model.dtype)

    @functools.lru_cache(maxsize=None)
    def layer_times(self, group, tp, mbs, recompute):
        f = self._flops_per_layer(mbs) / (tp * self._speed(group))
        if tp > 1:
            g = self.cluster.group(group)
            nbytes = mbs * self.model.seq_length * self.model.hidden_size * self.model.bytes_per_element
            f += 4 * (tp - 1) / tp * g.intra_node.transfer_time(nbytes)
        extra = {"none": 0.0, "selective": 0.1, "full": 1.0}[recompute]
        return f, (2.0 + extra) * f

    def _extra(self, group, tp, mbs, first, last):
        m = self.model
        flops = 6 * mbs * m.seq_length * m.vocab_size * m.hidden_size if last else 0.0
        t = flops / (tp * self._speed(group))
        return t / 3, 2 * t / 3

    @functools.lru_cache(maxsize=None)
    def stage_times(self, group, tp, mbs, layers, recompute, first, last):
        f, b = self.layer_times(group, tp, mbs, recompute)
        n = layers[1] - layers[0]
        ef, eb = self._extra(group, tp, mbs, first, last)
        return n * f + ef, n * b + eb

    @functools.lru_cache(maxsize=None)
    def stage_memory(self, group, tp, mbs, layers, recompute, zero_stage, dp, in_flight, first, last):
        m = self.model
        n = layers[1] - layers[0]
        params = n * m.params_per_layer() + (m.embedding_params() if first else 0) + (m.head_params() if last else 0)
        params /= tp
        states = params * (2 * m.bytes_per_element + 12) if m.bytes_per_element == 2 else params * 16
        if zero_stage >= 1:
            states = params * (2 * m.bytes_per_element) + params * 12 / dp if m.bytes_per_element == 2 else \
                params * 8 + params * 8 / dp
        act_layer = mbs * m.seq_length * m.hidden_size * m.bytes_per_element * {"none": 16, "selective": 10, "full": 1}[recompute] / tp
        return int(states + n * act_layer * in_flight + 1e9 * 0)

    def capacity(self, group):
        return int(self.cluster.device_type(group).memory)

    @functools.lru_cache(maxsize=None)
    def p2p_time(self, group_a, group_b, mbs, tp_a=1, tp_b=1):  # no tp gather in this toy model
        nbytes = mbs * self.model.seq_length * self.model.hidden_size * self.model.bytes_per_element
        return self.cluster.link_between(group_a, group_b).transfer_time(nbytes)


@dataclass(frozen=True)
class FakePrediction:
    iteration_time_s: float
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    fits_memory: bool
    pipelines: list = field(default_factory=list)
    upper_bound_tokens_per_s: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fake_predict(cluster, model, plan, calibration=None, _cache={}):
    """1F1B per pipeline (fill/drain + steady state), ring all-reduce of gradients per group."""
    key = id(cluster), id(model)
    cm = _cache.get(key)
    if cm is None:
        cm = _cache[key] = FakeCostModel(cluster, model)
    L = model.num_layers
    worst, fits, pipes, flops = 0.0, True, [], 0.0
    for p in plan.pipelines:
        mbs = plan.mbs(p)
        S = len(p.stages)
        times, stages_out = [], []
        for i, s in enumerate(p.stages):
            f, b = cm.stage_times(s.group, s.tp, mbs, tuple(s.layers), plan.recompute, i == 0, i == S - 1)
            mem = cm.stage_memory(s.group, s.tp, mbs, tuple(s.layers), plan.recompute, plan.zero_stage,
                                  p.replicas, min(S - i, p.micro_batches), i == 0, i == S - 1)
            cap = cm.capacity(s.group)
            fits = fits and mem <= cap
            p2p = cm.p2p_time(s.group, p.stages[i + 1].group, mbs) if i + 1 < S else 0.0
            times.append(f + b + 2 * p2p)
            stages_out.append({"group": s.group, "tp": s.tp, "layers": list(s.layers), "forward_time_s": f,
                               "backward_time_s": b, "peak_memory_bytes": mem, "memory_capacity_bytes": cap})
        t = (p.micro_batches - 1) * max(times) + sum(times)
        # gradient all-reduce: every stage's parameters across all replicas holding those layers
        for s in p.stages:
            nbytes = (s.layers[1] - s.layers[0]) * model.params_per_layer() * model.bytes_per_element / s.tp
            link = cluster.network.inter_node
            dp_total = sum(q.replicas for q in plan.pipelines)
            groups = {st.group for q in plan.pipelines for st in q.stages if st.layers[0] < s.layers[1] and s.layers[0] < st.layers[1]}
            if len(groups) > 1:
                link = cluster.network.cross_group
            if dp_total > 1:
                t_ar = 2 * (dp_total - 1) / dp_total * nbytes / link.bandwidth
                t += t_ar / S
        worst = max(worst, t)
        pipes.append({"replicas": p.replicas, "micro_batches": p.micro_batches, "stages": stages_out})
    tokens = plan.global_batch_size * model.seq_length
    return FakePrediction(iteration_time_s=worst, tokens_per_s=tokens / worst,
                          samples_per_s=plan.global_batch_size / worst, mfu=0.0, fits_memory=fits, pipelines=pipes)


__all__ = ["FakeCostModel", "FakePrediction", "fake_predict"]
