"""The unified communicator: one API over vendor libraries, hierarchical across vendors.

Built from one vendor tag per rank (``['emu-a', 'emu-a', 'emu-b', 'emu-c']``). Each vendor's ranks
get process groups on that vendor's library (NCCL, RCCL, HCCL, or a Gloo group registered under
the emulated vendor's own backend name); vendors meet only on the host bridge (Gloo or MPI).

* A :class:`Group` (``comm.new_group(ranks)``, collective over the world like
  ``torch.distributed.new_group``) is *flat* when its ranks share one vendor: operations go straight
  to that vendor's group. Otherwise it is *hierarchical*: reduce inside each vendor's part, exchange
  between the vendor leaders (lowest rank of each vendor in the group) over the bridge through
  host memory (reusable pinned staging buffers for device tensors), broadcast back in each vendor.
* Point-to-point between two vendors goes through host memory over the bridge; within a vendor,
  over the vendor library.
* Every operation has a deadline (``timeout``). A timed-out operation raises
  :class:`~hetero.comm.errors.HeteroCommTimeout` naming the operation, the group and the ranks that
  never arrived (see :mod:`hetero.comm.monitor`). After such a failure the communicator refuses
  further work (its groups may hold half-finished operations) instead of hanging.
* ``async_op=True`` returns a :class:`Work` (``wait()``); several may be in flight. Flat operations
  run on the library's own asynchronous machinery; hierarchical ones on one ordered worker
  thread, and any operation issued while that thread is busy queues behind it, so every rank
  issues the underlying library calls in the same order.
* :class:`CommStats` counts bytes per path (bridge, each vendor) and keeps a trace of sub-operations
  with the ranks of the group each ran on.

This module holds the :class:`Communicator` (construction, groups, routing, the public operations);
:class:`Group`, :class:`Work` and :class:`CommStats` have modules of their own, and the cross-vendor
algorithms are in :mod:`hetero.comm.hierarchical`.
"""
from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from hetero.errors import lost_connection

from . import hierarchical
from .bridge import Bridge, StagingPool, make_bridge
from .errors import HeteroCommError, HeteroCommTimeout, ReduceOp, divide_
from .group import Group
from .monitor import ArrivalMonitor
from .stats import CommStats
from .vendors import backend_for, check_vendor_list, device_type_for, ensure_backend_loaded
from .work import Work

DEFAULT_TIMEOUT = 300.0


class Communicator:
    """One communicator over vendor libraries and a host bridge. See the module docstring.

    ``torch.distributed`` must be initialised first (any backend; the communicator makes its own
    groups). Construct with :meth:`from_vendors`.
    """

    def __init__(self, vendor_of_rank: Sequence[str], bridge: str = "gloo", timeout: float = DEFAULT_TIMEOUT,
                 backend_of_vendor: Mapping[str, str] | None = None, device=None):

        if not dist.is_initialized():
            raise RuntimeError("hetero.comm: torch.distributed is not initialised (call "
                               "torch.distributed.init_process_group first, or hetero.comm.init(...))")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        check_vendor_list(vendor_of_rank, self.world_size)
        self.vendor_of_rank: list[str] = list(vendor_of_rank)
        self.vendor = self.vendor_of_rank[self.rank]
        self.timeout = float(timeout)

        self._timeout_td = datetime.timedelta(seconds=self.timeout)
        self._ar_opts: dict[object, object] = {}
        self.backend_of_vendor: dict[str, str] = {}
        for tag in dict.fromkeys(self.vendor_of_rank):
            self.backend_of_vendor[tag] = backend_for(tag, backend_of_vendor)
        ensure_backend_loaded(self.backend_of_vendor[self.vendor])
        if device is None:
            dtype = device_type_for(self.backend_of_vendor[self.vendor])
            if dtype == "cpu":
                device = torch.device("cpu")
            else:
                mod = getattr(torch, dtype)
                device = torch.device(dtype, mod.current_device())
        self.device = torch.device(device)
        self.stats = CommStats()
        self._staging = StagingPool()
        self._monitor = ArrivalMonitor(self.rank)
        self._vendor_pgs: dict[tuple[str, tuple[int, ...]], object] = {}
        self._groups: list[Group] = []
        self._counter = 0
        self._broken: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetero-comm")
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.bridge: Bridge = make_bridge(bridge, self.rank, self.world_size, self.timeout)
        self.world: Group = self._build_group(list(range(self.world_size)), "world")

    @classmethod
    def from_vendors(cls, vendor_of_rank: Sequence[str], bridge: str = "gloo", timeout: float = DEFAULT_TIMEOUT,
                     backend_of_vendor: Mapping[str, str] | None = None, device=None) -> "Communicator":
        """Build from one vendor tag per global rank (collective: every rank calls it, same arguments)."""
        return cls(vendor_of_rank, bridge=bridge, timeout=timeout, backend_of_vendor=backend_of_vendor,
                   device=device)

    # ---------------------------------------------------------------------------------- groups
    def new_group(self, ranks: Sequence[int], name: str | None = None) -> Group:
        """A group over ``ranks`` (global). Collective: every rank of the world calls it, in the same order."""
        ranks = sorted(set(int(r) for r in ranks))
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or not ranks:
            raise ValueError(f"new_group: ranks {bad or ranks} are not in the world of {self.world_size} ranks")
        self._counter += 1
        return self._build_group(ranks, name or f"g{self._counter}")

    def _vendor_pg(self, tag: str, ranks: Sequence[int]):
        key = (tag, tuple(ranks))
        if key not in self._vendor_pgs:
            self._vendor_pgs[key] = dist.new_group(list(ranks), backend=self.backend_of_vendor[tag],
                                                   timeout=self._timeout_td)
        return self._vendor_pgs[key]

    def _build_group(self, ranks: list[int], name: str) -> Group:
        g = Group(self, name, ranks)
        for tag, sub in g.vendor_ranks.items():  # same order on every rank: ranks are sorted
            if len(sub) > 1:
                pg = self._vendor_pg(tag, sub)
                if tag == self.vendor and g.is_member:
                    g.vendor_pg = pg
        if g.hierarchical:
            g.bridge = self.bridge.group(sorted(g.leaders.values()))
            if not g.is_leader:
                g.bridge = None
        self._groups.append(g)
        return g

    def vendor_groups(self) -> list[dict]:
        """Every vendor process group this communicator made: ``{vendor, backend, ranks}``."""
        return [{"vendor": tag, "backend": self.backend_of_vendor[tag], "ranks": list(r)}
                for (tag, r) in self._vendor_pgs]

    def bridge_groups(self) -> list[list[int]]:
        """Rank lists of the bridge groups (vendor leaders) made so far."""
        return [list(k) for k in self.bridge._groups]

    # ---------------------------------------------------------------------------------- plumbing
    def _group(self, group: Group | None) -> Group:
        g = self.world if group is None else group
        if self._broken:
            raise HeteroCommError(f"communicator unusable after an earlier failure: {self._broken}",
                                  group=g.name, ranks=g.ranks)
        if not g.is_member:
            raise ValueError(f"rank {self.rank} is not a member of group {g.name} (ranks {g.ranks})")
        return g

    def _launch(self, op: str, g: Group, issue: Callable, async_op: bool, timeout: float | None,
                hierarchical: bool, peer: int | None = None):
        """Run ``issue(deadline) -> (works, finalize)`` in order with every other operation.

        Flat operations return un-waited library handles; hierarchical ones run to completion
        inside ``issue`` and return ``([], finalize)``.
        """
        timeout = self.timeout if timeout is None else float(timeout)
        seq = self._monitor.enter(g.name) if peer is None else 0
        self.stats.count(op)
        if self._pending == 0 and (not hierarchical or not async_op):
            deadline = time.monotonic() + timeout
            try:
                works, finalize = issue(deadline)
            except HeteroCommError:
                raise
            except Exception as e:  # noqa: BLE001
                raise self._failure(op, g, seq, e, peer) from e
            work = Work(self, op, g, seq, deadline, works, finalize, peer=peer)
            return work if async_op else work.wait()

        def task():
            try:
                deadline = time.monotonic() + timeout
                works, finalize = issue(deadline)
                return works, finalize, deadline
            finally:
                with self._pending_lock:
                    self._pending -= 1

        with self._pending_lock:
            self._pending += 1
        future = self._executor.submit(task)
        work = Work(self, op, g, seq, time.monotonic() + timeout, future=future, peer=peer)
        return work if async_op else work.wait()

    def _failure(self, op: str, g: Group, seq: int, exc: BaseException, peer: int | None) -> Exception:
        msg = str(exc)
        low = msg.lower()
        closed = lost_connection(msg)
        timeoutish = isinstance(exc, TimeoutError) or closed or "timed out" in low or "timeout" in low
        if not timeoutish:
            return exc if isinstance(exc, Exception) else RuntimeError(msg)
        if peer is not None:
            missing = [peer]
            what = f"{op} between rank {self.rank} and rank {peer} (vendor {self.vendor_of_rank[peer]})"
        else:
            # After a timeout every member times out about together and must get to publish its counter;
            # a closed or reset connection comes the moment a peer dies, when the live members'
            # counters are already published (every monitor interval), so a short wait reads them.
            grace = 2 * self._monitor.interval if closed else max(0.3, min(2.0, 0.2 * self.timeout))
            missing = self._monitor.missing(g.name, seq, g.ranks, grace=grace)
            what = f"{op} #{seq} on group '{g.name}' (ranks {g.ranks})"
        if missing is None:
            who = "ranks that did not arrive: unknown (no store to ask)"
        elif missing:
            who = f"ranks that did not arrive: {missing}"
        else:
            who = "every rank arrived; a peer failed or is too slow"
        cause = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
        if closed:   # at once, not after the timeout: a peer's process ended or left
            text = f"hetero.comm: {what} on rank {self.rank}: a peer closed its connection (its process ended); {who}"
        else:
            text = (f"hetero.comm: {what} did not complete on rank {self.rank} within its timeout of "
                    f"{self.timeout:g} s; {who}. Cause: {cause}")
        self._broken = text
        return HeteroCommTimeout(text, op=op, group=g.name, ranks=g.ranks, missing=missing)

    def _rec(self, op: str, path: str, g: Group, nbytes: int) -> None:
        if path == "bridge":
            self.stats.record(op, "bridge", None, sorted(g.leaders.values()), nbytes)
        else:
            self.stats.record(op, "vendor", self.vendor, g.my_vendor_ranks, nbytes)

    # ------------------------------------------------------------------------------- collectives
    def all_reduce(self, tensor, op="sum", group: Group | None = None, async_op: bool = False,
                   timeout: float | None = None):
        """Reduce ``tensor`` in place over the group (SUM, MAX, MIN, AVG = sum / group size)."""

        g = self._group(group)
        rop = ReduceOp.parse(op)
        top = rop.torch_op()
        avg = rop is ReduceOp.AVG
        nbytes = tensor.numel() * tensor.element_size()

        if not g.hierarchical:
            pg = g.vendor_pg
            direct = tensor.layout == torch.strided and not tensor.is_complex()
            if direct and not async_op and pg is not None and self._pending == 0:
                return self._all_reduce_now(tensor, top, avg, g, pg, nbytes, timeout)

            def issue(deadline):
                if pg is None:
                    return [], (lambda: tensor)
                self._rec("all_reduce", "vendor", g, nbytes)
                if direct:  # the process group itself: skips torch.distributed's Python wrapper
                    opts = dist.AllreduceOptions()
                    opts.reduceOp = top
                    w = pg.allreduce([tensor], opts)
                else:
                    w = dist.all_reduce(tensor, op=top, group=pg, async_op=True)
                if avg:
                    return [w], (lambda: divide_(tensor, g.size))
                return [w], (lambda: tensor)

            return self._launch("all_reduce", g, issue, async_op, timeout, hierarchical=False)

        def run(deadline):
            hierarchical.all_reduce(self, tensor, rop, g, deadline, "all_reduce")
            return [], (lambda: tensor)

        return self._launch("all_reduce", g, run, async_op, timeout, hierarchical=True)

    def _all_reduce_now(self, tensor, top, avg, g, pg, nbytes, timeout):
        """The synchronous flat all-reduce, with nothing between the caller and the process group
        but the bookkeeping (sequence number, statistics, deadline)."""

        seq = self._monitor.enter(g.name)
        self.stats.record("all_reduce", "vendor", self.vendor, g.my_vendor_ranks, nbytes, count=True)
        opts = self._ar_opts.get(top)
        if opts is None:
            opts = self._ar_opts[top] = dist.AllreduceOptions()
            opts.reduceOp = top
        td = self._timeout_td if timeout is None else datetime.timedelta(seconds=float(timeout))
        try:
            pg.allreduce([tensor], opts).wait(td)
        except Exception as e:  # noqa: BLE001
            raise self._failure("all_reduce", g, seq, e, None) from e
        if avg:
            divide_(tensor, g.size)
        return tensor

    def broadcast(self, tensor, src: int, group: Group | None = None, async_op: bool = False,
                  timeout: float | None = None):
        """Copy ``tensor`` of global rank ``src`` to every rank of the group."""

        g = self._group(group)
        if src not in g._index:
            raise ValueError(f"broadcast: src rank {src} is not in group {g.name} (ranks {g.ranks})")
        nbytes = tensor.numel() * tensor.element_size()
        if not g.hierarchical:
            pg = g.vendor_pg

            def issue(deadline):
                if pg is None:
                    return [], (lambda: tensor)
                self._rec("broadcast", "vendor", g, nbytes)
                return [dist.broadcast(tensor, src=src, group=pg, async_op=True)], (lambda: tensor)

            return self._launch("broadcast", g, issue, async_op, timeout, hierarchical=False)

        def run(deadline):
            hierarchical.broadcast(self, tensor, src, g, deadline)
            return [], (lambda: tensor)

        return self._launch("broadcast", g, run, async_op, timeout, hierarchical=True)

    def all_gather_into_tensor(self, output, tensor, group: Group | None = None, async_op: bool = False,
                               timeout: float | None = None):
        """``output`` (group size x ``tensor.numel()`` elements, contiguous) gets every rank's tensor in group order.

        Its shape is free (e.g. ``(size * n, ...)`` concatenated along dim 0).
        """
        g = self._group(group)
        if output.numel() != g.size * tensor.numel() or not output.is_contiguous():
            raise ValueError(f"all_gather_into_tensor: output needs {g.size} x {tensor.numel()} contiguous elements, "
                             f"got {tuple(output.shape)}")
        out2d = output.view(g.size, tensor.numel())
        inp = tensor.reshape(-1)
        return self._all_gather(out2d, inp, g, async_op, timeout, lambda: output)

    def all_gather(self, output_list, tensor, group: Group | None = None, async_op: bool = False,
                   timeout: float | None = None):
        """``output_list[i]`` gets the tensor of the group's i-th rank (all the same size)."""

        g = self._group(group)
        if len(output_list) != g.size:
            raise ValueError(f"all_gather: output_list has {len(output_list)} tensors, group {g.name} has {g.size} ranks")
        out2d = torch.empty((g.size, tensor.numel()), dtype=tensor.dtype, device=tensor.device)
        inp = tensor.reshape(-1)

        def finalize():
            for i, o in enumerate(output_list):
                o.copy_(out2d[i].view(o.shape))
            return output_list

        return self._all_gather(out2d, inp, g, async_op, timeout, finalize)

    def _all_gather(self, out2d, inp, g: Group, async_op, timeout, finalize):

        nbytes = inp.numel() * inp.element_size()
        if not g.hierarchical:
            pg = g.vendor_pg

            def issue(deadline):
                if pg is None:
                    out2d[0].copy_(inp)
                    return [], finalize
                self._rec("all_gather", "vendor", g, nbytes)
                if out2d.device.type == "cpu":
                    w = dist.all_gather(list(out2d.unbind(0)), inp.contiguous(), group=pg, async_op=True)
                else:
                    w = dist.all_gather_into_tensor(out2d, inp.contiguous(), group=pg, async_op=True)
                return [w], finalize

            return self._launch("all_gather", g, issue, async_op, timeout, hierarchical=False)

        def run(deadline):
            hierarchical.all_gather(self, out2d, inp, g, deadline)
            return [], finalize

        return self._launch("all_gather", g, run, async_op, timeout, hierarchical=True)

    def all_gather_v(self, tensor, group: Group | None = None, timeout: float | None = None):
        """All-gather of tensors whose first dimension differs per rank; returns the list in group order.

        Two operations: the sizes, then the data padded to the largest size (trimmed on return).
        """

        g = self._group(group)
        n = torch.tensor([tensor.shape[0] if tensor.dim() else 1], dtype=torch.int64, device=tensor.device)
        sizes = torch.empty(g.size, dtype=torch.int64, device=tensor.device)
        self.all_gather_into_tensor(sizes, n, group=g, timeout=timeout)
        sizes = [int(s) for s in sizes.tolist()]
        m = max(sizes)
        padded = torch.zeros((m,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]].copy_(tensor)
        out = torch.empty((g.size,) + tuple(padded.shape), dtype=tensor.dtype, device=tensor.device)
        self.all_gather_into_tensor(out, padded, group=g, timeout=timeout)
        return [out[i, : sizes[i]].clone() for i in range(g.size)]

    def reduce_scatter(self, output, input, op="sum", split_sizes: Sequence[int] | None = None,
                       group: Group | None = None, async_op: bool = False, timeout: float | None = None):
        """Reduce ``input`` over the group; ``output`` gets this rank's part (along dim 0).

        ``split_sizes`` (one per group rank, summing to ``input.shape[0]``) allows uneven parts;
        default: equal parts. Across vendors: a hierarchical all-reduce of a copy of ``input``,
        then each rank keeps its part.
        """

        g = self._group(group)
        rop = ReduceOp.parse(op)
        if split_sizes is None:
            if input.shape[0] % g.size:
                raise ValueError(f"reduce_scatter: input dim 0 ({input.shape[0]}) is not divisible by the group "
                                 f"size {g.size}; pass split_sizes")
            split_sizes = [input.shape[0] // g.size] * g.size
        split_sizes = [int(s) for s in split_sizes]
        if len(split_sizes) != g.size or sum(split_sizes) != input.shape[0]:
            raise ValueError(f"reduce_scatter: split_sizes {split_sizes} must have {g.size} entries summing to "
                             f"input dim 0 ({input.shape[0]})")
        if tuple(output.shape) != (split_sizes[g.rank],) + tuple(input.shape[1:]):
            raise ValueError(f"reduce_scatter: output shape {tuple(output.shape)} on rank {self.rank}, expected "
                             f"{(split_sizes[g.rank],) + tuple(input.shape[1:])}")
        nbytes = input.numel() * input.element_size()

        if not g.hierarchical:
            pg = g.vendor_pg

            def issue(deadline):
                if pg is None:
                    output.copy_(input)
                    return [], (lambda: divide_(output, g.size) if rop is ReduceOp.AVG else output)
                self._rec("reduce_scatter", "vendor", g, nbytes)
                parts = list(input.contiguous().split(split_sizes))
                w = dist.reduce_scatter(output, parts, op=rop.torch_op(), group=pg, async_op=True)
                return [w], (lambda: divide_(output, g.size) if rop is ReduceOp.AVG else output)

            return self._launch("reduce_scatter", g, issue, async_op, timeout, hierarchical=False)

        def run(deadline):
            buf = input.clone()
            hierarchical.all_reduce(self, buf, rop, g, deadline, "reduce_scatter")
            output.copy_(buf.split(split_sizes)[g.rank])
            return [], (lambda: output)

        return self._launch("reduce_scatter", g, run, async_op, timeout, hierarchical=True)

    def all_to_all_single(self, output, input, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                          group: Group | None = None, async_op: bool = False, timeout: float | None = None):
        """Rows of ``input`` to every rank of the group and back: ``input_split_sizes[i]`` rows (along dim 0,
        in group order) go to the group's i-th rank, ``output`` gets ``output_split_sizes[j]`` rows from its
        j-th (torch's ``all_to_all_single``; Gloo has no list form). Within one vendor: the vendor library's
        all-to-all; across vendors: that inside each vendor part, and host-staged transfers over the
        bridge between ranks of different vendors (:func:`hierarchical.all_to_all`). Bytes are recorded
        per path as this rank sends them (its rows to other ranks; its own rows move nowhere)."""

        g = self._group(group)
        ins, outs = [int(s) for s in input_split_sizes], [int(s) for s in output_split_sizes]
        if len(ins) != g.size or sum(ins) != input.shape[0] or len(outs) != g.size or sum(outs) != output.shape[0]:
            raise ValueError(f"all_to_all_single: split sizes {ins} (input dim 0 {input.shape[0]}) and {outs} "
                             f"(output dim 0 {output.shape[0]}) must have {g.size} entries summing to dim 0")
        if not g.hierarchical:
            pg = g.vendor_pg
            row = input[0].numel() * input.element_size() if input.shape[0] else 0

            def issue(deadline):
                if pg is None:
                    output.copy_(input)
                    return [], (lambda: output)
                self._rec("all_to_all", "vendor", g, row * (sum(ins) - ins[g.rank]))
                w = dist.all_to_all_single(output, input.contiguous(), outs, ins, group=pg, async_op=True)
                return [w], (lambda: output)

            return self._launch("all_to_all", g, issue, async_op, timeout, hierarchical=False)

        def run(deadline):
            hierarchical.all_to_all(self, output, input, outs, ins, g, deadline)
            return [], (lambda: output)

        return self._launch("all_to_all", g, run, async_op, timeout, hierarchical=True)

    def barrier(self, group: Group | None = None, async_op: bool = False, timeout: float | None = None):
        """Wait until every rank of the group has arrived (hierarchically across vendors)."""

        g = self._group(group)
        t = torch.zeros(1, dtype=torch.uint8, device=self.device)
        work = self.all_reduce(t, op="max", group=g, async_op=True, timeout=timeout)
        if async_op:
            return work
        work.wait()
        return None

    # ---------------------------------------------------------------------------- point to point
    def send(self, tensor, dst: int, tag: int = 0, group: Group | None = None, async_op: bool = False,
             timeout: float | None = None):
        """Send ``tensor`` to global rank ``dst`` (across vendors: host memory over the bridge)."""
        return self._p2p("send", tensor, dst, tag, group, async_op, timeout)

    def recv(self, tensor, src: int, tag: int = 0, group: Group | None = None, async_op: bool = False,
             timeout: float | None = None):
        """Receive into ``tensor`` from global rank ``src``; returns ``tensor`` (or a Work)."""
        return self._p2p("recv", tensor, src, tag, group, async_op, timeout)

    def isend(self, tensor, dst: int, tag: int = 0, group: Group | None = None, timeout: float | None = None):
        return self.send(tensor, dst, tag, group, async_op=True, timeout=timeout)

    def irecv(self, tensor, src: int, tag: int = 0, group: Group | None = None, timeout: float | None = None):
        return self.recv(tensor, src, tag, group, async_op=True, timeout=timeout)

    def _p2p(self, op, tensor, peer, tag, group, async_op, timeout):

        g = self._group(group)
        if peer not in g._index or peer == self.rank:
            raise ValueError(f"{op}: peer rank {peer} must be another rank of group {g.name} (ranks {g.ranks})")
        nbytes = tensor.numel() * tensor.element_size()
        peer_vendor = self.vendor_of_rank[peer]
        sending = op == "send"

        if peer_vendor == self.vendor:
            pg = self._vendor_pg(self.vendor, self.world.my_vendor_ranks)

            def issue(deadline):
                if sending:
                    self.stats.record(op, "vendor", self.vendor, self.world.my_vendor_ranks, nbytes)
                    return [dist.isend(tensor.contiguous(), dst=peer, group=pg, tag=tag)], (lambda: tensor)
                buf = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
                return [dist.irecv(buf, src=peer, group=pg, tag=tag)], (lambda: tensor if buf is tensor else tensor.copy_(buf))
        else:
            def issue(deadline):
                if tensor.device.type == "cpu":
                    host = tensor if tensor.is_contiguous() else tensor.contiguous()
                else:  # own pinned buffer: several transfers may be in flight
                    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
                    if sending:
                        host.copy_(tensor)
                if sending:
                    self.stats.record(op, "bridge", None, sorted((self.rank, peer)), nbytes)
                    return [self.bridge.isend(host, peer, tag)], (lambda: tensor)
                return [self.bridge.irecv(host, peer, tag)], (lambda: tensor if host is tensor else tensor.copy_(host))

        return self._launch(op, g, issue, async_op, timeout, hierarchical=False, peer=peer)

    # ------------------------------------------------------------------------------------- misc
    def synchronize(self) -> None:
        """Wait until every queued operation has been issued."""
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        """Stop the worker thread and the arrival publisher (process groups stay with torch)."""
        self._monitor.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> str:
        vend = ", ".join(f"{t}->{b}" for t, b in self.backend_of_vendor.items())
        return (f"Communicator(rank {self.rank}/{self.world_size}, vendor {self.vendor}, bridge {self.bridge.name}, "
                f"vendors: {vend}, timeout {self.timeout:g} s)")
