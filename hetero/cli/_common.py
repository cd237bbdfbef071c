"""Helpers shared by the subcommands: consoles, JSON output, loading inputs."""
from __future__ import annotations

import sys

from hetero.console import console, print_json  # noqa: F401  (the subcommands take them from here)

from .outputs import check_outputs, check_outputs_apart, folder_outputs  # noqa: F401  (for every command)


MAX_PROBLEMS = 50
"""Most problems printed for one command or file: a file that repeats one mistake (a YAML alias used
100,000 times) would otherwise print every copy."""


def print_problems(problems) -> None:
    """``error: PROBLEM`` on stderr for each of ``problems`` (Problems or strings), the first
    :data:`MAX_PROBLEMS` of them, then how many more there are."""
    problems = list(problems)
    for problem in problems[:MAX_PROBLEMS]:
        print(f"error: {problem}", file=sys.stderr)
    if len(problems) > MAX_PROBLEMS:
        print(f"error: ... and {len(problems) - MAX_PROBLEMS:,} more problems not shown (fix the ones above, "
              f"which may be the same mistake repeated, and run again)", file=sys.stderr)


def positive_int(text: str) -> int:
    """argparse ``type`` for counts that must be >= 1: anything else is a usage error (exit 2)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_fit_allocator_argument(p) -> None:
    """``--allocator`` of ``predict`` and ``plan``: the allocator whose reservation judges fit."""
    p.add_argument("--allocator", choices=("caching", "planned"),
                   help="judge fit by what this allocator reserves for each stage's peak: caching (PyTorch's "
                        "default, fragmentation included) or planned (hetero launch --allocator planned's arena); "
                        "default: the live peak itself")


def check_output(path, flag: str) -> None:
    """Before any work, fail when ``path`` (given with ``flag``: ``-o``, ``--timeline``,
    ``--summary``) cannot receive an output file, so minutes of searching, measuring or training
    are not lost to a typo. Its missing directories are not made yet: :func:`write_output` makes
    them when the file is written, so a run that fails in between leaves nothing behind."""
    from hetero.specs.io import check_output_path

    check_output_path(path, flag)


def write_output(path, flag: str, content) -> None:
    """Write one output file of a subcommand, the one way every ``-o`` / ``--timeline`` output is
    written: missing parent directories are made, the text goes to a temporary file in the same
    directory that then replaces ``path`` (:func:`hetero.specs.io.write_text_atomic`), and a failed
    write leaves neither a partial file nor a directory it made (an existing file keeps its old
    content). ``content``: the text, or a writer ``content(path)`` built on ``write_text_atomic``
    (``Plan.save``, ``Calibration.save``), whose errors name ``flag`` too (:func:`output_named`).
    A failure is an error naming ``flag`` and the path."""
    from hetero.errors import HeteroError
    from hetero.specs.io import output_named, write_text_atomic

    try:
        if isinstance(content, (str, bytes)):
            write_text_atomic(path, content, flag)
        else:
            with output_named(flag):
                content(path)
    except OSError as e:
        raise HeteroError(f"{flag} {path}: cannot write it: {e.strerror or e} (fix: check the path, its "
                          f"permissions and free space)") from None


def load_inputs(args, need_plan: bool = True, need_cluster: bool = True):
    """Load ``--cluster``, ``--model`` and (optionally) ``--plan`` and check the plan against them;
    without ``need_cluster`` (the cluster is then None) the plan is checked against the model alone."""
    from hetero.specs.cluster import load_cluster
    from hetero.specs.errors import SpecError
    from hetero.specs.model import load_model
    from hetero.specs.plan import check_plan_model, load_plan

    problems = []

    def attempt(load, *inputs):
        """``load(*inputs)``, or None with its problems collected (so all files are reported at once)."""
        try:
            return load(*inputs)
        except SpecError as e:
            problems.extend(e.problems)
            return None

    cluster = attempt(load_cluster, args.cluster) if need_cluster else None
    model = attempt(load_model, args.model)
    plan = attempt(load_plan, args.plan, cluster, model) if need_plan else None
    if not need_cluster and model is not None and plan is not None:
        attempt(check_plan_model, plan, model, args.plan)
    if not need_plan and cluster is not None and model is not None:   # a search may use every group
        from hetero.specs.cluster import model_problems

        problems.extend(model_problems(cluster, model))
    if problems:
        raise SpecError(problems)
    return cluster, model, plan


def memory_problems(cluster, model, plan, source: str, calibration=None, prediction=None) -> list:
    """One :class:`~hetero.specs.errors.Problem` per stage of ``plan`` that the predictor says does
    not fit its devices' memory (its need, the capacity, the fix), naming the plan's file (``source``)
    and the stage's field: what ``validate`` reports and ``launch`` refuses. ``prediction``: one already made."""
    from hetero.specs.errors import Problem
    from hetero.specs.units import format_quantity

    if prediction is None:
        from hetero.predictor import predict

        prediction = predict(cluster, model, plan, calibration=calibration, check=False)
    out = []
    for pi, si, s in prediction.memory_shortfalls():
        need, have = (format_quantity(x, "bytes") for x in (s.peak_memory_bytes, s.memory_capacity_bytes))
        out.append(Problem(
            f"pipelines[{pi}].stages[{si}]",
            f"does not fit: the stage ({s.group}, tp {s.tp}, layers [{s.layers[0]}, {s.layers[1]})) needs {need} per "
            f"device, and a device of group {s.group} holds {have}",
            "more stages or tensor parallelism for these layers, a smaller micro_batch_size, recompute: full, or "
            "`hetero plan` for a plan that fits; an emulated device type may set a larger 'memory'",
            source))
    return out


def warn_if_cpu_unprofiled(cluster, provenance: dict) -> None:
    """On stderr (so ``--json`` users see it too): the cluster's CPU-family devices (emulated ones
    included) are predicted without a profile of this machine, from generic CPU figures that can be
    several times off, until ``hetero profile`` has measured it once."""
    devices = [dev for dev, info in provenance.items()
               if cluster.device_type(info["groups"][0]).family == "cpu" and info.get("op_model") != "profile"]
    if devices:
        console(stderr=True).print(
            f"[bold yellow]warning[/bold yellow]: this machine's CPU has no profile yet, so {', '.join(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} predicted from generic CPU figures, which can be several times "
            f"off; run `hetero profile` once (a few minutes, cached for every later prediction)", soft_wrap=True)


def warn_cross_node_tp(cluster, plan, source: str) -> None:
    """A warning on stderr per stage whose tp group spans whole nodes: predicted with its all-reduces
    over the inter-node links (as Megatron runs it), but ``hetero launch`` refuses it."""
    from rich.markup import escape

    from hetero.specs.plan import cross_node_tp

    link = cluster.network.inter_node
    for pi, si, tp, nodes in cross_node_tp(plan, cluster):
        console(stderr=True).print(
            f"[yellow]warning[/yellow]: {escape(str(source))}: pipelines[{pi}].stages[{si}]: tp={tp} spans {nodes} "
            f"nodes, so its all-reduces cross network.inter_node ({link.bandwidth / 1e9:g} GB/s per node), which "
            f"the prediction charges; `hetero launch` keeps tensor parallelism inside a node and refuses this plan",
            soft_wrap=True)


def warn_if_calibration_unused(calibration, cluster, source: str) -> None:
    """A calibration that covers none of the cluster's device types changes nothing: say so on
    stderr, so an uncalibrated prediction is not taken for a calibrated one."""
    used = [g.device for g in cluster.groups
            if calibration.factors_for(g.device, cluster.device_type(g.name)) is not None]
    if not used:
        fitted = ", ".join(sorted(calibration.factors)) or "no device type"
        devices = ", ".join(sorted({g.device for g in cluster.groups}))
        console(stderr=True).print(f"[yellow]warning[/yellow]: {source} has factors for {fitted}, none of this "
                                   f"cluster's devices ({devices}): the prediction is uncalibrated")


def load_calibration_arg(path, cluster):
    """The calibration ``--calibration PATH`` names (None when the option is not given), with the
    warning of :func:`warn_if_calibration_unused`. An empty path (an unset shell variable) is an
    error, not a prediction silently left uncalibrated."""
    if path is None:
        return None
    from hetero.errors import HeteroError
    from hetero.predictor.calibration import load_calibration

    if not path.strip():
        raise HeteroError("--calibration: no file named (fix: give the file `hetero calibrate` wrote, "
                          "or leave --calibration out)")
    calibration = load_calibration(path)   # a missing or bad file: a CalibrationError naming it
    warn_if_calibration_unused(calibration, cluster, path)
    return calibration


def host_memory_note(cluster, plan, prediction) -> str | None:
    """A note when a local CPU emulation (every group one node on this machine: ``hosts`` absent
    or localhost) is predicted to need more memory in all than this machine has. CPU devices take
    their capacity from their device type (the catalog's generic CPU socket unless the cluster file
    sets ``memory``), so each may fit while all of them together do not fit here."""
    import os

    from hetero.runtime.launcher import is_this_machine

    local = all(g.nodes == 1 and all(is_this_machine(h) for h in (g.hosts or [None])) for g in cluster.groups)
    if not local or any(cluster.device_type(g.name).family != "cpu" for g in cluster.groups):
        return None
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    need = sum(pp.replicas * s.tp * s.peak_memory_bytes
               for pp, p in zip(prediction.pipelines, plan.pipelines)
               for s in pp.stages[:len(plan.physical_stages(p))])
    if need <= host:
        return None
    gib = 2 ** 30
    return (f"the plan's processes need {need / gib:.1f} GiB in all, this machine has {host / gib:.1f} GiB "
            f"(each CPU device is checked against its device type's memory; set 'memory' in the cluster "
            f"file's device types to plan for this machine)")
