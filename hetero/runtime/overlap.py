"""Gradient reduction overlapped with the backward pass.

A rank's gradients are summed bucket by bucket (:mod:`hetero.runtime.grads`: by holder set, then
cut to about 25 MB in reverse module order). Without overlap every bucket is reduced once the
rank's part of the pipeline schedule is done. With it, as DDP, FSDP and Megatron do, a bucket's
collective starts the moment the step's last backward through its parameters has finished their
gradients, and runs while the backward goes on through the earlier layers:

* each parameter has a post-accumulate-grad hook; before the last backward pass of each model
  chunk (the last micro-batch of that chunk in the rank's schedule) the chunk is *armed*, and a
  parameter whose gradient is then accumulated is final;
* buckets start in the agreed order (:func:`hetero.runtime.grads.build_buckets`), each as soon as
  it and every bucket before it are final, so every rank of a group issues its collectives in the
  same order whatever order its hooks fire in; each is asynchronous (the plain sum's all-reduce,
  ZeRO's reduce-scatter), and the step waits for all of them before the gradient norm;
* a bucket whose holders span vendors is summed hierarchically through the host bridge, on the
  unified communicator's ordered worker thread, and any point-to-point operation issued after it
  waits behind it; a peer of the same pipeline that still needs this rank's activation or gradient
  would then wait for a collective that waits for it. So such a bucket starts only once this rank
  has issued its last point-to-point operation of the step (at once for a one-stage pipeline; during
  the last backward for a first stage), still asynchronously;
* a bucket of holders at several tp degrees gathers full tensors inside its tp group (a
  collective of its own) and starts after the schedule, in order.

ZeRO's all-gather of the updated parameters, after the optimizer, is overlapped with the next
step's forward instead (:meth:`hetero.runtime.zero.ShardedAdamW.gather_parameters`).

What the overlap hides and what stays exposed is what the predictor models
(:meth:`hetero.predictor.placement.SyncPlan.spans`).
"""
from __future__ import annotations

from hetero.runtime.grads import Bucket


class OverlappedReduction:
    """One rank's buckets, started from backward hooks (see the module docstring).

    ``begin(bucket, label)`` starts a bucket's collective and returns ``finish(out)``, which
    completes it into ``out`` (the plain sum's :func:`~hetero.runtime.grads.begin_bucket`, or ZeRO's
    :meth:`~hetero.runtime.zero.ShardedAdamW.begin_reduce`). ``chunk_of``: parameter name -> the
    model chunk whose backward finishes it. ``bridged``: whether a bucket crosses vendors."""

    def __init__(self, module, buckets: list[Bucket], begin, chunk_of: dict[str, int], bridged):
        self.buckets = list(buckets)
        self.begin = begin
        self.chunk_of = chunk_of
        self.bridged = [bool(bridged(b)) for b in self.buckets]
        self.after_schedule = [b.chunks is not None for b in self.buckets]
        self._armed: set[int] = set()
        self._ready: set[str] = set()
        self._gate_open = False
        self._next = 0
        self._finishes: list = []
        self._in_schedule = False
        params = dict(module.named_parameters())
        for bucket in self.buckets:
            for name in bucket.names:
                params[name].register_post_accumulate_grad_hook(lambda p, name=name: self._accumulated(name))

    # ------------------------------------------------------------------ the schedule's calls
    def start_step(self, p2p: bool) -> None:
        """A new step; ``p2p``: whether this rank exchanges activations or gradients in it."""
        self._armed.clear()
        self._ready.clear()
        self._next = 0
        self._finishes = []
        self._gate_open = not p2p
        self._in_schedule = True

    def arm(self, chunk: int) -> None:
        """The next backward pass of ``chunk`` is its last of the step: the gradients it accumulates are final."""
        self._armed.add(chunk)

    def p2p_done(self) -> None:
        """This rank has issued its last point-to-point operation of the step."""
        self._gate_open = True
        self._start_ready()

    def _accumulated(self, name: str) -> None:
        if self._in_schedule and self.chunk_of.get(name, -1) in self._armed:
            self._ready.add(name)
            self._start_ready()

    def _start_ready(self) -> None:
        while self._next < len(self.buckets):
            i, bucket = self._next, self.buckets[self._next]
            if self.after_schedule[i] or (self.bridged[i] and not self._gate_open):
                return
            if any(n not in self._ready for n in bucket.names):
                return
            self._start(i)

    def _start(self, i: int) -> None:
        self._next = i + 1
        self._finishes.append(self.begin(self.buckets[i], f"R{i}"))

    # ------------------------------------------------------------------ the end of the schedule
    def finish(self, out: dict) -> dict:
        """Start every bucket not started yet (in order), then wait for all of them into ``out``."""
        self._in_schedule = False
        while self._next < len(self.buckets):
            self._start(self._next)
        for fin in self._finishes:
            fin(out)
        self._finishes = []
        return out


def chunk_of_params(module) -> dict[str, int]:
    """Parameter name -> the model chunk of a :class:`~hetero.runtime.model.StageModel` whose backward
    finishes its gradient (-1: used by two chunks, finished only when the schedule is)."""
    last = len(module.chunks) - 1
    out = {}
    for name, _ in module.named_parameters():
        top = name.split(".", 1)[0]
        if top == "layers":
            layer = int(name.split(".")[1])
            out[name] = next(c for c, (a, b) in enumerate(module.chunks) if a <= layer < b)
        elif top in ("wte", "wpe"):
            both = top == "wte" and module.first and module.last and last > 0
            out[name] = -1 if both else (0 if module.first else last)
        else:   # final norm, head
            out[name] = last
    return out


__all__ = ["OverlappedReduction", "chunk_of_params"]
