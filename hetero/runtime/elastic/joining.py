"""A worker that joins a running in-process elastic run (a device added to the ``--cluster`` file).

The launcher starts it with :data:`~.protocol.JOIN_ENV` while the running ranks train
(:mod:`hetero.runtime.elastic.joiners`). :func:`join_run`

1. imports everything the reshard and training need and works out the parameter space, then checks
   in as ready (the launcher asks the running ranks to pause only once every joiner did);
2. waits for the coordinator's decision (taken when every running rank paused at a step boundary),
   and takes part in the exchange as a member that holds no state
   (:func:`hetero.runtime.reshard.live.reconfigure` with nothing live);
3. builds its trainer for its new rank around what it received, as a survivor rebuilds its own
   (:meth:`~hetero.runtime.elastic.reconfig.LiveReconfig.adopt`), with the step results so far from
   the running rank 0, and trains on with the others from the step the state is at.
"""
from __future__ import annotations

import gc
import json
import os
import time

from hetero.runtime.elastic.protocol import JOIN_ENV, history_key, ready_key, timing_key


def join_run(live, spec):
    """``(trainer, end)`` for this joining process (``live``: its
    :class:`~hetero.runtime.elastic.reconfig.LiveReconfig`, ``spec``: the new plan's run file), or None
    when the decision leaves it out (the change was dropped, or went through a handoff)."""
    from types import SimpleNamespace

    import torch

    import hetero
    from hetero.runtime.elastic.reconfig import import_training_modules, members_world, regions_in
    from hetero.runtime.reshard.live import await_decision, reconfigure
    from hetero.runtime.reshard.space import ParameterSpace
    from hetero.runtime.reshard.transfer import prepare_regions

    import_training_modules()   # now, not in the downtime

    gen, me = (int(x) for x in os.environ[JOIN_ENV].split(":"))
    opts = spec.options
    torch.manual_seed(opts.seed)
    torch.set_num_threads(max(1, opts.threads))
    space = ParameterSpace(hetero.load_model(spec.model))
    live.space, live.rank = space, me
    # the regions the new plan gives this rank, allocated and touched now, while the others train:
    # the exchange then writes into mapped memory (a fresh 300 MB costs ~0.1 s of page faults)
    prepared = prepare_regions(regions_in(space, spec, int(os.environ["RANK"])))
    gc.collect()   # as LiveReconfig.first_world: frozen before this process makes any process group
    gc.freeze()
    live.store.set(ready_key(gen, me), json.dumps({"pid": os.getpid(), "at": time.time()}))
    d = await_decision(live.store, gen, max(live.timeout_s, 600.0))   # the ranks pause after the step under way
    if d.get("handoff") or me not in d["members"]:
        return None
    at = time.time()
    place = reconfigure(live.store, gen, me, {}, timeout_s=live.timeout_s, meshes=False, space=space, decision=d,
                        prepared=prepared)
    del prepared
    t0 = time.perf_counter()
    history = json.loads(live.store.get(history_key(gen)))
    members = len(place.layout.ranks)
    members_world(live.store, gen, place, live.timeout_s)
    trainer = _bare_trainer(SimpleNamespace(options=opts, spec=spec), history["results"])
    live.gen = gen
    live.adopt(trainer, place, history.get("scale"))
    trainer.tokens_per_step = trainer.ctx.plan.global_batch_size * trainer.ctx.model.seq_length
    live.rank, live.world = place.rank, members
    live.store.set(timing_key(gen, me), json.dumps({
        "detected_at": at, "leave_s": 0.0, **place.timings, "bytes_sent": place.stats.bytes_sent,
        "bytes_received": place.stats.bytes_received, "bytes_local": place.stats.bytes_local, "member": True,
        "pid": os.getpid(), "rank_after": place.rank, "rebuild_s": time.perf_counter() - t0,
        "ready_at": time.time()}))
    return trainer, history["end"]


def _bare_trainer(ctx, results: list[dict]):
    """A :class:`~hetero.runtime.trainer.Trainer` with no world, model or engine yet (``adopt`` gives
    it those) and the run's step results so far."""
    from hetero.runtime.trainer import StepResult, TrainState, Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.ctx, trainer.allocator, trainer.hooks, trainer._pause = ctx, None, [], False
    trainer.state = TrainState(results=[StepResult(**r) for r in results])
    trainer.step = trainer.applied_step = len(results)
    return trainer
