"""ZeRO-1 for the native engine: AdamW state sharded over each parameter's holder set.

Without sharding every holder of a parameter (:mod:`hetero.runtime.grads`) all-reduces its
gradient and runs the same AdamW update, so each keeps the full moments: 8 bytes per parameter.
With ``zero_stage >= 1`` the parameters of one holder set are laid end to end in one flat fp32
vector, padded to ``k`` equal slices for the ``k`` ranks it is sharded over, and each rank owns
one slice:

1. the gradients are reduce-scattered, so each rank gets the summed gradient of its slice;
2. the squared global norm is the sum over ranks of |slice gradient|^2, each element weighed by
   1 / (the number of ranks that own a copy of it);
3. one AdamW step updates every rank's slice (its moments exist for the slice only);
4. the updated slices are all-gathered back into every holder's parameters: at once, or with
   overlap started asynchronously and waited for when the next step's forward first uses each
   submodule (:meth:`ShardedAdamW.gather_parameters`), except across vendors, where a gather on the
   host bridge's ordered thread would hold up the forward's point-to-point operations behind it,
   and at tp > 1, where the gathered vector is a copy that would be held until the forward.

Which ranks, which tensors. As in the plain sync (:mod:`hetero.runtime.grads`):
- every holder at one tp degree (replicas of one stage shape, Megatron's data parallelism; tp 1
  included): each rank lays end to end its OWN tensors (a tp rank's local shards, and its copy
  of the tensors replicated over the tp group) and shards them over its tp-rank peers
  (``Bucket.peers``; the whole holder set at tp 1). This is Megatron-LM's distributed optimizer:
  1/tp of the volume of a full-tensor sum, and no tp gather. A replicated tensor's elements are
  owned once per tp rank, so they weigh 1/tp in the norm;
- holders of different tp degrees: the full tensors (a tp gather first), each divided by its
  rank's tp size, are sharded over the whole holder set, and after the all-gather each parameter
  takes back its own shard.

Where the slice lives. At tp 1 the parameters are re-bound as views into the holder set's flat
buffer, and an fp32 / fp16 model's AdamW updates a view of its slice: no master copy. A tp rank's
parameters are DTensors, whose storage is not re-bound, so its slice is a copy (4 / k more bytes
per parameter it holds), written back into the parameters after the all-gather.

What is gathered. fp32 and fp16 models gather the fp32 slices. A bf16 model (``gather_dtype``
bf16) gathers bf16 values, as Megatron-LM's distributed optimizer gathers its bf16 model
parameters while the fp32 main parameters stay sharded: each rank sends its updated slice cast to
bf16 into a bf16 vector (2 bytes a parameter instead of 4: half the all-gather's bytes), and once
it has arrived the values are upcast into the fp32 parameters. Every holder's parameters, the
rank's own slice included, then hold the bf16-rounded values, so the replicas stay identical, and
the forward's autocast would have rounded them to bf16 for its matrix products anyway; what it
changes is the operations autocast keeps in fp32 (norm weights, the embedding lookup), which
see the rounded weights, as Megatron's bf16 parameters are. The slice AdamW updates must stay the
exact fp32 value, so at tp 1 it becomes a copy too (the fp32 master: 4 / k bytes per parameter),
as it is at tp > 1. This holds for every all-gather of a bf16 model: deferred or at once (with
``--no-overlap`` as with overlap: overlap changes when the gather runs, not the numbers), at tp >
1, and across vendors (hetero.comm's bridge carries bf16). Checkpoints write the masters, not the
rounded parameters (:meth:`ShardedAdamW.full_state`); after a checkpoint with optimizer state is
loaded the parameters are rounded again, as the step that saved it left them.

Volume. Where the library reduce-scatters natively (NCCL, HCCL inside one vendor), a
reduce-scatter and an all-gather move what a ring all-reduce moves, so the communication volume
is that of the unsharded step. Gloo (plain torch.distributed) and hetero.comm across vendors (a
hierarchical all-reduce, of which each rank keeps its slice) reduce-scatter by all-reducing the
whole vector, so there the all-gather comes on top of the unsharded step's volume. AdamW state
per rank drops from 8 to 8 / k bytes per parameter held, the saving the predictor charges.

Gradients (ZeRO-2's saving) are freed right after the reduce-scatter, but they are held whole
through the backward passes of the step: a holder set's reduce-scatter starts once the step's last
backward has finished its gradients (:mod:`hetero.runtime.overlap`), or once the schedule is done. At
tp 1 they are views of one buffer per holder set, bound before the first backward (as the plain
sum's, :func:`hetero.runtime.grads.bind_gradient_buffers`), and that buffer is the reduce-scatter's
input: no end-to-end copy of them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from hetero.runtime.grads import (Bucket, copy_full_into, full_tensor, is_shard, local_gradient, local_part,
                                  make_optimizer, shard_like)


@dataclass
class _Shard:
    """One holder set's parameters on this rank, and the slice of them this rank updates."""

    bucket: Bucket
    params: list
    ranks: tuple[int, ...]
    """The ranks the flat vector is sharded over: the tp-rank peers (own tensors), or the holder
    set (full tensors); see the module docstring."""
    shapes: list[torch.Size]
    """Shapes laid end to end, in bucket order: local ones (own tensors), or full (global) ones."""
    slice_len: int
    """Elements per rank: ``ceil(elements / k)``; the flat vector is padded to ``k * slice_len``."""
    index: int
    """This rank's place in :attr:`ranks` (ascending rank order)."""
    master: torch.Tensor
    """The slice AdamW updates: a view into ``flat`` (tp 1, fp32 gather) or a copy (tp > 1, or a
    ``low`` gather)."""
    low: torch.dtype | None = None
    """The dtype the updated slices are all-gathered in (bf16), or None: fp32."""
    flat: torch.Tensor | None = None
    """tp 1: the parameters' own storage (every parameter is a view into it)."""
    offsets: list[int] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    """Per tensor: how many ranks own a copy of each of its elements (the norm's weight): 1, or the
    tp size for a tensor replicated over the tp group (own tensors only)."""
    grad_flat: torch.Tensor | None = None
    """tp 1, between the step's first backward and the reduce-scatter: the gradients' own storage
    (:meth:`ShardedAdamW.bind_gradient_buffers`), laid out as :attr:`flat` is."""
    keep_source: int | None = None
    """The place in :attr:`ranks` of a peer whose slice's summed gradient this rank keeps too (an
    elastic run's shadow of that peer's slice, :mod:`hetero.runtime.elastic.slice_copies`): the
    reduction then all-reduces the whole vector, as Gloo's reduce-scatter does anyway."""
    source_grad: torch.Tensor | None = None
    """That peer's slice of the summed gradient (a view of the reduced vector, host memory), from the
    reduction to the update."""

    @property
    def own(self) -> bool:
        """Whether the flat vector holds this rank's own tensors (tp-rank peers), not full ones."""
        return self.bucket.peers is not None

    @property
    def span(self) -> tuple[int, int]:
        lo = self.index * self.slice_len
        return lo, lo + self.slice_len

    @property
    def padded(self) -> int:
        """Length of the flat vector: ``k`` slices."""
        return len(self.ranks) * self.slice_len

    def end_to_end(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``tensors`` (one per parameter, shaped as :attr:`shapes`) flattened end to end in fp32,
        zero-padded to :attr:`padded`."""
        parts = [t.float().reshape(-1) for t in tensors]
        pad = self.padded - self.offsets[-1]
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.float32, device=parts[0].device))
        return torch.cat(parts)

    def pieces(self, flat: torch.Tensor):
        """(parameter, its part of ``flat`` shaped as :attr:`shapes`) for every parameter."""
        for p, shape, lo, hi in zip(self.params, self.shapes, self.offsets, self.offsets[1:]):
            yield p, flat[lo:hi].view(shape)

    def weighed(self, owned: torch.Tensor) -> dict[int, list[torch.Tensor]]:
        """This rank's slice ``owned`` cut where its tensors meet, by :attr:`copies` (the form
        :func:`hetero.runtime.grads.weighted_squares` takes)."""
        lo, hi = self.span
        out: dict[int, list[torch.Tensor]] = {}
        for copies, a, b in zip(self.copies, self.offsets, self.offsets[1:]):
            a, b = max(a, lo), min(b, hi)
            if a < b:
                out.setdefault(copies, []).append(owned[a - lo:b - lo])
        return out


class ShardedAdamW:
    """The native engine's optimizer with ZeRO-1 (see module docstring). ``optimizer`` is the plain
    torch AdamW over every slice and every parameter this rank holds alone."""

    def __init__(self, module, buckets: list[Bucket], comm, rank: int, tp_size: int, lr: float,
                 weight_decay: float, gather_dtype: torch.dtype | None = None):
        """``gather_dtype``: torch.bfloat16 for a bf16 model (the all-gathers move bf16 values, and
        every slice keeps its fp32 master; module docstring), else None (fp32 gathers)."""
        self.module, self.comm, self.tp_size = module, comm, tp_size
        params = dict(module.named_parameters())
        self.local: list = []
        """Parameters held by this rank alone (no holder set to shard over)."""
        self.shards: list[_Shard] = []
        device = next(module.parameters()).device
        for bucket in buckets:
            ps = [params[n] for n in bucket.names]
            if len(bucket.ranks) == 1 and tp_size == 1:
                self.local.extend(ps)
                continue
            own = bucket.peers is not None
            ranks = bucket.peers if own else bucket.ranks
            # DTensor.shape is the global shape; its local shard's is what the peers line up
            shapes = [local_part(p).shape if own else p.shape for p in ps]
            offsets = [0]
            for s in shapes:
                offsets.append(offsets[-1] + math.prod(s))
            copies = [1 if not own or is_shard(p) else tp_size for p in ps]
            shard = _Shard(bucket, ps, ranks, shapes, -(-offsets[-1] // len(ranks)), ranks.index(rank),
                           master=torch.empty(0), low=gather_dtype, offsets=offsets, copies=copies)
            with torch.no_grad():
                if tp_size == 1:
                    flat = torch.zeros(shard.padded, dtype=torch.float32, device=device)
                    for p, view in shard.pieces(flat):
                        view.copy_(p.detach())
                        p.data = view
                    shard.flat = flat
                    shard.master = flat[slice(*shard.span)]
                    if shard.low is not None:   # the parameters will hold rounded values
                        shard.master = shard.master.clone()
                else:
                    shard.master = self._flat_params(shard)[slice(*shard.span)].clone()
            self.shards.append(shard)
        self.optimizer = make_optimizer([s.master for s in self.shards] + self.local, lr, weight_decay)
        self._gathers: dict[int, object] = {}
        """Shard index -> ``finish()`` of its parameter all-gather, started and not yet waited for."""
        self._users: dict[str, list[int]] = {}
        """Submodule name (``layers.<i>``, ``wte``, ...) -> the shards holding its parameters."""
        for i, shard in enumerate(self.shards):
            for name in shard.bucket.names:
                parts = name.split(".")
                key = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
                if i not in self._users.setdefault(key, []):
                    self._users[key].append(i)
        self.wait_s = 0.0
        """Seconds waited for parameter all-gathers so far (not compute: an emulated device does
        not slow them, :func:`hetero.runtime.pipeline.timed`)."""
        self.gathered: list = []
        """The all-gathers waited for since the caller last emptied this list, for the trace: (its
        :class:`~hetero.runtime.collectives.Pending`, when the wait began, when it ended)."""

    # ------------------------------------------------------------------ a step
    def bind_gradient_buffers(self) -> None:
        """tp 1: each holder set's gradients as views of one zeroed buffer laid out (and padded) as
        its parameters' flat vector, bound before the step's first backward: the reduce-scatter then
        takes the buffer itself, with no end-to-end copy of the gradients
        (:func:`hetero.runtime.grads.bind_gradient_buffers`, the plain sum's twin)."""
        for shard in self.shards:
            if shard.flat is None or any(p.grad is not None for p in shard.params):
                continue
            grad_flat = torch.zeros(shard.padded, dtype=torch.float32, device=shard.flat.device)
            for p, view in shard.pieces(grad_flat):
                p.grad = view
            shard.grad_flat = grad_flat

    def reduce_gradients(self) -> dict[int, list[torch.Tensor]]:
        """Reduce-scatter every holder set's gradients into this rank's slices and free the full
        gradients; returns the gradients this rank owns by the number of ranks owning a copy, the
        form :func:`hetero.runtime.grads.weighted_squares` takes."""
        owned: dict[int, list[torch.Tensor]] = {}
        for shard in self.shards:
            self.begin_reduce(shard)(owned)
        return self.owned_locals(owned)

    def owned_locals(self, owned: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """``owned`` with the gradients of the parameters this rank holds alone added (after every
        shard's reduction has finished)."""
        owned.setdefault(1, []).extend(p.grad.detach() for p in self.local if p.grad is not None)
        return {k: v for k, v in owned.items() if v}

    def shard_of(self, bucket: Bucket) -> _Shard | None:
        """The shard of ``bucket`` (None for a bucket of parameters this rank holds alone)."""
        return next((s for s in self.shards if s.bucket is bucket), None)

    def begin_reduce(self, shard: _Shard, label: str = ""):
        """Start reduce-scattering one holder set's gradients into this rank's slice (asynchronously)
        and free the full gradients; returns ``finish(owned)``, which waits for it and records the
        slice in ``owned`` (see :meth:`reduce_gradients`)."""
        flat, shard.grad_flat = shard.grad_flat, None
        if flat is not None and all(p.grad is not None and p.grad._base is flat for p in shard.params):
            for p in shard.params:
                p.grad = None
            return self._reduce_scatter(shard, flat, label)   # the gradients' own buffer: no copy
        del flat
        grads = []
        for p in shard.params:
            if shard.own:
                grads.append(local_gradient(p)[0].detach())
            else:
                grads.append(full_tensor(p.grad if p.grad is not None else torch.zeros_like(p)).detach())
            p.grad = None
        flat = shard.end_to_end(grads)
        del grads
        if not shard.own and self.tp_size > 1:
            flat.div_(self.tp_size)   # the tp copies of one replica add up to one full gradient
        return self._reduce_scatter(shard, flat, label)

    def _reduce_scatter(self, shard: _Shard, flat: torch.Tensor, label: str = ""):
        """``flat`` (the holder set's gradients end to end) reduce-scattered into this rank's slice;
        all-reduced whole in place where :attr:`_Shard.keep_source` asks for a peer's slice too, and
        where the holders span vendors: the communicator's reduce-scatter across vendors is a
        hierarchical all-reduce of a copy of ``flat`` (hetero.comm), so summing ``flat`` itself is
        the same sum without the copy (docs/benchmarks.md has the figures)."""
        keep = shard.keep_source
        if keep is None and not self.comm.crosses_vendors(shard.ranks):
            out = torch.empty(shard.slice_len, dtype=torch.float32, device=flat.device)
            pending = self.comm.reduce_scatter_async(out, flat, shard.ranks, label)
        else:   # one summed vector, alike on every member: this rank's slice and its source's are views
            # of it until the update (the whole gradient was held through the backward, whose peak
            # this does not raise)
            out = flat[slice(*shard.span)]
            pending = self.comm.all_reduce_async(flat, shard.ranks, label)

        def finish(owned: dict) -> None:
            pending.wait()
            if keep is not None:
                shard.source_grad = flat[keep * shard.slice_len:(keep + 1) * shard.slice_len]
            shard.master.grad = out
            for copies, parts in shard.weighed(out).items():
                owned.setdefault(copies, []).extend(parts)
        return finish

    def params(self) -> list:
        """What the AdamW step updates (for scaling their gradients)."""
        return [s.master for s in self.shards] + self.local

    def gather_parameters(self, later=None) -> None:
        """All-gather the updated slices into every holder's parameters (after the AdamW step).

        ``later`` (a predicate on a :class:`_Shard`, or None): the shards it accepts are only started,
        asynchronously and in forward order (the reverse of the buckets' agreed order, so every
        group's members issue them in one order), and completed when the next forward first uses
        their parameters (:meth:`wait_parameters`, from :attr:`StageModel.before_use`), as
        Megatron-LM's ``overlap_param_gather`` does. The others are gathered at once, first. Either
        way each moves its shard's dtype (:attr:`_Shard.low`: bf16 for a bf16 model), so overlap
        decides when the values arrive, never what they are."""
        with torch.no_grad():
            deferred = [i for i, s in enumerate(self.shards) if later is not None and later(s)]
            for i, shard in enumerate(self.shards):
                if i not in deferred:
                    self._begin_gather(shard, "")()
            for i in reversed(deferred):
                self._gathers[i] = self._begin_gather(self.shards[i], f"G{i}")

    def _begin_gather(self, shard: _Shard, label: str):
        """Start all-gathering ``shard``'s updated slice into its parameters (in ``shard.low``, then
        upcast; module docstring); returns ``finish()``."""
        if shard.low is not None:
            part = shard.master.detach().to(shard.low)
            into = torch.empty(shard.padded, dtype=shard.low, device=part.device)
        else:
            part = shard.master.detach().clone()   # an input must not alias the output it gathers into
            into = None
        flat = shard.flat if shard.flat is not None else torch.empty(shard.padded, dtype=torch.float32,
                                                                     device=part.device)
        pending = self.comm.all_gather_into_async(flat if into is None else into, part, shard.ranks, label)
        del part

        def finish() -> None:
            asked = time.time()
            pending.wait()
            got = time.time()
            self.gathered.append((pending, asked, got))
            self.wait_s += got - asked
            if into is not None:   # the bf16 values into the fp32 parameters (or the tp vector)
                with torch.no_grad():
                    flat.copy_(into)
            if shard.flat is None:   # tp > 1: the parameters are DTensors, not views of the vector
                with torch.no_grad():
                    for p, value in shard.pieces(flat):
                        if shard.own:
                            local_part(p).copy_(value)
                        else:
                            copy_full_into(p, value)
        return finish

    def wait_parameters(self, module: str | None = None) -> None:
        """Complete the started all-gathers of the parameters of submodule ``module`` (``layers.3``,
        ``wte``, ...; None: of every parameter). Anything that reads the parameters outside the
        forward (the next step's gradient sync, checkpoints, the end of a run) waits for all first."""
        if not self._gathers:
            return
        for i in list(self._gathers) if module is None else self._users.get(module, ()):
            finish = self._gathers.pop(i, None)
            if finish is not None:
                finish()

    coef: float = 1.0
    """The factor of the last update's gradients (clipping, an fp16 unscale): a shadow of a peer's
    slice is updated with it (:mod:`hetero.runtime.elastic.slice_copies`)."""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for shard in self.shards:
            shard.grad_flat = None
            shard.source_grad = None
            for p in shard.params:
                p.grad = None

    def state_bytes(self) -> int:
        """Bytes of AdamW state on this rank (moments and step counters), plus the masters' copies
        (tp > 1, or a bf16 gather)."""
        return optimizer_state_bytes(self.optimizer) + sum(s.master.numel() * 4 for s in self.shards
                                                           if s.flat is None or s.low is not None)

    # ------------------------------------------------------------------ checkpoints
    def full_state(self, keep=None) -> dict[str, dict[str, torch.Tensor]]:
        """Parameter name -> its full AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``), as the
        unsharded optimizer would hold it, for the names ``keep`` accepts (default: every name), as
        host copies; a collective over every holder set (all ranks call it, whatever they keep).
        Where the parameters hold bf16-rounded values (a bf16 gather, module docstring) it also has
        ``param``: the exact fp32 value, gathered from the masters, which a checkpoint writes.

        One gathered moment of one holder set is on the device at a time: the full states of every
        parameter this rank holds, gathered together, would be the unsharded state again (a tp
        rank's, that of all its tp ranks together), as the checkpoint is written."""
        self.wait_parameters()
        keep = keep or (lambda name: True)
        out: dict[str, dict[str, torch.Tensor]] = {}
        names = {id(p): n for n, p in self.module.named_parameters()}
        for shard in self.shards:
            st = self.optimizer.state.get(shard.master, {})
            if "exp_avg" not in st:
                continue   # no step taken yet: every holder alike
            kept = {name for name in shard.bucket.names if keep(name)}
            for name in kept:
                out[name] = {"step": torch.as_tensor(st["step"]).to("cpu", copy=True)}
            slices = {k: st[k].detach() for k in ("exp_avg", "exp_avg_sq")}
            if shard.low is not None:
                slices["param"] = shard.master.detach()
            for key, part in slices.items():
                flat = torch.empty(shard.padded, dtype=torch.float32, device=shard.master.device)
                self.comm.all_gather_into(flat, part, shard.ranks)   # no alias of flat
                for name, (p, value) in zip(shard.bucket.names, shard.pieces(flat)):
                    # own tensors: a tp gather, which every tp rank joins whatever it keeps
                    full = _whole_like(p, value) if shard.own else value
                    if name in kept:
                        out[name][key] = full.to("cpu", copy=True)
                del flat
        for p in self.local:
            st = self.optimizer.state.get(p, {})
            if "exp_avg" in st and keep(names[id(p)]):
                out[names[id(p)]] = {k: torch.as_tensor(st[k]).to("cpu", copy=True)
                                     for k in ("exp_avg", "exp_avg_sq", "step")}
        return out

    def load_full_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take this rank's slices of full per-parameter states (a checkpoint's) and re-take the
        masters from the parameters just loaded (tp ranks of a stage call it together); where the
        gather is bf16 and the checkpoint has the holder set's optimizer state, the parameters then
        take the bf16-rounded values, as after the step that saved it."""
        self.wait_parameters()
        names = {id(p): n for n, p in self.module.named_parameters()}
        with torch.no_grad():
            self.retake_masters()
            for shard in self.shards:
                if not all(n in states for n in shard.bucket.names):
                    continue
                if shard.low is not None:
                    for p in shard.params:
                        local_part(p).copy_(local_part(p).to(shard.low))
                lo, hi = shard.span
                st = {}
                for key in ("exp_avg", "exp_avg_sq"):
                    fulls = [states[name][key] for name in shard.bucket.names]
                    if shard.own:   # this rank's part of each (no communication)
                        fulls = [local_part(shard_like(p, f.to(shard.master.device)))
                                 for p, f in zip(shard.params, fulls)]
                    st[key] = shard.end_to_end(fulls)[lo:hi].to(shard.master.device, copy=True)
                st["step"] = states[shard.bucket.names[0]]["step"].to(shard.master.device, copy=True)
                self.optimizer.state[shard.master] = st
            for p in self.local:
                s = states.get(names[id(p)])
                if s is not None:
                    self.optimizer.state[p] = {"step": s["step"].to(p.device, copy=True),
                                               "exp_avg": s["exp_avg"].to(p.device, copy=True),
                                               "exp_avg_sq": s["exp_avg_sq"].to(p.device, copy=True)}

    def retake_masters(self) -> None:
        """Copy the parameters into the masters that are copies (tp > 1, a bf16 gather): after the
        parameters were written from outside the optimizer (a checkpoint, a model's weights).
        A gather inside the tp group for a shard of full tensors: tp ranks call it together."""
        self.wait_parameters()
        with torch.no_grad():
            for shard in self.shards:
                if shard.flat is None:
                    shard.master.copy_(self._flat_params(shard)[slice(*shard.span)])
                elif shard.low is not None:
                    shard.master.copy_(shard.flat[slice(*shard.span)])

    @staticmethod
    def _flat_params(shard: _Shard) -> torch.Tensor:
        """The shard's parameters end to end, padded: this rank's own tensors, or the full ones (a
        gather inside the tp group)."""
        return shard.end_to_end([local_part(p.detach()) if shard.own else full_tensor(p.detach())
                                 for p in shard.params])


def _whole_like(p, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's part laid out as parameter ``p`` (a gather
    inside ``p``'s tp group for a DTensor), else ``local``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride()).full_tensor()


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` on this rank (a DTensor counts its local shard)."""
    total = 0
    for st in optimizer.state.values():
        for t in st.values():
            if torch.is_tensor(t):
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
    return total
