"""``--engine deepspeed``: DeepSpeed ZeRO-0/1/2 over the plan's data-parallel group.

Limit: plans whose pipelines have ONE stage with tp 1 (pure data parallelism, ZeRO inside the
data-parallel group). DeepSpeed's PipelineEngine expects one process group for the whole pipe and
identical stage shapes on every replica, which plans with uneven stages across vendors break; use
``--engine native`` for pipeline or tensor parallelism.

Pipelines may differ in micro-batch count and size. Every micro-batch loss is its summed token
losses over the step's loss tokens (:mod:`hetero.runtime.data`), times the data-parallel size for
backward (DeepSpeed averages gradients over the group), so the update is the single-device one.
DeepSpeed's accumulation boundary is set by hand on each
rank's last micro-batch; ZeRO-2 reduces on every micro-step, so with unequal micro-batch counts the
shorter pipelines run zero-weighted padding micro-batches to keep the collectives matched.
The deepspeed accelerator is forced to ``cpu`` (``DS_ACCELERATOR``) on CPU-only machines.
"""
from __future__ import annotations

import math
import os
import sys

from hetero.errors import HeteroError
from hetero.runtime.data import data_source, replica_slice
from hetero.runtime.grads import make_optimizer
from hetero.runtime.lr_schedule import set_lr
from hetero.runtime.model import build_stage, loss_sum
from hetero.runtime.pipeline import timed


def check_deepspeed_plan(plan) -> None:
    """Raise HeteroError unless every pipeline is one stage of tp 1 and deepspeed is importable."""
    for i, p in enumerate(plan.pipelines):
        if len(p.stages) != 1 or p.stages[0].tp != 1:
            raise HeteroError(
                f"pipelines[{i}]: --engine deepspeed runs plans with one stage of tp 1 per pipeline (pure data "
                f"parallelism with ZeRO {plan.zero_stage}); this pipeline has {len(p.stages)} stage(s), "
                f"tp {[s.tp for s in p.stages]}: use --engine native for pipeline / tensor parallelism")
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise HeteroError(f"--engine deepspeed: deepspeed is not installed ({e}); pip install deepspeed") from None


class PlanMPU:
    """DeepSpeed's ``mpu`` interface over the plan's groups: data-parallel = all ranks holding the
    stage (here: the world), model-parallel = the rank alone."""

    def __init__(self, comm, dp_ranks: list[int], rank: int, self_group):
        self.comm, self.dp_ranks, self.rank, self.self_group = comm, dp_ranks, rank, self_group

    def get_data_parallel_group(self):
        return self.comm.group(self.dp_ranks)

    def get_data_parallel_world_size(self):
        return len(self.dp_ranks)

    def get_data_parallel_rank(self):
        return self.dp_ranks.index(self.rank)

    def get_model_parallel_group(self):
        return self.self_group

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0


class DeepSpeedEngine:
    """Pure data parallelism with DeepSpeed ZeRO over the world (see the module docstring); an
    :class:`~hetero.runtime.engine_api.Engine`."""

    name = "deepspeed"
    step_loss_scale = None
    """No dynamic loss scale: fp16 models train in fp32 here (see ``__init__``)."""
    step_skipped = False

    def __init__(self, ctx, comm):
        import torch.distributed as dist

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        check_deepspeed_plan(ctx.plan)
        self.ctx, self.comm = ctx, comm
        model, plan, opts = ctx.model, ctx.plan, ctx.options
        # singleton model-parallel groups: created by every rank, in rank order
        self_groups = [dist.new_group([r]) for r in range(ctx.layout.world_size)]
        dp_ranks = list(range(ctx.layout.world_size))
        import importlib

        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # (attribute access would give torch)
        # DeepSpeed's CPU shared-memory allreduce is a JIT-built C++ op (minutes to compile) that
        # would also bypass the plan's process groups: stay on the torch.distributed groups.
        ds_torch_comm.build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        module = build_stage(model, (0, model.num_layers), True, True, opts.seed)
        module.set_recompute(plan.recompute)
        self.mbs = plan.mbs(ctx.pipeline)
        config = {
            "train_micro_batch_size_per_gpu": self.mbs,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(plan.zero_stage)},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if opts.clip and opts.clip > 0:
            config["gradient_clipping"] = opts.clip
        if model.dtype == "bf16":
            config["bf16"] = {"enabled": True}
        elif model.dtype == "fp16" and ctx.rank == 0:
            print("note: the deepspeed engine trains this fp16 model in fp32 (no DeepSpeed fp16 optimizer on "
                  "CPU); the native engine runs fp16 autocast with dynamic loss scaling", file=sys.stderr, flush=True)
        # DeepSpeed's ZeRO and bf16 optimizers step this optimizer's parameter groups (their flat
        # partitions replace the parameters in the same group dicts): its rate is the one applied
        self.optimizer = make_optimizer(module.parameters(), opts.lr, opts.weight_decay)
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=self.optimizer, config=config,
            mpu=PlanMPU(comm, dp_ranks, ctx.rank, self_groups[ctx.rank]))
        self.dp = len(dp_ranks)
        self.slice = replica_slice(plan, ctx.me.pipeline, ctx.me.replica)
        self.micro_batches = ctx.pipeline.micro_batches
        counts = {p.micro_batches for p in plan.pipelines}
        self.padded = max(counts) if (plan.zero_stage >= 2 and len(counts) > 1) else self.micro_batches
        self.source = data_source(model.vocab_size, model.seq_length, opts.seed, opts.data, opts.tokenizer)

    def _compute(self, fn, timings, kind, mb):
        out, wall, dt = timed(fn, self.ctx.slowdown)
        (timings.forward_s if kind == "F" else timings.backward_s).append(dt)
        timings.events.append((kind, mb, wall, dt))
        return out

    def train_step(self, step: int, timings) -> tuple[float, float]:
        B = self.ctx.plan.global_batch_size
        per_token = 1.0 / max(1, self.source.loss_tokens(step * B, B))
        total = 0.0
        for mb in range(self.padded):
            real = mb < self.micro_batches
            x, y = self.source.batch(*self.slice.sample_range(step, B, min(mb, self.micro_batches - 1)))
            self.engine.set_gradient_accumulation_boundary(mb == self.padded - 1)
            weight = per_token if real else 0.0
            loss = self._compute(lambda: loss_sum(self.engine(x), y), timings, "F", mb)
            total += float(loss.detach()) * weight
            self._compute(lambda: self.engine.backward(loss * (weight * self.dp)), timings, "B", mb)
        # DeepSpeed's step includes its gradient reduction
        _, _, timings.optimizer_s = timed(self.engine.step, self.ctx.slowdown)
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else math.nan
        return total, norm

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next step, on every parameter group."""
        set_lr(self.optimizer, lr)

    def optimizer_state_bytes(self) -> int | None:
        """None: not measured (DeepSpeed's ZeRO optimizer keeps its state in flat buffers of its own)."""
        return None

    def save(self, path: str, step: int) -> None:
        self.engine.save_checkpoint(path, tag=f"step{step}", client_state={"step": step})

    def load(self, path: str) -> int:
        _, client = self.engine.load_checkpoint(path)
        return int((client or {}).get("step", 0))
