"""The training worker: ``python -m hetero.runtime.worker --spec RUN.json`` (started by torchrun).

Its rank is derived from the launcher's node slot (``HETERO_NODE_SLOT``) and ``LOCAL_RANK``
against the rank layout in the run file, and checked against torchrun's ``RANK``. It leaves
``rank<r>.pid`` / ``.ready`` / ``.done`` / ``.error.json`` files in the run directory, which
the launcher watches to name a rank that died or never arrived.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from hetero.runtime.elastic.protocol import JOIN_ENV, PAUSE_REQUEST
from hetero.runtime.lifeline import end_with_parent
from hetero.runtime.spec import SPEC_ENV, RunSpec, derive_rank, describe_rank
from hetero.runtime.spec import write_rank_file as _write


def main(argv: list[str] | None = None) -> int:
    end_with_parent()   # never train on after the node launcher (or elastic launcher) died
    ap = argparse.ArgumentParser(prog="hetero.runtime.worker")
    ap.add_argument("--spec", default=os.environ.get(SPEC_ENV))
    args, _extra = ap.parse_known_args(argv)
    if os.environ.get("HETERO_RL_RUN"):   # a `hetero rl` run: its processes are hetero.rl.worker's
        from hetero.rl.worker import main as rl_main

        return rl_main(args.spec)
    spec = RunSpec.load(args.spec)
    rank = derive_rank(spec)
    run_dir = spec.options.run_dir
    base = os.path.join(run_dir, f"rank{rank}") if run_dir else None
    if base:
        _write(base + ".pid", str(os.getpid()))
    info = spec.rank_layout().ranks[rank]
    step_box = {"step": 0, "phase": "setting up (model, process groups, --load)", "trainer": None, "base": base,
                "info": info, "rank": rank}
    live = None
    if spec.options.elastic:
        from hetero.runtime.elastic.reconfig import LiveReconfig

        live = LiveReconfig.from_env(rank, len(spec.layout), spec.options.timeout_s)
        if live is None:   # under torchrun: its stop signal must not end a survivor before its handoff
            _outlive_node_stop()
    try:
        joined = None
        if live is not None and os.environ.get(JOIN_ENV):   # a device that joins a running in-process run
            from hetero.runtime.elastic.joining import join_run

            step_box["phase"] = "joining the running ranks"
            joined = join_run(live, spec)
            if joined is None:   # the change went another way: nothing of this process is needed
                return 0
        paused = _train(spec, rank, base, step_box, live, joined)
        base = step_box["base"]
        if base:
            _write(base + (".left" if paused == "left" else ".done"), "ok")
        if paused == "left":   # served its state to the new plan, which leaves it out
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if paused:   # the launcher starts the next plan now: skip the interpreter's teardown (~1 s)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher
        from hetero.errors import lost_connection
        from hetero.runtime.trainer import InjectedFailure

        injected = isinstance(e, InjectedFailure)
        msg = str(e) if injected else f"{type(e).__name__}: {e}"
        base, info, rank = step_box["base"], step_box["info"], step_box["rank"]
        if base and spec.options.elastic and live is None and not injected and step_box["phase"] == "training":
            _hand_off(base, step_box["trainer"], describe_rank(info))
        if base:
            _write(base + ".error.json", json.dumps({
                "rank": rank, "pid": os.getpid(), "time": time.time(), "step": step_box["step"] + 1,
                "phase": step_box["phase"],
                "kind": "injected" if injected else "exception", "where": describe_rank(info),
                "message": msg, "traceback": "" if injected else traceback.format_exc()[-4000:]}))
        lost_peer = spec.options.elastic and live is None and not injected and lost_connection(msg)
        if lost_peer:   # a survivor of a lost device: the launcher's 'elastic:' lines tell the story once
            msg = f"lost a peer at step {step_box['step'] + 1} (its process ended); state handed off"
        if lost_peer or not base:   # with an error file the launcher reports it: printing it here too said it twice
            print(f"[hetero worker] {describe_rank(info)}: {msg}", file=sys.stderr, flush=True)
        if injected:
            os._exit(17)  # die like a crashed process: no clean shutdown of the process group
        return 1


def _outlive_node_stop() -> None:
    """Elastic runs: the SIGTERM torchrun sends the other workers of a node when one of them fails
    must not kill a survivor before it has handed off its state, so it is ignored: the survivor's
    next collective with the failed peer raises, the handoff follows, and the worker exits."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: None)


def _hand_off(base: str, trainer, where: str) -> None:
    """Write this survivor's live state (:mod:`hetero.runtime.handoff`); a failure to do so is said,
    and the launcher then finds no state for this rank."""
    if trainer is None:
        return
    try:
        from hetero.runtime.handoff import write_handoff

        write_handoff(base, trainer)
    except Exception as e:  # noqa: BLE001 - the failure report must still be written
        print(f"[hetero worker] {where}: could not hand off its state: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)


def _train(spec: RunSpec, rank: int, base: str | None, step_box: dict, live=None, joined=None) -> bool | str:
    """Train the run's steps; True when the ranks paused for a cluster change and handed off;
    ``"left"`` when an in-process reconfiguration (``live``, :mod:`hetero.runtime.elastic.reconfig`)
    left this rank out of the new plan after it served its state. ``joined``: ``(trainer, end)`` of a
    process that joined a running in-process run (:mod:`hetero.runtime.elastic.joining`)."""
    from hetero.runtime.report import Reporter
    from hetero.runtime.trainer import InjectedFailure, Trainer, summary_dict

    if joined is not None:
        trainer, end = joined
        if base:
            _write(base + ".ready", "ok")
    else:
        if live is not None:
            live.first_world()
        trainer = Trainer(spec, rank, on_ready=(lambda: _write(base + ".ready", "ok")) if base else None)
    if live is not None:
        live.watch(trainer)
        trainer.add_hook(lambda t, _result: live.prepare_ahead(t))   # devices about to join: regions ahead
        trainer.add_hook(lambda _t, _result: live.resolve_ahead())   # each single loss's transition, ahead
        if trainer.ctx.device.type == "cpu":   # what a step frees stays mapped for a reshard's tensors
            from hetero.runtime.host_memory import keep_freed_host_memory

            keep_freed_host_memory()
            trainer.add_hook(lambda _t, _result: live.reserve_ahead())   # and as much as a loss needs
    step_box["trainer"] = trainer
    opts = spec.options
    if base and opts.elastic:   # the launcher times an elastic restart up to here (state loaded)
        _write(base + ".training", repr(time.time()))
    reporter = Reporter(trainer) if rank == 0 and not opts.quiet else None
    if reporter:
        reporter.header()

    def log(result):
        step_box["step"] = result.step
        if reporter:
            reporter.step(result)

    step_box["phase"] = "training"
    if base and opts.elastic:   # the launcher asks for a pause when the cluster file changed
        trainer.add_hook(lambda t, _result: not os.path.exists(os.path.join(t.ctx.options.run_dir, PAUSE_REQUEST)))
    if joined is None:
        end = trainer.step + opts.steps
    if live is not None:
        live.end = end
    while True:
        detected = None
        try:
            trainer.train(end - trainer.step, log=log)
        except InjectedFailure:
            raise
        except Exception as e:  # noqa: BLE001 - a lost peer is survived in-process; anything else ends the run
            if live is None or not (live.aborted or live.applies(e)):
                raise
            detected = time.time()
        # out of the handler: its traceback's frames hold the broken world's groups, which must be
        # freed for their connections to close (that wakes the peers blocked on this rank)
        if detected is None and (trainer.step >= end or live is None):
            break
        step_box["phase"] = "resharding after a lost peer" if detected else "resharding (the cluster changed)"
        # a pause (no failure): reshard in-process, or (None) hand off through the run directory below
        outcome = live.recover(trainer, detected) if detected is not None else live.pause(trainer)
        if outcome is None:
            break
        if not outcome:
            return "left"
        rank, opts = trainer.rank, trainer.ctx.options
        base = os.path.join(opts.run_dir, f"rank{rank}") if base else None
        step_box.update(base=base, info=trainer.ctx.me, rank=rank, phase="training")
        if base:
            _write(base + ".pid", str(os.getpid()))
            _write(base + ".training", repr(time.time()))
        reporter = Reporter(trainer) if rank == 0 and not opts.quiet else None
    if trainer.step < end:   # paused: hand the live state to the next plan
        step_box["phase"] = "handing off its state (the cluster changed)"
        paused = {"rank": rank, "applied_step": trainer.applied_step}
        if trainer.ctx.plan.zero_stage:
            # ZeRO keeps each optimizer slice on one rank: every rank is here, so the collective
            # checkpoint gathers them (the handoff of a failure writes what each rank holds alone)
            from dataclasses import asdict

            paused["checkpoint"] = os.path.join(opts.run_dir, "paused-checkpoint")
            paused["results"] = [asdict(r) for r in trainer.state.results]
            trainer.save(paused["checkpoint"])
        else:
            from hetero.runtime.handoff import write_handoff

            write_handoff(base, trainer)
        if opts.trace:   # this attempt's part of the elastic run's trace (every rank is here)
            _write_trace(trainer, opts.trace)
        _write(base + ".paused", json.dumps(paused))
        trainer.comm.barrier()
        trainer.comm.shutdown()
        return True
    if opts.save:
        step_box["phase"] = "saving the checkpoint (--save)"
        trainer.save(opts.save)
    step_box["phase"] = "finishing (summary, trace)"
    if opts.trace:
        _write_trace(trainer, opts.trace)
    state_bytes = trainer.gather_optimizer_state_bytes()
    allocator_stats = trainer.gather_allocator_stats()
    if rank == 0:
        predicted = predict_iteration_time(trainer.ctx)
        summary = summary_dict(trainer, predicted, state_bytes, allocator_stats)
        # the user's --summary / --trace: written as the CLI writes every output (parents made,
        # atomic, nothing left behind on failure); _write is for the run directory's own files
        from hetero.specs.io import write_text_atomic

        if opts.summary:
            write_text_atomic(opts.summary, json.dumps(summary, indent=2), "--summary")
        if reporter:
            reporter.footer(summary)
    trainer.comm.barrier()
    trainer.comm.shutdown()
    return False


def _write_trace(trainer, path: str) -> None:
    """Gather every rank's events (a collective: all ranks call it); rank 0 writes the trace, as the
    CLI writes every output (parents made, atomic, nothing left behind on failure)."""
    from hetero.runtime.trace import trace_dict
    from hetero.specs.io import write_text_atomic

    events = trainer.gather_events()
    if events is not None:
        write_text_atomic(path, json.dumps(trace_dict(trainer.ctx.layout, events)), "--trace")


def predict_iteration_time(ctx) -> float | None:
    """``hetero.predict(...).iteration_time_s`` when the predictor is installed, else None."""
    try:
        import hetero

        return float(hetero.predict(ctx.cluster, ctx.model, ctx.plan).iteration_time_s)
    except Exception:  # noqa: BLE001 - a missing or failing predictor must not fail the run
        return None


if __name__ == "__main__":
    code = main()
    if code:
        # A failed rank can still have a collective in flight on a Gloo thread. The interpreter's
        # normal teardown then destroys that thread joinable, and C++ aborts with "terminate called
        # without an active exception" after hetero's report. The report is written and printed by
        # now, so skip the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
