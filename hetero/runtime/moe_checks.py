"""What this runtime refuses to run for a mixture-of-experts model, checked before any process starts.

Torch-free, so the launcher checks a plan without importing torch (the MoE layers themselves are
:mod:`hetero.runtime.moe`).
"""
from __future__ import annotations

from hetero.errors import HeteroError
from hetero.specs.model import ModelSpec


def check_moe_run(plan, model: ModelSpec, engine: str) -> None:
    """Refuse, before any process starts, what this runtime does not run for an MoE model: tensor
    parallelism of a stage holding MoE layers, expert parallelism with ZeRO, and the DeepSpeed engine
    (whose loss has no aux term)."""
    ep = getattr(plan, "expert_parallel", None)
    if ep is not None and ep.degree > 1:   # the rest: hetero.runtime.expert_parallel.check_supported
        refuse_zero_with_experts(plan)
    if model.moe is None:
        return
    if engine == "deepspeed":
        raise HeteroError(f"--engine deepspeed: model {model.name} is a mixture of experts, whose aux loss and "
                          f"expert biases the native engine trains (fix: --engine native)")
    for i, pipeline in enumerate(plan.pipelines):
        for j, stage in enumerate(pipeline.stages):
            moe = [layer for layer in range(*stage.layers) if model.is_moe_layer(layer)]
            if stage.tp > 1 and moe:
                raise HeteroError(f"pipelines[{i}].stages[{j}]: tp {stage.tp} with MoE layers {moe}: tensor "
                                  f"parallelism of mixture-of-experts layers is not supported (fix: tp 1 on the "
                                  f"stages holding MoE layers)")


def refuse_zero_with_experts(plan) -> None:
    """Expert parallelism with ZeRO is not run: say so, naming the field and the fix."""
    if plan.zero_stage:
        raise HeteroError(f"plan: expert_parallel with zero_stage {plan.zero_stage} is not supported "
                          f"(fix: zero_stage: 0, or drop expert_parallel)")
