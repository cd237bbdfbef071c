"""One RL (GRPO) step of a placement: rollout, weight sync, training, and the step they make.

The step as ``hetero rl`` runs it (hetero/rl/worker.py):

- **rollout**: the step's ``prompts_per_step`` prompt groups go round-robin to the rollout copies
  (group ``g`` to copy ``g mod R``); a copy generates its groups one after another, each a batch of
  ``group_size`` rows (:func:`.generation.generation_time`: prefill, then ``max_new_tokens - 1``
  decode steps, no early stop assumed). The slowest copy ends the rollout. Collocated, every actor
  device holds a temporary whole copy and generates; disaggregated, the rollout groups' devices do
  (``tp`` devices a copy).
- **sync**: after each update the actor's fp32 weights go to every copy, each piece checksummed
  on both sides (:func:`.generation.weight_sync_time`); collocated, each actor device gathers a
  whole copy, and switches between training and generation (:func:`.generation.context_switch_time`).
- **train**: the actor plan's predicted iteration (:func:`.api.predict`) on the step's
  ``prompts_per_step x group_size`` samples, each a row of the model's ``seq_length``.
- **step**: with staleness 0 (and always collocated) the phases follow each other:
  ``sync + switch + rollout + train``. Disaggregated with staleness >= 1, the rollout of step t+1
  (which first receives the weights) runs while step t trains: the longer of the actor's path
  (checksumming and posting its sends, then training) and the rollout's (the transfer, the
  checksums of what landed, then generating).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import generation as gen


@dataclass(frozen=True)
class RLSizes:
    """What a job asks of one step."""

    prompts_per_step: int
    group_size: int
    prompt_tokens: float
    """Mean prompt length in tokens (the prompts file's, as its tokenizer encodes them)."""
    max_new_tokens: int
    staleness: int = 0

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass
class RLStepPrediction:
    """Predicted seconds of one RL step of a placement."""

    step_s: float
    rollout_s: float
    train_s: float
    sync_s: float
    samples_per_s: float
    sync_send_s: float = 0.0
    """Of ``sync_s``, the actor's share (its checksums before posting the sends)."""
    switch_s: float = 0.0
    """Collocated: the context switch between training and generation (0 when both fit)."""
    fits: bool = True
    """Whether the actor plan fits its devices and every rollout copy holds at least one sequence."""
    copies: dict = field(default_factory=dict)
    """Rollout copies per group."""
    rollout_by_group: dict = field(default_factory=dict)
    """Seconds of one prompt group (``group_size`` rows) on one copy of each rollout group."""
    overlapped: bool = False
    """Whether rollout and training overlap (disaggregated with staleness >= 1)."""

    def summary(self) -> dict:
        """The run summary's ``predicted``: ``{"step_s", "rollout_s", "train_s", "sync_s"}``."""
        return {"step_s": self.step_s, "rollout_s": self.rollout_s, "train_s": self.train_s, "sync_s": self.sync_s}

    def to_dict(self) -> dict:
        """``hetero rl --predict --json``'s ``predicted``: the summary's four and ``samples_per_s``."""
        return {**self.summary(), "samples_per_s": self.samples_per_s}


def rollout_time(cluster, model, sizes: RLSizes, copies: list[tuple[str, int]],
                 reserved: dict[str, float] | None = None) -> tuple[float, dict[str, float]]:
    """(seconds of the step's rollout, seconds of one prompt group per copy's group) for ``copies``
    as ``(group, tp)`` in rank order; ``reserved``: bytes per group held by a collocated actor."""
    reserved = reserved or {}
    per_group: dict[str, float] = {}
    for g, tp in copies:
        if g not in per_group:
            per_group[g] = gen.generation_time(cluster, g, model, sizes.group_size, round(sizes.prompt_tokens),
                                               sizes.max_new_tokens, tp, reserved.get(g, 0.0)).seconds
    counts = [0] * len(copies)
    for p in range(sizes.prompts_per_step):
        counts[p % len(copies)] += 1
    return max(n * per_group[g] for n, (g, _) in zip(counts, copies)), per_group


def own_fraction(plan, model) -> float:
    """The smallest share of the model's layers one actor device holds (its stage's layers over its tp)."""
    L = max(1, model.num_layers)
    return min((s.layers[1] - s.layers[0]) / L / s.tp for p in plan.pipelines for s in plan.physical_stages(p))


def rl_step(cluster, model, plan, sizes: RLSizes, mode: str, rollout: dict[str, int] | None = None,
            rollout_tp: int = 1, train=None) -> RLStepPrediction:
    """Predict one RL step (module docstring). ``plan``: the actor's plan on ``cluster``; ``mode``:
    ``collocated`` or ``disaggregated``; ``rollout``: devices per rollout group (collocated: the
    groups whose actor devices generate, default all);
    ``train``: the plan's :class:`~.api.Prediction` when the caller has it."""
    from .api import predict

    if train is None:
        train = predict(cluster, model, plan, check=False)
    train_s = train.iteration_time_s
    fits = bool(train.fits_memory)
    used = plan.devices_by_group()
    switch = 0.0
    if mode == "collocated":   # every actor device of the rollout's groups (default: all) generates
        gen_groups = [g for g in used if rollout is None or g in rollout]
        copies = [(g, 1) for g in gen_groups for _ in range(used[g])]
        reserved = {}
        for p in train.pipelines:
            for s in p.stages:
                reserved[s.group] = max(reserved.get(s.group, 0.0), float(s.peak_memory_bytes))
        sync = gen.weight_sync_time(cluster, model, dict(used), dict(used), len(copies), collocated=True,
                                    own_fraction=own_fraction(plan, model))
        # the actor's state stays on the device unless the copy and its cache do not fit beside it
        need = {g: gen.copy_weight_bytes(model) + sizes.group_size * gen.kv_bytes_per_token(model)
                * (sizes.prompt_tokens + sizes.max_new_tokens) for g in used}
        for p in train.pipelines:
            for s in p.stages:
                params = s.memory_breakdown.weights / 4 if s.memory_breakdown is not None else 0.0
                switch = max(switch, gen.context_switch_time(cluster, s.group, model, params, need[s.group]))
        kept = {g: (0.0 if switch > 0 else b) for g, b in reserved.items()}
        rollout_kw = {"reserved": kept}
    else:
        rollout = dict(rollout or {})
        copies = [(g, rollout_tp) for g, n in rollout.items() for _ in range(n // rollout_tp)]
        if not copies:
            raise ValueError("disaggregated: the rollout has no device")
        sync = gen.weight_sync_time(cluster, model, dict(used), rollout, len(copies))
        rollout_kw = {}
    try:
        roll, per_group = rollout_time(cluster, model, sizes, copies, **rollout_kw)
    except ValueError:
        roll, per_group, fits = float("inf"), {}, False
    overlapped = mode == "disaggregated" and sizes.staleness >= 1
    if overlapped:
        step = max(sync.send_s + train_s, sync.transfer_s + sync.receive_s + roll)
    else:
        step = sync.seconds + switch + roll + train_s
    counted: dict[str, int] = {}
    for g, _ in copies:
        counted[g] = counted.get(g, 0) + 1
    return RLStepPrediction(step_s=step, rollout_s=roll, train_s=train_s, sync_s=sync.seconds + switch, sync_send_s=sync.send_s,
                            samples_per_s=sizes.samples / step if step > 0 else 0.0, switch_s=switch, fits=fits,
                            copies=counted, rollout_by_group=per_group, overlapped=overlapped)


__all__ = ["RLSizes", "RLStepPrediction", "rl_step", "rollout_time"]
