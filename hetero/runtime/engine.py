"""The native engine: one rank's stage, its tp sharding, its schedule, gradient sync and AdamW."""
from __future__ import annotations

import math
import sys
import time

import torch

from hetero.memplan.serve import mark_phase
from hetero.runtime.data import data_source, replica_slice
from hetero.runtime.context import RunContext
from hetero.runtime.device import waiter
from hetero.runtime.grads import (bind_gradient_buffers, build_buckets, clip_coefficient, make_optimizer, scaled_step,
                                  sync_gradients, weighted_squares)
from hetero.runtime.loss_scale import DEFAULT_INITIAL_SCALE, DynamicLossScale
from hetero.runtime.lr_schedule import set_lr
from hetero.runtime.model import apply_tensor_parallel, build_stage, compile_blocks, loss_sum
from hetero.runtime.expert_parallel import apply_expert_parallel, build_expert_stage
from hetero.runtime.moe import finish_step, set_aux_scale
from hetero.runtime.pipeline import StageExecutor, Timings, schedule_actions, stage_peers, timed

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class NativeEngine:
    """Hand-written pipeline (1F1B / GPipe / interleaved), DTensor TP inside the stage, holder-set
    gradient sync; an :class:`~hetero.runtime.engine_api.Engine`."""

    name = "native"
    loss_fn = staticmethod(loss_sum)
    """The last stage's loss of one micro-batch, ``loss_fn(logits, targets)``: the SUM of its token losses
    (the token cross-entropy over the targets that carry loss), which the engine divides by the step's
    loss tokens, ``source.loss_tokens(step * global_batch, global_batch)``; a trainer of another
    objective sets its own on the instance (``hetero rl``: the GRPO loss) with a source that counts its
    tokens."""

    def __init__(self, ctx: RunContext, comm, stage: tuple | None = None):
        """``stage``: (module, optimizer) already built and holding their state (an in-process elastic
        reshard, :mod:`hetero.runtime.elastic.reconfig`), tp-sharded on this rank's mesh; None: built
        here from the seed."""
        self.ctx, self.comm = ctx, comm
        me, model, opts = ctx.me, ctx.model, ctx.options
        if ctx.plan.zero_stage >= 2 and me.rank == 0:
            print(f"note: zero_stage {ctx.plan.zero_stage}: the native engine shards AdamW state over each "
                  f"parameter's holders and frees the full gradients after reducing them, but holds them whole "
                  f"through the step's backward passes (use --engine deepspeed for bucketed ZeRO-2)",
                  file=sys.stderr, flush=True)
        self.device = ctx.device
        # Built on the CPU (the same seeded initialisation as every other plan and the reference),
        # then moved to the rank's device before it is sharded and the optimizer sees it.
        if stage is not None:
            self.module = stage[0]
        elif ctx.parallel.experts is not None:   # its own routed experts only, never the others
            self.module = build_expert_stage(model, ctx.plan, me, opts.seed).to(self.device)
        else:
            self.module = build_stage(model, me.layers, ctx.first, ctx.last, opts.seed,
                                      me.chunk_layers(ctx.plan)).to(self.device)
        if ctx.parallel.experts is not None:   # this rank's routed experts only, exchanged over its groups
            apply_expert_parallel(self.module, ctx.parallel.experts, me.rank, comm)
        self.module.set_recompute(ctx.plan.recompute)
        compile_on = opts.compile if opts.compile is not None else self.device.type != "cpu"
        self.mesh = ctx.parallel.tp_mesh(comm, self.device.type)
        if self.mesh is not None and stage is None:
            apply_tensor_parallel(self.module, self.mesh)
        self.compiled = compile_blocks(self.module) if compile_on else 0
        """How many transformer blocks run under torch.compile (0: eager)."""
        self.holders = ctx.parallel.holders
        # a bucket whose holders share one tp degree sums (ZeRO: shards) over tp-rank peers
        # ... cut to about 25 MB each in reverse module order (the order the backward finishes them)
        self.buckets = build_buckets(self.holders, [n for n, _ in self.module.named_parameters()], me.rank,
                                     ctx.layout, sizes={n: p.numel() for n, p in self.module.named_parameters()},
                                     cap_bytes=int(opts.bucket_mb * 2**20))
        self.sharded = None
        """ZeRO (``zero_stage >= 1``): AdamW state sharded over each holder set (:mod:`hetero.runtime.zero`)."""
        if ctx.plan.zero_stage >= 1:
            from hetero.runtime.zero import ShardedAdamW

            # a bf16 model all-gathers bf16 values over fp32 masters (Megatron's distributed optimizer)
            self.sharded = ShardedAdamW(self.module, self.buckets, comm, rank=me.rank, tp_size=me.tp_size,
                                        lr=opts.lr, weight_decay=opts.weight_decay,
                                        gather_dtype=torch.bfloat16 if model.dtype == "bf16" else None)
            self.optimizer = self.sharded.optimizer
        elif stage is not None:
            self.optimizer = stage[1]
        else:
            self.optimizer = make_optimizer(self.module.parameters(), opts.lr, opts.weight_decay)
        self.mbs = ctx.plan.mbs(ctx.pipeline)
        self.slice = replica_slice(ctx.plan, me.pipeline, me.replica)
        self.actions = schedule_actions(ctx.plan.schedule, me.stage, ctx.num_physical, ctx.pipeline.micro_batches,
                                        ctx.plan.virtual_chunks(ctx.pipeline))
        from hetero.predictor.memory import uses_gradient_buffers

        self.gradient_buffers = uses_gradient_buffers(ctx.plan, me.stage, ctx.num_physical, ctx.pipeline.micro_batches,
                                                      ctx.plan.virtual_chunks(ctx.pipeline))
        """Summed gradients as views of one buffer per holder set, bound before the first backward."""
        peers = [stage_peers(ctx.layout, me, k, ctx.num_stages) for k in ctx.vstages]
        self.executor = StageExecutor(self.module, comm, peers, first=ctx.first, last=ctx.last,
                                      act_shape=(self.mbs, model.seq_length, model.hidden_size),
                                      slowdown=ctx.slowdown, autocast_dtype=AUTOCAST[model.dtype],
                                      device=self.device)
        self._buffers: dict = {}
        self.reducer = self._overlapped_reduction() if opts.overlap else None
        """Buckets reduced under the backward (:mod:`hetero.runtime.overlap`); None: after the schedule."""
        if self.sharded and opts.overlap:   # ZeRO's parameter all-gathers run under the next forward
            self.module.before_use = self.sharded.wait_parameters
            self.executor.comm_wait = lambda: self.sharded.wait_s
        self.source = data_source(model.vocab_size, model.seq_length, opts.seed, opts.data, opts.tokenizer)
        """Samples by global index: ``batch(first, count)`` and ``loss_tokens(first, count)``
        (:mod:`hetero.runtime.data`)."""
        self.scaler = (DynamicLossScale(opts.loss_scale or DEFAULT_INITIAL_SCALE) if model.dtype == "fp16" else None)
        self.step_loss_scale: float | None = None
        """The loss scale the last step ran with (fp16), else None."""
        self.step_skipped = False
        """Whether the last step's update was skipped (fp16 gradient overflow on some rank)."""
        self.step_moe: tuple[float, int] = (0.0, 0)
        """MoE models: this rank's part of the last step's aux loss term and its dropped token assignments
        (:func:`hetero.runtime.moe.finish_step`; summed over the ranks by the trainer)."""

    def train_step(self, step: int, timings: Timings) -> tuple[float, float]:
        """One iteration (0-based ``step``): :meth:`forward_backward`, :meth:`reduce_gradients`,
        :meth:`optimizer_step`; returns (this rank's loss share, global grad norm).
        fp16: the loss is scaled for backward and the gradients unscaled before clipping; when any
        rank's gradients overflowed (the all-reduced norm is not finite) every rank skips the update."""
        S = self.scaler.scale if self.scaler else 1.0
        self.zero_grad()
        self.comm.async_log = []
        with timings.span("schedule_s"):
            loss = self.forward_backward(step, timings=timings, loss_scale=S)
        # the trace's measured step holds what the predicted one does: the gradient sync (with the
        # norm's all-reduce) and the optimizer after the schedule
        with timings.span("sync_s", event="S"):
            mark_phase(1)   # the planned allocator resynchronises at the gradient sync
            norm, finite = self.reduce_gradients(timings)
            if self.ctx.model.moe is not None:
                # every rank, with no reduction in flight (balance: bias sums the expert loads over the world)
                self.step_moe = finish_step(self.module, self.ctx.model, self.comm,
                                            self.mbs / self.ctx.plan.global_batch_size)
        if finite:
            self.optimizer_step(norm, timings=timings, loss_scale=S)
        else:
            self.zero_grad()
        if self.scaler:
            self.step_loss_scale, self.step_skipped = S, not finite
            self.scaler.update(finite)
        reported = loss / S if (self.ctx.last and self.ctx.me.tp_rank == 0) else 0.0
        return reported, norm

    def forward_backward(self, step: int, *, timings: Timings, loss_scale: float) -> float:
        """Run this rank's schedule of the step's micro-batches (activations and gradients to and from the
        neighbouring stages; with overlap, buckets reduced as the backward finishes them); returns the
        sum of its scaled micro-batch losses (the last stage's, else 0): each its summed token losses over
        the step's loss tokens, so the replicas' sums add up to the global batch's mean."""
        B = self.ctx.plan.global_batch_size
        cache: dict[int, tuple] = {}

        def batch(mb):
            if mb not in cache:
                tokens, targets = self.source.batch(*self.slice.sample_range(step, B, mb))
                cache[mb] = tokens.to(self.device), targets.to(self.device)
            return cache[mb]

        if self.ctx.model.moe is not None:   # each micro-batch's aux term, weighted as its share of the batch
            set_aux_scale(self.module, loss_scale * self.mbs / B)

        def bind() -> None:
            if self.sharded:
                self.sharded.bind_gradient_buffers()
            else:
                self._buffers.update(bind_gradient_buffers(self.module, self.buckets))

        return self.executor.run(self.actions, get_inputs=lambda mb: batch(mb)[0],
                                 get_targets=lambda mb: batch(mb)[1], loss_fn=self.loss_fn,
                                 loss_scale=loss_scale / max(1, self.source.loss_tokens(step * B, B)),
                                 timings=timings,
                                 before_backward=bind if self.gradient_buffers else None, reducer=self.reducer)

    def reduce_gradients(self, timings: Timings) -> tuple[float, bool]:
        """Sum every gradient over the ranks holding its parameter (ZeRO: each its slice), then the
        global norm over all ranks; returns (norm, whether it is finite: fp16 unscaled first).
        The norm pass's compute is counted with the optimizer step, where the predictor charges it."""
        if self.sharded:   # the last step's parameter all-gathers, waited for under this step's forward
            self.settle()
            for p, asked, got in self.sharded.gathered:   # the gather, and where the forward waited for it
                timings.events += [("G", int(p.label[1:]), p.started, max(0.0, p.finished - p.started)),
                                   ("W", int(p.label[1:]), asked, got - asked)]
            self.sharded.gathered.clear()
        buffers = self._buffers
        if self.reducer is not None:   # wait for the buckets started under the backward, start the rest
            grads = self.reducer.finish({})
            grads = self.sharded.owned_locals(grads) if self.sharded else {k: v for k, v in grads.items() if v}
        elif self.sharded:
            grads = self.sharded.reduce_gradients()
        else:
            grads = sync_gradients(self.module, self.buckets, self.holders, self.comm, self.ctx.me.tp_size, buffers)
        buffers.clear()   # the gradients keep their buffer alive until zero_grad sets them to None
        timings.events.extend(("R", i, p.started, max(0.0, (p.finished or time.time()) - p.started))
                              for i, p in enumerate(self.comm.async_log))
        self.comm.async_log = None
        # The norm pass reads every gradient: device compute, slowed like the rest.
        sq, _, norm_s = timed(lambda: weighted_squares(grads), self.ctx.slowdown, waiter(self.device))
        timings.sync_s -= norm_s
        timings.optimizer_s += norm_s
        total = self.comm.all_reduce(torch.tensor([sq], dtype=torch.float64))
        norm, finite = math.sqrt(float(total[0])), True
        if self.scaler:
            norm, finite = self.scaler.unscale(norm)
        return norm, finite

    def optimizer_step(self, norm: float, *, timings: Timings, loss_scale: float) -> None:
        """AdamW on this rank's parameters, the gradients clipped by the global ``norm`` and unscaled;
        ZeRO: then every holder's updated slices gathered (communication: counted with the sync)."""
        def step():
            params = self.sharded.params() if self.sharded else self.module
            coef = clip_coefficient(norm, self.ctx.options.clip) / loss_scale
            if self.sharded:
                self.sharded.coef = coef   # a shadow of a peer's slice takes the same factor
            scaled_step(self.optimizer, params, coef)

        _, t_opt, seconds = timed(step, self.ctx.slowdown, waiter(self.device))
        timings.optimizer_s += seconds
        timings.events.append(("O", -1, t_opt, seconds))
        if self.sharded:   # communication: counted with the gradient sync
            with timings.span("sync_s"):
                # with overlap: started, and completed under the next step's forward (tp 1: into the
                # parameters' own vector, no copy held meanwhile; not across vendors)
                self.sharded.gather_parameters(
                    (lambda s: s.flat is not None and not self.comm.crosses_vendors(s.ranks))
                    if self.reducer is not None else None)
                self.sharded.gathered.clear()   # those gathered at once are the sync's

    def _overlapped_reduction(self):
        """The :class:`~hetero.runtime.overlap.OverlappedReduction` of this rank's buckets: the plain
        sum's all-reduces, or ZeRO's reduce-scatters."""
        from hetero.runtime.grads import begin_bucket
        from hetero.runtime.overlap import OverlappedReduction, chunk_of_params

        params = dict(self.module.named_parameters())
        tp = self.ctx.me.tp_size
        if self.sharded:
            def begin(bucket, label):
                shard = self.sharded.shard_of(bucket)
                return self.sharded.begin_reduce(shard, label) if shard is not None else (lambda out: None)
        else:
            def begin(bucket, label):
                return begin_bucket(bucket, params, self.holders, self.comm, tp, self._buffers, label)
        return OverlappedReduction(self.module, self.buckets, begin, chunk_of_params(self.module),
                                   lambda b: self.comm.crosses_vendors(b.peers or b.ranks))

    def settle(self) -> None:
        """Complete ZeRO's parameter all-gathers still in flight (before anything reads the parameters
        outside the forward: a checkpoint, an evaluation, the end of a run)."""
        if self.sharded:
            self.sharded.wait_parameters()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next step, on every parameter group (ZeRO: of the sharded masters)."""
        set_lr(self.optimizer, lr)

    def zero_grad(self) -> None:
        if self.sharded:
            self.sharded.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state_bytes(self) -> int:
        """Bytes of AdamW state this rank keeps (moments and step counters; ZeRO: its slices)."""
        from hetero.runtime.zero import optimizer_state_bytes

        return self.sharded.state_bytes() if self.sharded else optimizer_state_bytes(self.optimizer)

    # checkpoint hooks
    def save(self, path: str, step: int) -> None:
        from hetero.runtime.checkpoint import save_checkpoint

        self.settle()
        save_checkpoint(path, self.module, self.sharded or self.optimizer, self.holders, self.ctx.rank, step,
                        loss_scale=self.scaler.scale if self.scaler else None)

    def load(self, path: str) -> int:
        from hetero.hf import hf_dir_of
        from hetero.runtime.checkpoint import load_checkpoint

        self.settle()
        if hf_dir_of(path) is not None:   # a Hugging Face folder: this rank's slices of its weights, step 0
            from hetero.hf.weights import load_stage_weights

            load_stage_weights(hf_dir_of(path), self.module, self.ctx.model)
            if self.sharded:   # the masters that are copies take the loaded weights
                self.sharded.retake_masters()
            return 0
        step = load_checkpoint(path, self.module, self.sharded or self.optimizer,
                               num_layers=self.ctx.model.num_layers)
        if self.scaler:
            from hetero.runtime.checkpoint import saved_loss_scale

            saved = saved_loss_scale(path)
            if saved is not None and self.ctx.options.loss_scale is None:  # an explicit --loss-scale wins
                self.scaler.scale = saved
        return step
