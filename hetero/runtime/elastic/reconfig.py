"""A worker's side of an in-process elastic reconfiguration: survive a lost peer and train on.

``hetero launch --elastic`` (native engine, one launching machine) starts every
worker itself, with the port of the launcher's coordinator store in :data:`~.protocol.RECONFIG_ENV`
(:mod:`hetero.runtime.elastic.live`). The worker then forms its first world on that store
(generation 0, :meth:`LiveReconfig.first_world`) instead of torchrun's, and when a step fails
because a peer's process ended, :meth:`LiveReconfig.recover`

1. reads its live state as regions of the virtual parameter space (no copy),
2. drops the broken world: first its connections are broken
   (:mod:`~hetero.runtime.reshard.sockets`), so the peers blocked on this rank wake at once, then
   the unified communicator, every process group and the DTensor mesh are released,
3. checks in with the coordinator, takes its decision and exchanges the intersections
   (:func:`hetero.runtime.reshard.live.reconfigure`) in the new generation's world,
4. when the new plan leaves it out: it has served its state and leaves (``recover`` returns False);
   else, when others leave, the members form a world of their own,
5. rebuilds everything the new plan gives it: the run context (rank, stage, layers, tp degree),
   the communicator with its vendor groups, host bridge, holder and peer sets, the tp mesh, the
   stage module and AdamW around the exchanged tensors
   (:func:`~hetero.runtime.reshard.transfer.rebuild_stage`), and the engine (buckets, schedule,
   data slice),

and the trainer goes on from the step the state is at, with the same global batch and the same
global sample indices, so the losses are those of a run that lost nothing. What each phase took
is put in the store for the launcher's ``reconfigurations`` entry.

ZeRO (``zero_stage`` 1 or 2: each rank keeps AdamW state for a slice of each holder set only). At a
pause every rank is alive, so after the decision each gathers its stage's moments (and a bf16
model's fp32 masters) whole with a collective in the old world
(:func:`~hetero.runtime.reshard.transfer.sharded_live_state`): its live state is then what a ``zero_stage: 0`` rank holds, and the exchange is unchanged. Where the
new plan shards too, the rebuilt engine's optimizer takes its slices of the exchanged states as
from a checkpoint. After a lost peer no gather is possible (it would wait on the lost rank): each
rank's slices have a copy in the next rank's host memory instead, refreshed after every update
(:mod:`~hetero.runtime.elastic.slice_copies`), and in the new world the survivors rebuild their
stages' whole state from their slices and those copies, then exchange as above. A loss the copies
cannot cover goes on from the last checkpoint, which the launcher names
(:mod:`hetero.runtime.elastic.live`).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import time

from hetero.runtime.elastic.protocol import (PEER_LOST_SIGNAL, RECONFIG_ENV, coordinator_endpoint, generation_dir,
                                             history_key, prepare_key, prepared_key, root_run_dir, timing_key)

FAIL_IN_RESHARD_ENV = "HETERO_TEST_FAIL_IN_RESHARD"
"""Testing: ``<rank>``: that rank (its rank before the reconfiguration) exits hard right after
checking in, so a peer is lost during the reshard itself."""


WAKE_GRACE_S = 0.05
"""How long the main thread has to take :data:`~.protocol.PEER_LOST_SIGNAL` itself before its connections are
broken under it (it is then blocked in a collective). The waker looks every millisecond whether the
handler ran, so a main thread that takes the signal at once keeps them until it drops its world;
one inside a long computation loses them, harmlessly (its next operation on a group fails, as it
would anyway)."""


class PeerLost(RuntimeError):
    """Raised in the schedule when the launcher says a peer's process ended."""


def exchanged_key(gen: int, rank: int) -> str:
    """Set by a member of generation ``gen``'s plan once it is through the exchange (those the plan
    leaves out wait for every member's before they leave)."""
    return f"hetero/reconfig/gen{gen}/exchanged/{rank}"


def members_world(store, gen: int, place, timeout_s: float) -> None:
    """A member past the exchange: say so, and when the exchange's world also had ranks the new plan
    leaves out (they served their state), form the members' own world."""
    from hetero.runtime.reshard.live import regroup

    members = len(place.layout.ranks)
    store.set(exchanged_key(gen, place.rank), "1")
    if place.world > members:
        regroup(store, gen, place.rank, members, timeout_s, prefix=f"gen{gen}m/")


class LiveReconfig:
    """The worker's link to the coordinator and its place across generations."""

    def __init__(self, port: int, rank: int, world: int, timeout_s: float, host: str = "127.0.0.1"):
        from hetero.runtime.reshard.live import connect

        self.store = connect(port, timeout_s, host)
        self.port = port
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.gen = 0

    @classmethod
    def from_env(cls, rank: int, world: int, timeout_s: float) -> "LiveReconfig | None":
        """The worker's link when the launcher runs the in-process path (else None); from here on
        :data:`~.protocol.PEER_LOST_SIGNAL` stops the schedule instead of ending the process."""
        value = os.environ.get(RECONFIG_ENV)
        if not value:
            return None
        host, port = coordinator_endpoint(value)
        self = cls(port, rank, world, timeout_s, host)
        import signal

        signal.signal(getattr(signal, PEER_LOST_SIGNAL), self._on_peer_lost)
        self._start_waker()
        return self

    recovering = False
    """Set once this rank left the training loop for a reconfiguration."""

    def _start_waker(self) -> None:
        """A thread that sees :data:`~.protocol.PEER_LOST_SIGNAL` even while the main thread is blocked inside a
        Gloo operation on a survivor (Python runs a signal's handler only between bytecodes): when
        the main thread has not taken the signal within :data:`WAKE_GRACE_S`, it breaks this rank's
        connections (:func:`~hetero.runtime.reshard.sockets.break_connections`), so the blocked operation fails at once
        instead of at the group's timeout (Gloo's abort does not end it)."""
        import signal
        import threading

        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        wanted = int(getattr(signal, PEER_LOST_SIGNAL))

        def wake() -> None:
            while True:
                data = os.read(r, 64)
                if wanted not in data:
                    continue
                generation = self.gen
                deadline = time.monotonic() + WAKE_GRACE_S
                while time.monotonic() < deadline and not (self.taken or self.recovering):
                    time.sleep(0.001)
                if self.gen == generation and not (self.taken or self.recovering):
                    self.aborted = True   # what the blocked operation raises is the lost peer
                    self.break_world()

        threading.Thread(target=wake, name="hetero-peer-lost-waker", daemon=True).start()

    def break_world(self) -> None:
        """Break every connection of the current world (not the coordinator's store): whatever
        waits on one, here or on a peer, fails at once (:mod:`hetero.runtime.reshard.sockets`)."""
        from hetero.runtime.reshard.sockets import break_connections

        break_connections(self.keep_ports())

    def keep_ports(self) -> set[int]:
        """The stores' ports: connections to them outlive a world."""
        ports = {self.port}
        if os.environ.get("MASTER_PORT", "").isdigit():
            ports.add(int(os.environ["MASTER_PORT"]))
        return ports

    interruptible = False
    aborted = False
    """Whether the launcher said a peer is lost since the last reconfiguration."""

    critical = False
    """Inside an optimizer step, up to the step counted as applied: never interrupted."""

    dropped_groups: list | None = None
    """The broken world's process groups, kept referenced from leaving it until the first step under
    the new plan ends: freeing Gloo groups joins their threads and tears down their connections
    (docs/elastic.md gives the time), work the downtime need not wait for; their
    connections are broken already, so nothing waits on them meanwhile."""

    updated = False
    """A ZeRO rank's optimizer update of the step under way ran (its parameters' all-gather may not)."""

    taken = False
    """Whether the main thread ran :meth:`_on_peer_lost` for the last signal (it is not blocked)."""

    def _on_peer_lost(self, _signum, _frame) -> None:
        # anywhere in a training step but its optimizer update (nothing of the training state
        # changes elsewhere: an update is never cut in half, nor left uncounted); a wait on the
        # unified communicator's thread, which Gloo's abort would not end, stops here too
        self.aborted = self.taken = True
        if self.interruptible and not self.critical:
            self.interruptible = False
            raise PeerLost("a peer's process ended (the launcher said so)")

    def watch(self, trainer) -> None:
        """Let :data:`~.protocol.PEER_LOST_SIGNAL` stop ``trainer``'s step anywhere but in its optimizer update;
        and work out now, not in the downtime, the regions this rank holds."""
        from hetero.runtime.reshard.space import ParameterSpace

        ctx = trainer.ctx
        if getattr(self, "space", None) is None:
            self.space = ParameterSpace(ctx.model)
        self.regions = self.space.rank_regions(ctx.plan, ctx.me)
        engine, optimizer = trainer.engine, trainer.engine.optimizer
        train_step, optimizer_step = engine.train_step, optimizer.step

        sharded = engine.sharded is not None
        self.copies = self._slice_copies(engine)

        def guarded_optimizer_step(*args, **kwargs):
            self.critical = True   # until the step is counted as applied (below)
            out = optimizer_step(*args, **kwargs)
            if sharded:   # ZeRO: the slices are updated; the parameters' all-gather after it may be cut
                # (after a lost peer the state is rebuilt from the slices and their copies, never from them)
                if self.copies is not None:   # posted before anything may interrupt: all of them or none
                    self.copies.start()
                self.critical, self.updated = False, True
            return out

        def interruptible_step(step, *args, **kwargs):
            if self.aborted:
                raise PeerLost("a peer's process ended (the launcher said so)")
            self.interruptible, self.critical, self.updated = True, False, False
            try:
                out = train_step(step, *args, **kwargs)
            except BaseException:
                self.interruptible = False
                if self.updated:
                    trainer.applied_step = step + 1
                raise
            if self.critical or self.updated:   # the update was applied: counted before anything may interrupt again
                trainer.applied_step = step + 1
            self.critical = False
            if self.aborted and self.world > 1:   # the signal came during the update (a lone rank, stopped
                # for devices that join, records the step first: its next step stops at its start)
                raise PeerLost("a peer's process ended (the launcher said so)")
            self.dropped_groups = None   # the broken world's groups, freed once the new plan trains
            return out

        engine.train_step = interruptible_step
        optimizer.step = guarded_optimizer_step
        trainer.train = self._interruptible_train(trainer.train)
        # No gc.freeze() here (see first_world): the process groups exist already, and frozen they
        # are never collected, so a dropped world would keep its connections open and a survivor
        # blocked on this rank would wait for the group timeout (every round of the 109M benchmark
        # on an idle machine did).

    copies = None
    """A ZeRO rank's :class:`~hetero.runtime.elastic.slice_copies.SliceCopies` (its slices copied to a
    peer after every update, its predecessor's kept), or None."""

    def _slice_copies(self, engine):
        """ZeRO with peers: the copies of this rank's slices (:mod:`.slice_copies`), waited for right
        before each update (outside the timed update, so an emulated device's slowdown does not
        stretch the wait) and started right after it; a copy of the state there is now (loaded, or
        just rebuilt) is started at once, so a loss before the first update is covered too."""
        from hetero.runtime.elastic import slice_copies

        if engine.sharded is None or self.world < 2 or not slice_copies.enabled():
            return None
        copies = slice_copies.SliceCopies(engine.sharded, self.rank, self.world, self.timeout_s)
        step = engine.optimizer_step

        def optimizer_step(*args, **kwargs):
            copies.wait()   # the last copy must be whole before the update changes what it sent
            return step(*args, **kwargs)

        engine.optimizer_step = optimizer_step
        copies.start()
        return copies

    prepared: tuple[int, bytes, dict] | None = None
    """(generation, the announcement, state tensors) allocated and touched ahead for the regions this
    rank will hold after a change the launcher announced (:func:`~.protocol.prepare_key`)."""

    def prepare_ahead(self, trainer) -> None:
        """At a step boundary (a hook of the worker's trainer): when the launcher announced the plan
        of the next generation (devices join), allocate and touch this rank's regions in it now,
        while training goes on, so that the exchange copies into mapped memory, not fresh pages that
        fault on their first write. A change replaced before the pause is announced again, and
        prepared again."""
        key = prepare_key(self.gen + 1, self.rank)
        if not self.store.check([key]):
            return
        told = self.store.get(key)
        if self.prepared is not None and self.prepared[:2] == (self.gen + 1, told):
            return
        from hetero.runtime.reshard.transfer import prepare_regions
        from hetero.runtime.spec import RunSpec

        what = json.loads(told)
        self.prepared = None   # another change's: freed before the new one is allocated
        regions = regions_in(self.space, RunSpec.from_dict(what["spec"]), what["rank"])
        self.prepared = (self.gen + 1, told, prepare_regions(regions, trainer.ctx.device))
        self.store.set(prepared_key(self.gen + 1, self.rank), told)

    reserved: int | None = None
    """The generation whose reserve this rank made (:meth:`reserve_ahead`)."""

    def reserve_ahead(self) -> None:
        """At a step boundary (a hook of the worker's trainer), once per generation: when the launcher
        has planned for every single loss (:func:`~hetero.runtime.reshard.live.reserve_key`), write
        as much host memory as this rank's exchange would allocate after any of them, and free it.
        Kept mapped (:mod:`hetero.runtime.host_memory`), it is where the exchange after a loss puts
        its new tensors, instead of fresh memory and its page faults in the downtime (a join
        prepares its exact regions instead, :meth:`prepare_ahead`). The worker hooks it on CPU
        devices only; the memory stays this process's, as the blocks a GPU's caching allocator keeps."""
        from hetero.runtime.host_memory import keep_freed_host_memory
        from hetero.runtime.reshard.live import reserve_key

        told = self._published_once("reserved", reserve_key(self.gen))
        need = 0 if told is None else told.get(str(self.rank), 0)
        if need and keep_freed_host_memory():
            import torch

            torch.empty(need, dtype=torch.uint8).fill_(0)   # mapped, then freed into the heap

    resolved: int | None = None
    """The generation whose decisions ahead this rank resolved (:meth:`resolve_ahead`)."""

    def resolve_ahead(self) -> None:
        """At a step boundary (a hook of the worker's trainer), once per generation: when the launcher
        has published its decision for each single loss (:func:`~hetero.runtime.reshard.live.ahead_key`),
        work out what each means for this rank (:func:`~hetero.runtime.reshard.live.resolve`: the
        plans, layouts, regions and transition), so that the downtime after a loss starts at the
        exchange."""
        from hetero.runtime.reshard.live import ahead_key, resolve

        for d in self._published_once("resolved", ahead_key(self.gen)) or []:
            if self.rank in d["survivors"]:
                resolve(d, self.space)

    def _published_once(self, done: str, key: str):
        """What the launcher published at ``key`` for this generation, read once: None while it is
        not there, and once this generation's is taken (``done``: the attribute that records the
        generation it was taken for)."""
        if getattr(self, done) == self.gen or not self.store.check([key]):
            return None
        setattr(self, done, self.gen)
        return json.loads(self.store.get(key))

    def first_world(self) -> None:
        """Generation 0's world on the coordinator's store (the Trainer then finds it formed).

        Everything allocated so far (the interpreter, torch and the other modules: most of the
        objects the collector tracks) is moved to the permanent generation first, so the collection
        that frees a broken world's groups (:func:`_drop_world`) looks only at what the run made
        since. The groups themselves are made after it: frozen, they would never be collected, and
        a dropped world would keep its connections open (a peer blocked on them would wait for the
        group's timeout)."""
        from hetero.runtime.reshard.live import regroup

        import_training_modules()   # frozen with the rest, not traversed after a loss

        gc.collect()
        gc.freeze()
        regroup(self.store, 0, self.rank, self.world, self.timeout_s)

    @staticmethod
    def applies(error: BaseException) -> bool:
        """Whether ``error`` is a lost peer (a closed connection, a timeout waiting on one), not a
        failure of this rank's own work, which ends the run as without --elastic."""
        from hetero.errors import lost_connection

        text = str(error).lower()
        return isinstance(error, PeerLost) or lost_connection(text) or "timed out" in text or "timeout" in text

    def _interruptible_train(self, train):
        """``trainer.train`` with the rest of a step (its metrics all-reduce, the pause decision)
        interruptible too; a wrapped one is not wrapped again."""
        train = getattr(train, "__wrapped_train__", train)

        def interruptible_train(*args, **kwargs):
            self.interruptible = True
            try:
                out = train(*args, **kwargs)
            finally:
                self.interruptible = False
            if self.copies is not None:   # the run's last copies (every rank is here), nothing left in flight
                self.copies.wait()
            return out

        interruptible_train.__wrapped_train__ = train
        return interruptible_train

    end: int | None = None
    """The step the run ends at (the worker sets it): told to processes that join."""

    def _leave_history(self, trainer, gen: int) -> None:
        """Rank 0, before checking in under ``gen``: the results so far, where the run ends and the fp16
        loss scale, for processes that join (:mod:`hetero.runtime.elastic.joining`)."""

        if self.rank == 0:
            engine = trainer.engine
            self.store.set(history_key(gen), json.dumps({
                "results": [dataclasses.asdict(r) for r in trainer.state.results], "end": self.end,
                "scale": engine.scaler.scale if getattr(engine, "scaler", None) else None}))

    def pause(self, trainer) -> bool | None:
        """Every rank paused at a step boundary for a change of the cluster file: check in (the world
        still whole) and take the coordinator's decision: reshard in-process as :meth:`recover`
        does (True / False as there), or None: hand off through the run directory and exit (the new
        plan needs processes on devices that run none)."""
        from hetero.runtime.reshard.live import await_decision, report_alive

        gen, paused_at = self.gen + 1, time.time()
        if self.copies is not None:   # every rank is alive: the copies under way complete
            self.copies.wait()
        if trainer.engine.sharded is not None:
            # ZeRO: the moments are gathered whole for this rank's regions now, while every rank is
            # in the old world (after a failure they cannot be), and before the check-in: the
            # decision comes once all checked in, so no rank breaks its connections (recover) while
            # a peer is still in the gather
            self.gathered = self._live(trainer)
        self._leave_history(trainer, gen)
        report_alive(self.store, gen, self.rank, applied_step=trainer.applied_step, detected_at=paused_at,
                     host_memory=trainer.ctx.device.type == "cpu")
        d = await_decision(self.store, gen, self.timeout_s)
        if d.get("handoff"):
            self.gen, self.gathered = gen, None
            return None
        return self.recover(trainer, paused_at, decision=d)

    gathered = None
    """A ZeRO rank's live state, gathered in :meth:`pause` for the :meth:`recover` that follows."""

    def _live(self, trainer) -> dict:
        """This rank's live state as regions (:func:`~hetero.runtime.reshard.transfer.live_state`); a
        ZeRO rank's gathered whole (:func:`~hetero.runtime.reshard.transfer.sharded_live_state`, a collective)."""
        from hetero.runtime.reshard.transfer import live_state, sharded_live_state

        engine = trainer.engine
        if engine.sharded is not None:
            return sharded_live_state(engine.module, engine.sharded, self.regions)
        return live_state(engine.module, engine.optimizer, self.regions)

    def recover(self, trainer, detected_at: float, decision: dict | None = None) -> bool:
        """Reconfigure after a lost peer (see the module docstring); True: ``trainer`` is rebuilt for
        the new plan and goes on; False: the new plan leaves this rank out (its state was served)."""
        from hetero.runtime.reshard.live import reconfigure

        self.recovering = True
        engine = trainer.engine
        live, self.gathered = self.gathered, None
        copies, self.copies = self.copies, None
        lost_peer = live is None and engine.sharded is not None and self.world > 1
        if live is None:
            # a ZeRO rank that lost a peer holds slices only, and a gather would wait on the lost
            # rank: its whole state is rebuilt in the new world, from the slices and their copies
            # (slice_copies.whole_state), unless the launcher's decision goes on from a checkpoint;
            # a lone rank (stopped for devices that join) has no peer to gather from
            live = {} if lost_peer else self._live(trainer)
        scale = engine.scaler.scale if getattr(engine, "scaler", None) else None
        if decision is None and self.world == 1:   # a lone rank is stopped at once for devices that join
            self._leave_history(trainer, self.gen + 1)
        self.break_world()   # first: the peers blocked on this rank wake now, not after the teardown
        # ZeRO: every copy still under way settles now (the connections are broken: a pending one fails)
        slices = copies.settle() if lost_peer and copies is not None else None
        self.dropped_groups = _drop_world(trainer)
        self.gen += 1
        gen, me = self.gen, self.rank
        leave_s = time.time() - detected_at   # live state read, broken world dropped
        fail = os.environ.get(FAIL_IN_RESHARD_ENV)
        prepared = self.prepared[2] if self.prepared is not None and self.prepared[0] == gen else None
        self.prepared = None
        whole = None
        if slices is not None:
            from hetero.runtime.elastic.slice_copies import whole_state

            def whole(world_rank, survivors, describe, copies=copies, module=engine.module, regions=self.regions):
                return whole_state(copies, module, regions, world_rank, survivors, describe)
        place = reconfigure(self.store, gen, me, live, timeout_s=self.timeout_s, applied_step=trainer.applied_step,
                            detected_at=detected_at, meshes=False, space=self.space, decision=decision,
                            prepared=prepared, checkin={"slices": slices} if lost_peer else None,
                            whole_state=whole,
                            on_checked_in=(lambda: os._exit(19)) if fail is not None and int(fail) == me else None)
        del live, prepared, copies, whole
        t0 = time.perf_counter()
        timing = {"detected_at": detected_at, "leave_s": leave_s, **place.timings, "bytes_sent": place.stats.bytes_sent,
                  "bytes_received": place.stats.bytes_received, "bytes_local": place.stats.bytes_local,
                  "member": place.member, "pid": os.getpid(), "rank_after": place.rank}
        members = len(place.layout.ranks)
        done = [exchanged_key(gen, r) for r in range(members)]
        if not place.member:
            import datetime

            import torch.distributed as dist

            # leave only once every member is through the exchange: a helper gone before a member
            # finished forming the exchange's world (nothing to send) broke that member's connect
            try:
                self.store.wait(done, datetime.timedelta(seconds=self.timeout_s))
            except Exception:  # noqa: BLE001 - a member lost meanwhile: the launcher says so
                pass
            dist.destroy_process_group()
            self.store.set(timing_key(gen, me), json.dumps({**timing, "rebuild_s": 0.0, "ready_at": time.time()}))
            _leave_trace(trainer, gen, me)
            return False
        members_world(self.store, gen, place, self.timeout_s)
        self.adopt(trainer, place, scale)   # the old stage and optimizer are dropped here
        if trainer.ctx.device.type == "cpu":   # what is left of an old tensor kept as a view
            from hetero.runtime.host_memory import release_unused_pages

            release_unused_pages(t for st in place.state.values() for t in st.tensors.values())
        self.rank, self.world = place.rank, members
        self.aborted = self.recovering = self.taken = False
        self.watch(trainer)
        timing["rebuild_s"] = time.perf_counter() - t0
        timing["ready_at"] = time.time()
        self.store.set(timing_key(gen, me), json.dumps(timing))
        return True

    def adopt(self, trainer, place, scale) -> None:
        """``trainer`` rebuilt for ``place`` (its rank in the new plan, the exchanged state)."""
        from hetero.runtime.collectives import Collectives
        from hetero.runtime.engine import NativeEngine, RunContext
        from hetero.runtime.reshard.transfer import full_states, rebuild_stage
        from hetero.runtime.spec import RunSpec, describe_rank

        old = trainer.ctx
        layout, rank = place.layout, place.rank
        opts = dataclasses.replace(old.options, inject_failure=None, load=None,
                                   run_dir=generation_dir(old.options.run_dir, self.gen))
        os.makedirs(opts.run_dir, exist_ok=True)
        spec = RunSpec(cluster=place.cluster, model=old.spec.model, plan=place.plan.to_dict(),
                       layout=[r.to_dict() for r in layout.ranks],
                       nodes=[dataclasses.asdict(n) for n in layout.nodes], options=opts)
        ctx = RunContext(spec, rank)
        comm = Collectives.init(rank, len(layout.ranks), opts.timeout_s,
                                describe=lambda r: describe_rank(ctx.layout.ranks[r]),
                                vendors=[r.vendor for r in layout.ranks], device=ctx.device,
                                device_types=ctx.device_types)
        ctx.parallel.create_groups(comm)
        mesh = ctx.parallel.tp_mesh(comm, ctx.device.type)
        stage = rebuild_stage(ctx.model, ctx.plan, ctx.me, place.state, mesh=mesh, device=ctx.device,
                              lr=opts.lr, weight_decay=opts.weight_decay)
        engine = NativeEngine(ctx, comm, stage=stage)
        if engine.sharded is not None:   # ZeRO: this rank keeps its slices of the exchanged states, as after a load
            engine.sharded.load_full_state(full_states(*stage))
        del stage
        if mesh is not None:
            engine.mesh = mesh
        if scale is not None and engine.scaler is not None:
            engine.scaler.scale = scale
        trainer.ctx, trainer.comm, trainer.engine = ctx, comm, engine
        trainer.rank, trainer.world = rank, len(layout.ranks)
        _rewind(trainer, place.step)


def import_training_modules() -> None:
    """Import what training and a rebuild import (tensor parallelism's DTensor stack, 1-2 s on two
    cores, the engine, the trainer, and what those import where they are first used: the unified
    communicator, the memory model that says whether a stage sums into gradient buffers, the
    overlapped reduction, ZeRO), so a reconfiguration, or a process joining one, does not import it
    in its downtime."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    import hetero.comm  # noqa: F401
    import hetero.predictor.memory  # noqa: F401
    import hetero.runtime.engine  # noqa: F401
    import hetero.runtime.overlap  # noqa: F401
    import hetero.runtime.prompt_data  # noqa: F401  (the engine's data source looks at the --data file)
    import hetero.runtime.trainer  # noqa: F401
    import hetero.runtime.zero  # noqa: F401


def _leave_trace(trainer, gen: int, rank: int) -> None:
    """With ``--trace``: this process's events so far, for the launcher's merged trace (the new plan
    left it out, so the final ranks' trace at the end cannot have them)."""
    opts = trainer.ctx.options
    if not opts.trace:
        return
    from hetero.runtime.trace import LEFT_PART, trace_dict
    from hetero.specs.io import write_text_atomic

    events = [[] for _ in trainer.ctx.layout.ranks]
    events[rank] = list(trainer.state.events)
    path = os.path.join(root_run_dir(opts.run_dir), LEFT_PART.format(gen=gen, rank=rank))
    write_text_atomic(path, json.dumps(trace_dict(trainer.ctx.layout, events, ranks=[rank])), "--trace")


def _rewind(trainer, step: int) -> None:
    """The trainer at ``step`` (the state's): later results dropped; a step whose update was applied
    but whose closing all-reduce was lost keeps a place with no loss (NaN: null in the summary)."""
    from hetero.runtime.trainer import StepResult

    results = [r for r in trainer.state.results if r.step <= step]
    for s in range(len(results) + 1, step + 1):
        results.append(StepResult(step=s, loss=math.nan, time_s=math.nan, grad_norm=math.nan, forward_s=[],
                                  backward_s=[]))
    trainer.state.results = results
    trainer.state.events = [e for e in trainer.state.events if e[2] <= step]
    trainer.step = trainer.applied_step = step


def _drop_world(trainer) -> list:
    """Leave the broken world (its connections are broken already, :meth:`LiveReconfig.break_world`):
    the communicator's worker thread stopped, every group and mesh released, the default group
    destroyed, and what they held collected. Returns the destroyed groups themselves, for the caller
    to free later (:attr:`LiveReconfig.dropped_groups`)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    comm = trainer.comm
    try:
        if comm.hc is not None:
            comm.hc.close()
    except Exception:  # noqa: BLE001 - a broken communicator is being dropped anyway
        pass
    comm._groups.clear()
    comm._mesh_groups.clear()
    comm._hgroups.clear()
    comm._pending.clear()
    comm.hc = None
    trainer.engine.executor = None
    trainer.engine.reducer = None
    # the interrupted step's gradients: the new plan trains that step again, and the exchange's
    # tensors reuse their memory (mapped, on a CPU device: hetero.runtime.host_memory)
    for p in trainer.engine.module.parameters():
        p.grad = None
    groups = list(distributed_c10d._world.pg_map) if dist.is_initialized() else []
    if dist.is_initialized():
        try:   # abort first: a destroy waits for an operation still in flight on the communicator's thread
            distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - nothing in flight to abort
            pass
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - aborted under a blocked operation already
            pass
    gc.collect()
    return groups


def regions_in(space, spec, rank: int) -> dict:
    """The regions rank ``rank`` of the plan in ``spec`` (a run file) holds: name -> box."""
    import hetero
    from hetero.layout import build_layout

    plan = hetero.load_plan(spec.plan)
    return space.rank_regions(plan, build_layout(hetero.load_cluster(spec.cluster), plan).ranks[rank])
