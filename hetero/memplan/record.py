"""Record the allocation trace of one stage's training steps, without the memory they take.

The stage is the runtime's own (:class:`hetero.runtime.model.StageModel`), its micro-batches run in
the order the plan's schedule gives that stage (:func:`hetero.runtime.pipeline.schedule_actions`),
under the autocast the runtime uses for the model's dtype, with the runtime's AdamW. Everything runs
on fake tensors (``torch._subclasses.FakeTensorMode``): shapes, dtypes and storages without data, so
a 7B-parameter stage records on a laptop in seconds. A dispatch mode above it notes each new
storage an op returns (an allocation) and the moment its last tensor dies (a free).

What the trace leaves out, and why it is still the step's shape: tensor-parallel collectives (their
buffers are the size of the activations beside them) and kernels' internal workspaces. Modelled
as the runtime allocates them: the receive buffers of pipeline neighbours (an activation per
forward, a gradient per backward) and the data-parallel gradient sum (all the stage's gradients
end to end in one buffer, one bucket; ZeRO's reduce-scatter input and shard outputs): without
tensor parallelism, and unless the stage runs every forward before its first backward, the
gradients are views of that buffer from the first backward on, as in the runtime
(:func:`hetero.predictor.memory.uses_gradient_buffers`), and no copy of them is made.
With ``tp > 1`` the stage holds its local shards (:func:`hetero.runtime.model.tp_shard_dim` says
which dim of which weight). Under ZeRO the AdamW moments cover ``1 / degree`` of each parameter
(:func:`hetero.predictor.memory.zero_degrees`).
"""
from __future__ import annotations

import contextlib
import functools
import weakref

from hetero.memplan.trace import AllocationTrace
from hetero.predictor.allocator import stage_of   # where a physical stage sits: the predictor's, as its replay keys it


class AllocationRecorder:
    """A dispatch mode noting allocations (a storage an op returns for the first time) and frees (a
    weak reference to the storage fires when its last tensor, view or not, dies: torch keeps one
    Python object per storage for as long as the storage lives). ``ignore``: storages (their
    ``_cdata``) that exist already and are not to be counted when an op returns them (in-place
    updates of parameters, say). ``.events`` makes an :class:`AllocationTrace`."""

    def __new__(cls, ignore=()):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ignore = set(ignore)
                self.live: dict[int, weakref.ref] = {}
                self.events: list[tuple[str, int, int]] = []

            def _release(self, key: int, size: int, _ref=None) -> None:
                del self.live[key]
                self.events.append(("free", key, size))

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if not isinstance(t, torch.Tensor):
                        continue
                    st = t.untyped_storage()
                    key = st._cdata   # the storage's identity while it lives (fake storages have no address)
                    if key in self.live or key in self.ignore:
                        continue
                    size = st.nbytes()
                    if size:
                        self.live[key] = weakref.ref(st, functools.partial(self._release, key, size))
                        self.events.append(("alloc", key, size))
                return out

        return _Mode()


def record_stage(model, plan, pipeline: int = 0, stage: int = 0, steps: int = 2, progress=None,
                 fake: bool = True, chunks=None, marks: bool = False,
                 micro_batches: int | None = None) -> AllocationTrace:
    """The allocation trace of physical stage ``stage`` of ``plan``'s pipeline ``pipeline`` over
    ``steps`` training iterations, from building the stage on: its parameters, then per step the
    schedule's forwards and backwards (inputs, activations, gradients), the AdamW step (its moments
    appear in the first) and ``zero_grad`` (gradients set to None, as the runtime does).
    ``progress``: an optional callable ``progress(done, total)`` over the schedule's actions.
    ``fake=False`` runs the same steps on real CPU tensors (small models only: the check that the
    fake run allocates what a real one does). ``chunks``: the stage's layer ranges in place of the
    plan's (fewer layers per chunk: what :mod:`hetero.predictor.allocator` extrapolates from).
    ``micro_batches``: that many micro-batches per step in place of the plan's.
    ``marks``: the events also say which layer each request belongs to, for
    :func:`hetero.memplan.expand.expand_layers` (the format is that module's)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hetero.predictor.memory import gathers_in_bf16, summed_gradients, uses_gradient_buffers, zero_degrees
    from hetero.runtime.engine import AUTOCAST
    from hetero.runtime.grads import make_optimizer
    from hetero.runtime.model import StageModel, backward_loss, loss_fn
    from hetero.runtime.pipeline import schedule_actions

    where = stage_of(plan, pipeline, stage)
    if chunks is not None:
        where["chunks"] = tuple(tuple(c) for c in chunks)
    if micro_batches is not None:
        where["micro_batches"] = micro_batches
    chunks, tp, mbs = where["chunks"], where["tp"], where["micro_batch_size"]
    degree = zero_degrees(model, plan)[pipeline][stage] if plan.zero_stage >= 1 else 1.0
    # which gradients the runtime sums with other ranks: the predictor's rule, so both count one buffer
    summed = summed_gradients(model, tp, where["first"], where["last"], sum(p.replicas for p in plan.pipelines))
    actions = schedule_actions(plan.schedule, stage, where["physical_stages"], where["micro_batches"],
                               where["virtual"])
    # the runtime binds the summed gradients to one buffer before the first backward (same rule)
    buffered = bool(summed) and uses_gradient_buffers(plan, stage, where["physical_stages"], where["micro_batches"],
                                                      where["virtual"])
    autocast = AUTOCAST[model.dtype]
    recorder = AllocationRecorder()
    seq, hidden = model.seq_length, model.hidden_size
    with FakeTensorMode() if fake else contextlib.nullcontext(), recorder, torch.device("cpu"):
        with _marking_construction(recorder.events.append if marks else None, chunks):
            module = StageModel(model, chunks[0], where["first"], where["last"], chunks)
        if marks and tp > 1:   # the whole weights the local shards replace are their layer's too
            _own_layers(module, list(module.parameters()), None, recorder.events.append, hooks=False)
        _take_local_shards(module, tp)
        module.set_recompute(plan.recompute)
        params = list(module.parameters())
        if plan.zero_stage >= 1 and (degree > 1 or tp > 1):
            # ZeRO: AdamW updates 1/degree of every parameter (its moments that size): a view of the
            # parameters' flat buffer, or a copy under tp (DTensor shards cannot share a buffer) and
            # for a bf16 model (its fp32 master: the parameters hold the bf16 gather's values)
            copy = tp > 1 or gathers_in_bf16(model.dtype, plan.zero_stage)
            shards = [p.detach().reshape(-1)[: -(-p.numel() // int(round(degree)))] for p in params]
            shards = [torch.nn.Parameter(s.clone() if copy else s) for s in shards]
            optimizer = make_optimizer(shards, 1e-4, 0.0)
        else:
            shards, optimizer = None, make_optimizer(params, 1e-4, 0.0)
        note = recorder.events.append if marks else None
        owners = _own_layers(module, params, shards, note)
        agg = _layer_bytes(params, owners) if note and (summed == "all" or shards is not None) else 0
        last_chunk = len(chunks) - 1
        done, total = 0, steps * len(actions)
        for _ in range(steps):
            saved, bound = {}, None
            for kind, mb, chunk in actions:
                if progress is not None:
                    progress(done, total)
                done += 1
                first, last = where["first"] and chunk == 0, where["last"] and chunk == last_chunk
                if kind == "F":
                    if first:
                        x = torch.zeros(mbs, seq, dtype=torch.long)
                    else:   # the activation received from the previous stage (fp32)
                        x = torch.empty(mbs, seq, hidden).requires_grad_(True)
                    with _autocast(autocast):
                        out = module(x, chunk)
                    if last:
                        out = loss_fn(out, torch.zeros(mbs, seq, dtype=torch.long))
                    else:
                        out = out.float()
                    saved[(chunk, mb)] = (x, out)
                    del x, out
                else:
                    if buffered and bound is None:   # hetero.runtime.grads.bind_gradient_buffers
                        bound = params if summed == "all" or shards is not None else [module.wte.weight]
                        _note(note, ("agg", agg if len(bound) > 1 else 0))
                        flat, at = torch.zeros(sum(p.numel() for p in bound)), 0
                        _note(note, ("agg", None))
                        for p in bound:
                            p.grad = flat[at: at + p.numel()].view_as(p)
                            at += p.numel()
                        del flat
                    x, out = saved.pop((chunk, mb))
                    if last:
                        backward_loss(out)
                    else:   # the gradient received from the next stage
                        out.backward(torch.empty(mbs, seq, hidden))
                    del x, out
            if shards is not None and bound is not None:   # ZeRO on bound buffers: the reduce-scatter's
                for sh, owner in zip(shards, owners):       # input is the gradients' own storage
                    _note(note, ("seg", owner, 1))
                    sh.grad = torch.empty(sh.numel())
                    _note(note, ("seg", owner, -1))
                for p in params:
                    p.grad = None
            elif shards is not None:   # ZeRO (hetero.runtime.zero): gradients laid end to end, each
                grads = [p.grad for p in params]   # shard's gradient its slice of the reduced buffer
                for p in params:
                    p.grad = None
                _note(note, ("agg", agg))
                flat = torch.cat([g.reshape(-1) for g in grads])
                _note(note, ("agg", None))
                at = 0
                for sh, g, owner in zip(shards, grads, owners):
                    _note(note, ("seg", owner, 1))
                    sh.grad = flat[at: at + sh.numel()].clone()
                    _note(note, ("seg", owner, -1))
                    at += g.numel()
                del grads, flat, g
            elif summed and bound is None:   # the gradient sum (hetero.runtime.grads): one buffer, summed back
                group = params if summed == "all" else [module.wte.weight]
                _note(note, ("agg", agg if summed == "all" else 0))
                flat = torch.cat([p.grad.reshape(-1) for p in group])
                _note(note, ("agg", None))
                at = 0
                for p in group:
                    p.grad.view(-1).copy_(flat[at: at + p.numel()])
                    at += p.numel()
                del flat, group
            optimizer.step()
            if note:   # AdamW's moments appear in the first step: they belong to their parameter's layer
                for p, owner in zip(shards or params, owners):
                    for t in optimizer.state.get(p, {}).values():
                        if owner is not None and isinstance(t, torch.Tensor):
                            note(("own", t.untyped_storage()._cdata, owner))
            optimizer.zero_grad(set_to_none=True)
            module.zero_grad(set_to_none=True)
        if progress is not None:
            progress(total, total)
        events = list(recorder.events)   # what stays live (parameters, moments) lives to the end
    return AllocationTrace(events, source=f"recorded: pipeline {pipeline} stage {stage} "
                                                   f"({where['group']}, tp {tp}), {steps} steps")


@contextlib.contextmanager
def _marking_construction(note, chunks):
    """With ``note``, each block's construction (its weights, RoPE's tables and their temporaries)
    is a segment of its layer: StageModel builds its blocks in the order of its chunks' layers."""
    if note is None:
        yield
        return
    from hetero.runtime.model import Block

    layers = iter([i for a, b in chunks for i in range(a, b)])
    init = Block.__init__

    def marked(self, *args, **kwargs):
        layer = next(layers)
        note(("seg", layer, 1))
        init(self, *args, **kwargs)
        note(("seg", layer, -1))

    Block.__init__ = marked
    try:
        yield
    finally:
        Block.__init__ = init


def _note(note, event) -> None:
    if note is not None:
        note(event)


def _own_layers(module, params, shards, note, hooks: bool = True) -> list:
    """The layer of each parameter (None: embedding, head, final norm); with ``note``, mark each
    parameter's (and ZeRO shard copy's) storage as its layer's and every block's forward and
    backward as a segment of its layer (hetero.memplan.expand reads these marks)."""
    owners = [int(n.split(".")[1]) if n.startswith("layers.") else None for n, _ in module.named_parameters()]
    if note is None:
        return owners
    for tensors in (params, shards or ()):
        for t, owner in zip(tensors, owners):
            if owner is not None:
                note(("own", t.untyped_storage()._cdata, owner))
    for name, t in module.named_buffers():   # RoPE's tables: one pair per block
        if name.startswith("layers."):
            note(("own", t.untyped_storage()._cdata, int(name.split(".")[1])))
    for name, block in module.layers.items() if hooks else ():
        block.register_forward_pre_hook(functools.partial(_enter, note, int(name)))
        block.register_forward_hook(functools.partial(_leave, note, int(name)))
    return owners


def _enter(note, layer, _module, args):
    # a block's forward opens its segment; the gradient of its input closes its backward
    note(("seg", layer, 1))
    if args and getattr(args[0], "requires_grad", False):
        args[0].register_hook(lambda _g: note(("seg", layer, -1)))


def _leave(note, layer, _module, _args, out):
    note(("seg", layer, -1))
    if getattr(out, "requires_grad", False):
        out.register_hook(lambda _g: note(("seg", layer, 1)))


def _layer_bytes(params, owners) -> int:
    """fp32 bytes of one layer's parameters (every layer of a stage is alike)."""
    layer = next((o for o in owners if o is not None), None)
    return 4 * sum(p.numel() for p, o in zip(params, owners) if o == layer) if layer is not None else 0


def _autocast(dtype):
    import torch

    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _take_local_shards(module, tp: int) -> None:
    """Replace every weight tensor parallelism splits by this rank's shard (dim from
    :func:`tp_shard_dim`): the attention reads its head count from the projections' widths, so the
    stage then computes at a tp rank's shapes."""
    import torch

    from hetero.runtime.model import tp_shard_dim

    if tp == 1:
        return
    for name, p in list(module.named_parameters()):
        dim = tp_shard_dim(name)
        if dim is None:
            continue
        shape = list(p.shape)
        shape[dim] = -(-shape[dim] // tp)   # rank 0's shard: DTensor's Shard puts the remainder first
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        setattr(owner, name.rsplit(".", 1)[-1], torch.nn.Parameter(torch.empty(shape, dtype=p.dtype)))
