"""The training runtime behind ``hetero launch``.

- :mod:`~hetero.runtime.launcher`: per-node torchrun commands from the cluster and rank layout; runs
  local node slots, watches workers, names failed ranks, leaves no process behind.
- :mod:`~hetero.runtime.worker`: the process torchrun starts; :mod:`~hetero.runtime.trainer` its
  step loop (with pause hooks), :mod:`~hetero.runtime.engine` the native engine,
  :mod:`~hetero.runtime.ds_engine` the DeepSpeed ZeRO engine, both implementing
  :mod:`~hetero.runtime.engine_api`'s ``Engine``; :mod:`~hetero.runtime.options` the run's one validated
  configuration (``RunOptions``), :mod:`~hetero.runtime.context` a rank's view of the run and
  :mod:`~hetero.runtime.parallel` its process groups (``ParallelLayout``).
- :mod:`~hetero.runtime.model` (GPT / Llama stages), :mod:`~hetero.runtime.pipeline` (1F1B, GPipe),
  :mod:`~hetero.runtime.grads` (gradient sync across pipeline shapes, clipping),
  :mod:`~hetero.runtime.data` (samples by global index), :mod:`~hetero.runtime.checkpoint` (DCP),
  :mod:`~hetero.runtime.collectives` (the one door to communication),
  :mod:`~hetero.runtime.reference` (single-device reference losses),
  :mod:`~hetero.runtime.trace` (Chrome / Perfetto traces, merged over an elastic run's attempts).
- :mod:`~hetero.runtime.elastic` (``--elastic``: replan on the devices left after a loss, or on those
  a change of the cluster file brings, and reshard in-process; a package whose modules depend one
  way: the launcher's controller decides, the workers' side reshards over
  :mod:`~hetero.runtime.reshard`), :mod:`~hetero.runtime.handoff` (the ranks' live state, assembled
  into a checkpoint, where the in-process path does not apply) and :mod:`~hetero.runtime.lifeline`
  (no process of a job outlives the launcher).

Python entry points::

    from hetero.runtime import launch, reference_losses
    summary = launch(cluster, model, plan, steps=5, seed=0)    # runs locally, returns the summary dict
"""
from __future__ import annotations


def launch(cluster, model, plan, *, steps: int = 5, seed: int = 0, engine: str = "native", timeout_s: float = 60.0,
           quiet: bool = True, **options) -> dict:
    """Run ``plan`` on this machine (all node slots) and return the run summary (docs/formats.md)."""
    import json
    import os
    import tempfile

    import hetero
    from hetero.runtime.launcher import prepare, run
    from hetero.runtime.spec import RunOptions

    cluster = cluster if hasattr(cluster, "groups") else hetero.load_cluster(cluster)
    model = model if hasattr(model, "num_layers") else hetero.load_model(model)
    plan = plan if hasattr(plan, "pipelines") else hetero.load_plan(plan)
    with tempfile.TemporaryDirectory(prefix="hetero-run-") as run_dir:   # removed, summary read, on exit
        summary = options.pop("summary", None) or os.path.join(run_dir, "summary.json")
        opts = RunOptions(steps=steps, seed=seed, engine=engine, timeout_s=timeout_s, quiet=quiet, summary=summary,
                          **options)
        run(prepare(cluster, model, plan, opts, run_dir=run_dir))
        with open(summary) as f:
            return json.load(f)


def reference_losses(*args, **kwargs):
    from hetero.runtime.reference import reference_losses as _ref

    return _ref(*args, **kwargs)


__all__ = ["launch", "reference_losses"]
