"""The worker's one door to communication: collectives and point-to-point over rank subsets.

Every collective and send/recv of the worker goes through :class:`Collectives`, so moving to the
project's unified communicator (``hetero.comm``: vendor libraries inside a vendor, a host bridge
between vendors) is a change in this file only.

With ``hetero.comm`` installed (the default; ``HETERO_RUNTIME_COMM=torch`` opts out) collectives
and send/recv go through its :class:`~hetero.comm.Communicator` built from the per-rank vendor
tags: flat inside a vendor, hierarchical across vendors over the Gloo host bridge. Otherwise they
run on plain ``torch.distributed`` (Gloo on CPU). Torch process groups over the same subsets are
kept for the libraries that need one (DTensor meshes, DeepSpeed). Process groups for rank subsets are created
up front by :meth:`Collectives.create_groups`: every rank passes the same list (derived from the
shared rank layout), so ``new_group`` is called in the same order everywhere. Errors carry the
peer ranks and their place in the plan, so a timeout names who did not answer.

Devices. A rank computing on an accelerator hands its tensors over where they live. With the
unified communicator they go to its vendor library as they are (NCCL takes CUDA tensors), and
across vendors the communicator stages them through host memory; a CPU tensor (a step's metrics)
is moved to the rank's device first, since a vendor library takes its own device's tensors only.
On plain ``torch.distributed`` every group is Gloo, so device tensors are staged through the host
here. DTensor meshes over accelerator ranks get groups of the vendor library
(:meth:`Collectives.mesh_group`), since DTensor's collectives run on the mesh's group.
"""
from __future__ import annotations

import copy
import datetime
import os
import time
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from hetero.errors import HeteroError, clip, lost_connection


class CommError(HeteroError):
    """A collective or p2p operation failed or timed out; the message names the peers."""


class Pending:
    """A collective in flight (:meth:`Collectives.all_reduce_async`): :meth:`wait` completes it,
    with the peers named on failure. ``started`` and ``finished`` (wall-clock seconds; ``finished``
    None until the library reports completion) place it on a step's timeline."""

    def __init__(self, comms: "Collectives", what: str, ranks: tuple[int, ...], work, label: str = "",
                 after: Callable[[], object] | None = None):
        self.comms, self.what, self.ranks, self.work, self.label, self.after = comms, what, ranks, work, label, after
        self.started = time.time()
        self.finished: float | None = None if work is not None else self.started
        if comms.async_log is not None:
            comms.async_log.append(self)
        if work is not None:
            try:
                work.add_done_callback(self._done) if hasattr(work, "add_done_callback") else \
                    work.get_future().add_done_callback(self._done)
            except (RuntimeError, AttributeError):   # a library without futures: the wait stamps it
                pass

    def _done(self, _=None) -> None:
        self.finished = time.time()

    def wait(self) -> None:
        if self.work is not None:
            self.comms._run(self.work.wait, self.what, self.ranks)
            self.work = None
            if self.finished is None:
                self.finished = time.time()
        if self.after is not None:
            self.after()
            self.after = None


class Collectives:
    def __init__(self, rank: int, world_size: int, timeout_s: float, describe: Callable[[int], str] = str,
                 device: torch.device | None = None, device_types: list[str] | None = None):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.describe = describe
        self.device = torch.device("cpu") if device is None else torch.device(device)
        """Where this rank's tensors live."""
        self.device_types = list(device_types) if device_types else ["cpu"] * world_size
        """The torch device type of every rank (known alike on every rank)."""
        self._groups: dict[tuple[int, ...], object] = {}
        self._mesh_groups: dict[tuple[int, ...], object] = {}
        self._hgroups: dict[tuple[int, ...], object] = {}
        self._pending: list = []
        self.hc = None  # the hetero.comm Communicator, when used
        self.async_log: list | None = None
        """When a list, every asynchronous collective started (:class:`Pending`) is appended to it
        (a step's gradient reductions, for the trace)."""

    # ------------------------------------------------------------------ setup
    @classmethod
    def init(cls, rank: int, world_size: int, timeout_s: float, describe=str, backend: str = "gloo",
             vendors: list[str] | None = None, device: torch.device | None = None,
             device_types: list[str] | None = None) -> "Collectives":
        """``init_process_group`` from the launcher's environment (MASTER_ADDR/PORT), explicit rank.
        ``device``: this rank's (default CPU); ``device_types``: every rank's device type."""
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self = cls(rank, world_size, timeout_s, describe, device=device, device_types=device_types)
        # Collectives on their own group; the default group carries only p2p traffic.
        self._groups[tuple(range(world_size))] = dist.new_group(list(range(world_size)))
        if vendors and os.environ.get("HETERO_RUNTIME_COMM", "hetero") != "torch":
            try:
                from hetero.comm import Communicator
            except ImportError:
                Communicator = None
            if Communicator is not None:
                self.hc = Communicator.from_vendors(list(vendors), bridge="gloo", timeout=timeout_s,
                                                    device=self.device)
                self._hgroups[tuple(range(world_size))] = self.hc.world
        return self

    def create_groups(self, rank_sets: Iterable[Iterable[int]], mesh_sets: Iterable[Iterable[int]] = ()) -> None:
        """Create a process group for every subset (same list, same order, on every rank), and for each
        of ``mesh_sets`` (DTensor meshes) whose ranks compute on an accelerator, a group of that
        device's library."""
        for ranks in sorted({tuple(sorted(r)) for r in rank_sets if len(tuple(r)) > 1}):
            if ranks not in self._groups:
                self._groups[ranks] = dist.new_group(list(ranks))
                if self.hc is not None:
                    self._hgroups[ranks] = self.hc.new_group(list(ranks))
        for ranks in sorted({tuple(sorted(r)) for r in mesh_sets if len(tuple(r)) > 1}):
            kinds = {self.device_types[r] for r in ranks}
            if len(kinds) > 1:
                raise RuntimeError(f"a DTensor mesh over ranks {list(ranks)} mixes devices {sorted(kinds)}")
            kind = kinds.pop()
            if kind != "cpu" and ranks not in self._mesh_groups:
                from hetero.comm.vendors import backend_for

                self._mesh_groups[ranks] = dist.new_group(list(ranks), backend=backend_for(kind))

    def group(self, ranks: Iterable[int]):
        key = tuple(sorted(ranks))
        if key not in self._groups:
            raise RuntimeError(f"no process group for ranks {list(key)}: add it to create_groups")
        return self._groups[key]

    def mesh_group(self, ranks: Iterable[int]):
        """The group a DTensor mesh over ``ranks`` runs its collectives on: the vendor library's on an
        accelerator (created by :meth:`create_groups`' ``mesh_sets``), else the Gloo group."""
        key = tuple(sorted(ranks))
        return self._mesh_groups.get(key) or self.group(key)

    # ------------------------------------------------------------------ devices
    def _there(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where the library that carries it takes it (itself when it is there already):
        the rank's device with the unified communicator, the host on plain (Gloo) torch.distributed."""
        dev = self.hc.device if self.hc is not None else torch.device("cpu")
        return tensor if tensor.device == dev else tensor.to(dev)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, ranks: Iterable[int] | None = None, op: str = "sum") -> torch.Tensor:
        ranks = tuple(sorted(ranks)) if ranks is not None else tuple(range(self.world_size))
        if len(ranks) <= 1:
            return tensor
        t = self._there(tensor)
        if self.hc is not None:
            self._run(lambda: self.hc.all_reduce(t, op=op, group=self._hgroups[ranks]), "all_reduce", ranks)
        else:
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            self._run(lambda: dist.all_reduce(t, op=red, group=self.group(ranks)), "all_reduce", ranks)
        if t is not tensor:
            tensor.copy_(t)
        return tensor

    # ------------------------------------------------------------------ asynchronous collectives
    def crosses_vendors(self, ranks: Iterable[int]) -> bool:
        """Whether a collective over ``ranks`` runs hierarchically through the host bridge (the
        unified communicator's worker thread, which later point-to-point operations queue behind)."""
        key = tuple(sorted(ranks))
        return self.hc is not None and len(key) > 1 and self._hgroups[key].hierarchical

    def all_reduce_async(self, tensor: torch.Tensor, ranks: Iterable[int], label: str = "") -> "Pending":
        """Start summing ``tensor`` in place over ``ranks``; the returned :class:`Pending` completes it."""
        ranks = tuple(sorted(ranks))
        if len(ranks) <= 1:
            return Pending(self, "all_reduce", ranks, None, label)
        t = self._there(tensor)
        if self.hc is not None:
            work = self.hc.all_reduce(t, group=self._hgroups[ranks], async_op=True)
        else:
            work = dist.all_reduce(t, group=self.group(ranks), async_op=True)
        return Pending(self, "all_reduce", ranks, work, label, (lambda: tensor.copy_(t)) if t is not tensor else None)

    def reduce_scatter_async(self, output: torch.Tensor, flat: torch.Tensor, ranks: Iterable[int],
                             label: str = "") -> "Pending":
        """Start summing ``flat`` over ``ranks`` into ``output``, the i-th of ``len(ranks)`` equal slices, i this
        rank's place among them in ascending order (ZeRO's gradient reduction); the returned
        :class:`Pending` completes it."""
        ranks = tuple(sorted(ranks))
        if len(ranks) <= 1:
            output.copy_(flat)
            return Pending(self, "reduce_scatter", ranks, None, label)
        out, inp = self._there(output), self._there(flat)
        if self.hc is not None:
            work = self.hc.reduce_scatter(out, inp, group=self._hgroups[ranks], async_op=True)
        else:
            work = dist.reduce_scatter_tensor(out, inp, group=self.group(ranks), async_op=True)
        return Pending(self, "reduce_scatter", ranks, work, label,
                       (lambda: output.copy_(out)) if out is not output else None)

    def all_gather_into_async(self, flat: torch.Tensor, part: torch.Tensor, ranks: Iterable[int],
                              label: str = "") -> "Pending":
        """Start gathering every rank's ``part`` into ``flat`` (see :meth:`all_gather_into`); the
        returned :class:`Pending` completes it."""
        ranks = tuple(sorted(ranks))
        if len(ranks) <= 1:
            flat.copy_(part.reshape(flat.shape))
            return Pending(self, "all_gather", ranks, None, label)
        out, inp = self._there(flat), self._there(part)
        if self.hc is not None:
            work = self.hc.all_gather_into_tensor(out, inp, group=self._hgroups[ranks], async_op=True)
        else:
            work = dist.all_gather_into_tensor(out, inp, group=self.group(ranks), async_op=True)
        return Pending(self, "all_gather", ranks, work, label, (lambda: flat.copy_(out)) if out is not flat else None)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor, ranks: Iterable[int]) -> list[torch.Tensor]:
        """``parts[i]`` gets the ``tensor`` of the i-th of ``ranks`` in ascending order (all the same
        size); a single rank copies its own."""
        ranks = tuple(sorted(ranks))
        if len(ranks) <= 1:
            parts[0].copy_(tensor)
            return parts
        t = self._there(tensor)
        out = [self._there(p) for p in parts]
        if self.hc is not None:
            self._run(lambda: self.hc.all_gather(out, t, group=self._hgroups[ranks]), "all_gather", ranks)
        else:
            self._run(lambda: dist.all_gather(out, t, group=self.group(ranks)), "all_gather", ranks)
        for p, o in zip(parts, out):
            if o is not p:
                p.copy_(o)
        return parts

    def all_gather_into(self, flat: torch.Tensor, part: torch.Tensor, ranks: Iterable[int]) -> torch.Tensor:
        """``flat`` (``len(ranks)`` x ``part.numel()`` elements, contiguous) gets every rank's ``part`` in
        ascending rank order (ZeRO's parameter gather, the inverse of :meth:`reduce_scatter_async`'s split):
        :meth:`all_gather_into_async`, waited for."""
        self.all_gather_into_async(flat, part, ranks).wait()
        return flat

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], ranks: Iterable[int]) -> torch.Tensor:
        """Rows of ``tensor`` to each of ``ranks`` (ascending order): ``input_splits[i]`` rows to the i-th,
        ``output`` gets ``output_splits[j]`` rows from the j-th (across vendors through the bridge with
        the unified communicator); returns ``output``."""
        ranks = tuple(sorted(ranks))
        if len(ranks) <= 1:
            return output.copy_(tensor)
        out, inp = self._there(output), self._there(tensor)
        if self.hc is not None:
            self._run(lambda: self.hc.all_to_all_single(out, inp, output_splits, input_splits,
                                                        group=self._hgroups[ranks]), "all_to_all", ranks)
        else:
            self._run(lambda: dist.all_to_all_single(out, inp.contiguous(), output_splits, input_splits,
                                                     group=self.group(ranks)), "all_to_all", ranks)
        if out is not output:
            output.copy_(out)
        return output

    def all_gather_object(self, obj, ranks: Iterable[int] | None = None) -> list:
        ranks = tuple(sorted(ranks)) if ranks is not None else tuple(range(self.world_size))
        out = [None] * len(ranks)
        self._run(lambda: dist.all_gather_object(out, obj, group=self.group(ranks)), "all_gather", ranks)
        return out

    def barrier(self, ranks: Iterable[int] | None = None) -> None:
        ranks = tuple(sorted(ranks)) if ranks is not None else tuple(range(self.world_size))
        if len(ranks) > 1:
            self._run(lambda: dist.barrier(group=self.group(ranks)), "barrier", ranks)

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Asynchronous send; completed by :meth:`wait_sends` (or the next step). Messages between
        two ranks with the same ``tag`` arrive in the order sent; different tags do not mix."""
        t = self._there(tensor).contiguous()
        if self.hc is not None:
            self._pending.append((self.hc.send(t, dst, tag=tag, async_op=True), dst))
            return
        self._pending.append((dist.isend(t, dst, tag=tag), dst))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        t = self._there(tensor)
        if self.hc is not None:
            self._run(lambda: self.hc.recv(t, src, tag=tag), "recv", (src,))
        else:
            self._run(lambda: dist.recv(t, src, tag=tag), "recv", (src,))
        if t is not tensor:
            tensor.copy_(t)
        return tensor

    def wait_sends(self, sends: list | None = None) -> None:
        """Complete the sends in flight (or ``sends``, a list :meth:`take_sends` returned)."""
        for work, dst in self.take_sends() if sends is None else sends:
            self._run(work.wait, "send", (dst,))

    def take_sends(self) -> list:
        """The sends in flight, handed to the caller to complete later (:meth:`wait_sends`)."""
        sends, self._pending = self._pending, []
        return sends

    def with_own_sends(self) -> "Collectives":
        """A view of these collectives (same groups and peers) with its own list of sends in flight,
        completed apart from this one's: a channel's sends must not be waited for by the pipeline's."""
        view = copy.copy(self)
        view._pending = []
        return view

    # ------------------------------------------------------------------ errors
    def _run(self, fn, what: str, peers: tuple[int, ...]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised with the peers named
            others = [p for p in peers if p != self.rank]
            who = "; ".join(self.describe(p) for p in others[:8]) + (" ..." if len(others) > 8 else "")
            text = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
            if lost_connection(str(e)):   # at once: no timeout was waited for
                raise CommError(f"{what}: lost the connection to {who or 'a peer'} (its process ended)") from e
            kind = "timed out" if "timeout" in str(e).lower() or "timed out" in str(e).lower() else "failed"
            raise CommError(f"{what} {kind} after waiting on {who or 'peers'} "
                            f"(timeout {self.timeout_s:g} s): {clip(text, 300)}") from e

    def shutdown(self) -> None:
        try:
            self.wait_sends()
            if self.hc is not None:
                self.hc.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
