"""Run logs: measured whole-run iteration times (docs/formats.md), read, validated and turned into predictor inputs.

:func:`read_runs` reads a run-log CSV into :class:`Run` s (errors name the file, row and column).
Each run-log row is one homogeneous Megatron-style run. :func:`run_setup` turns it into a model spec
(gpt unless an ``architecture`` column says otherwise), a one-group slice of ``cluster`` (the first
group holding the row's device type whose nodes can hold the row's layout, ``num_devices /
devices_per_node`` nodes; a run smaller than a node gets one partial node) and a plan (one pipeline
shape, ``dp`` replicas, ``pp`` stages of ``tp`` devices, layers split evenly,
``global_batch / (dp x micro_batch)`` micro-batches), which
:mod:`hetero.predictor.calibration` predicts with :func:`hetero.predictor.predict` itself.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from hetero.errors import HeteroError
from hetero.specs.errors import did_you_mean

REQUIRED = ("device", "devices_per_node", "num_devices", "global_batch_size", "micro_batch_size", "hidden_size",
            "num_attention_heads", "num_layers", "seq_length", "vocab_size", "dtype", "recompute", "tp", "dp",
            "pp", "iteration_time_ms")
INT_COLUMNS = ("devices_per_node", "num_devices", "global_batch_size", "micro_batch_size", "hidden_size",
               "num_attention_heads", "num_layers", "seq_length", "vocab_size", "tp", "dp", "pp")
OPTIONAL_INT = ("ffn_hidden_size", "num_kv_heads", "zero_stage")
CHOICES = {"dtype": ("fp32", "fp16", "bf16"), "recompute": ("none", "selective", "full"),
           "architecture": ("gpt", "llama"), "schedule": ("gpipe", "1f1b", "interleaved")}
KNOWN = REQUIRED + OPTIONAL_INT + tuple(c for c in CHOICES if c not in REQUIRED) + ("dropout",)
"""Every column a run log may have; any other is an error (a misspelt optional column would be ignored)."""


class CalibrationError(HeteroError):
    """Bad run log or calibration file: the message names the file, row / field and column."""


@dataclass(frozen=True)
class Run:
    """One row of a run log (a homogeneous Megatron-style run)."""

    device: str
    devices_per_node: int
    num_devices: int
    global_batch_size: int
    micro_batch_size: int
    hidden_size: int
    num_attention_heads: int
    num_layers: int
    seq_length: int
    vocab_size: int
    dtype: str
    recompute: str
    tp: int
    dp: int
    pp: int
    iteration_time_ms: float
    architecture: str = "gpt"
    ffn_hidden_size: int | None = None
    num_kv_heads: int | None = None
    schedule: str = "1f1b"
    zero_stage: int = 0
    dropout: float = 0.0
    """Optional column: Megatron's hidden / attention dropout (adds the dropout kernels)."""
    row: int = 0
    """Line number in the CSV (header = 1)."""
    source: str = "<runs>"

    @property
    def where(self) -> str:
        return f"{self.source}, row {self.row}"

    @property
    def micro_batches(self) -> int:
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def iteration_time_s(self) -> float:
        return self.iteration_time_ms * 1e-3

    def describe(self) -> str:
        return (f"{self.num_devices}x{self.device} h{self.hidden_size} L{self.num_layers} s{self.seq_length} "
                f"gbs{self.global_batch_size} mbs{self.micro_batch_size} tp{self.tp} dp{self.dp} pp{self.pp}")


def read_runs(path) -> list[Run]:
    """Read and validate a run-log CSV; errors name the file, the row and the column."""
    from hetero.specs.io import InputFileError, read_user_text

    path = Path(path)
    source = str(path)
    try:
        text = read_user_text(path, "run log")
    except InputFileError as e:
        raise CalibrationError(f"{source}: {e.message} (fix: {e.fix})") from None
    with io.StringIO(text, newline="") as fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in (reader.fieldnames or [])]
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise CalibrationError(f"{source}: missing column{'s' if len(missing) > 1 else ''} "
                                   f"{', '.join(repr(c) for c in missing)} (a run log needs: {', '.join(REQUIRED)})")
        for col in header:
            if header.count(col) > 1:
                raise CalibrationError(f"{source}, column '{col}': appears twice in the header (fix: keep one)")
            if col not in KNOWN:
                raise CalibrationError(f"{source}, column '{col}': unknown column (fix: {did_you_mean(col, KNOWN)}; "
                                       f"a run log has: {', '.join(KNOWN)})")
        runs = []
        for i, raw in enumerate(reader, start=2):
            cells = [v for v in raw.values() if isinstance(v, str)] + list(raw.get(None, ()))
            if not any(c.strip() for c in cells):   # a blank line, or only commas
                continue
            if len(cells) != len(header):   # cells beyond the header / a row cut short
                raise CalibrationError(f"{source}, row {i}: has {len(cells)} cells but the header has {len(header)} "
                                       f"columns (fix: one cell per column, empty cells for blanks)")
            row = {k.strip(): v.strip() for k, v in raw.items()}   # every cell a string, under its header
            runs.append(_parse_run(row, i, source))
    if not runs:
        raise CalibrationError(f"{source}: no runs (the file has a header but no rows)")
    return runs


def _parse_run(row: Mapping, i: int, source: str) -> Run:
    def where(col):
        return f"{source}, row {i}, column '{col}'"

    def integer(col, value):
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise CalibrationError(f"{where(col)}: '{value}' is not a number") from None
        if f != int(f) or f < (0 if col == "zero_stage" else 1):
            raise CalibrationError(f"{where(col)}: expected a positive whole number, got '{value}'")
        return int(f)

    vals: dict = {}
    for col in INT_COLUMNS:
        vals[col] = integer(col, row.get(col))
    for col in OPTIONAL_INT:
        if row.get(col):
            vals[col] = integer(col, row[col])
    t = row.get("iteration_time_ms")
    try:
        vals["iteration_time_ms"] = float(t)
    except (TypeError, ValueError):
        raise CalibrationError(f"{where('iteration_time_ms')}: '{t}' is not a number") from None
    if not (vals["iteration_time_ms"] > 0 and math.isfinite(vals["iteration_time_ms"])):
        raise CalibrationError(f"{where('iteration_time_ms')}: must be a positive time in ms, got '{t}'")
    if row.get("dropout"):
        try:
            vals["dropout"] = float(row["dropout"])
        except ValueError:
            raise CalibrationError(f"{where('dropout')}: '{row['dropout']}' is not a number") from None
    vals["device"] = row.get("device") or ""
    if not vals["device"]:
        raise CalibrationError(f"{where('device')}: empty (name a device type of the cluster)")
    for col, choices in CHOICES.items():
        value = row.get(col)
        if value in (None, ""):
            if col in REQUIRED:
                raise CalibrationError(f"{where(col)}: empty (one of {', '.join(choices)})")
            continue
        if value not in choices:
            raise CalibrationError(f"{where(col)}: '{value}' is not one of {', '.join(choices)}")
        vals[col] = value
    run = Run(row=i, source=source, **vals)
    if run.tp * run.dp * run.pp != run.num_devices:
        raise CalibrationError(f"{where('num_devices')}: tp x dp x pp = {run.tp}x{run.dp}x{run.pp} = "
                               f"{run.tp * run.dp * run.pp}, not num_devices={run.num_devices}")
    if run.global_batch_size % (run.dp * run.micro_batch_size):
        raise CalibrationError(f"{where('global_batch_size')}: {run.global_batch_size} is not a multiple of "
                               f"dp x micro_batch_size = {run.dp * run.micro_batch_size}")
    if run.num_layers < run.pp:
        raise CalibrationError(f"{where('pp')}: {run.pp} stages for {run.num_layers} layers")
    return run


# ============================================================================ run -> (cluster, model, plan)
def run_setup(cluster, run: Run):
    """(one-group cluster slice, model spec, plan) that ``run`` describes (see the module docstring).

    Tensor parallelism wider than a node (Megatron allows it; our plans do not) is modelled as a
    group of ``tp``-device "nodes" whose device-to-device link is the inter-node network: that is
    the link such a TP ring is bound by.
    """
    from hetero.specs.cluster import Cluster, Group
    from hetero.specs.errors import SpecError
    from hetero.specs.model import load_model
    from hetero.specs.plan import load_plan

    group = group_for(cluster, run)
    per, nodes, intra = run.devices_per_node, run.num_devices // run.devices_per_node, group.intra_node
    if run.num_devices < run.devices_per_node:
        per, nodes = run.num_devices, 1
    elif run.num_devices % run.devices_per_node:
        raise CalibrationError(f"{run.where}, column 'num_devices': {run.num_devices} devices are not whole "
                               f"nodes of devices_per_node={run.devices_per_node}")
    if run.tp > per:
        per, nodes, intra = run.tp, run.num_devices // run.tp, cluster.network.inter_node
    g = Group(name=group.name, device=group.device, nodes=nodes, devices_per_node=per, intra_node=intra)
    sliced = Cluster(name=f"{cluster.name}[{run.device}x{run.num_devices}]", groups=(g,), network=cluster.network,
                     devices=cluster.devices, device_types={g.name: cluster.device_type(group.name)},
                     source=cluster.source)
    model_dict = dict(name=f"run-row{run.row}", architecture=run.architecture, num_layers=run.num_layers,
                      hidden_size=run.hidden_size, num_attention_heads=run.num_attention_heads,
                      vocab_size=run.vocab_size, seq_length=run.seq_length, dtype=run.dtype,
                      dropout=run.dropout)
    if run.ffn_hidden_size:
        model_dict["ffn_hidden_size"] = run.ffn_hidden_size
    if run.num_kv_heads:
        model_dict["num_kv_heads"] = run.num_kv_heads
    L, pp = run.num_layers, run.pp
    bounds = [k * L // pp for k in range(pp + 1)]   # even split (remainder spread over the stages)
    stages = [dict(group=g.name, tp=run.tp, layers=[bounds[k], bounds[k + 1]]) for k in range(pp)]
    plan_dict = dict(global_batch_size=run.global_batch_size, micro_batch_size=run.micro_batch_size,
                     schedule=run.schedule, recompute=run.recompute, zero_stage=run.zero_stage,
                     pipelines=[dict(replicas=run.dp, micro_batches=run.micro_batches, stages=stages)])
    try:
        model = load_model(model_dict)
        plan = load_plan(plan_dict, sliced, model)
    except SpecError as e:
        raise CalibrationError(f"{run.where}: this run is not a valid model/plan: "
                               + "; ".join(str(p) for p in e.problems)) from None
    return sliced, model, plan


def group_for(cluster, run: Run):
    """The first group of ``cluster`` that holds ``run``'s device type and can host its layout:
    ``num_devices`` of them, nodes at least ``devices_per_node`` wide, and enough nodes for the run at
    that many per node (an error naming the run, its row and the column when none can)."""
    holding = [g for g in cluster.groups if g.device == run.device]
    if not holding:
        names = sorted({g.device for g in cluster.groups})
        raise CalibrationError(f"{run.where}, column 'device': no group of cluster '{cluster.name}' holds "
                               f"'{run.device}' (its device types: {', '.join(names)})")
    big_enough = [g for g in holding if g.num_devices >= run.num_devices]
    if not big_enough:
        have = " / ".join(f"group '{g.name}' has {g.num_devices} ({g.nodes} nodes x {g.devices_per_node})"
                          for g in holding)
        raise CalibrationError(f"{run.where}, column 'num_devices': the run uses {run.num_devices} {run.device} "
                               f"devices but {have} in cluster '{cluster.name}' (fix: give the cluster the runs were "
                               f"measured on, or drop the row)")
    misfits = []
    for g in big_enough:
        misfit = _layout_misfit(g, run)
        if misfit is None:
            return g
        misfits.append(misfit)
    raise CalibrationError(f"{run.where}, column 'devices_per_node': {' / '.join(misfits)} in cluster "
                           f"'{cluster.name}' (fix: give the devices per node the run had, or the cluster the runs "
                           f"were measured on)")


def _layout_misfit(group, run: Run) -> str | None:
    """Why ``group`` cannot host ``run``'s node layout, or None when it can.

    :func:`run_setup` models the run with the row's ``devices_per_node`` (the sliced group gets that
    many devices per node, with the group's intra-node link between them), so the row must describe
    a layout the group's nodes can really hold. A row with more devices per node than the group's
    nodes have would be predicted with intra-node links between devices that sit on different nodes
    of this cluster: an error. Fewer is a real layout (a run using part of each node, e.g. 4 ranks
    on 8-device nodes), modelled as such, as long as the group has the nodes it then needs.
    """
    per = run.devices_per_node
    if per > group.devices_per_node:
        return (f"the run has {per} devices per node but group '{group.name}' has {group.devices_per_node} "
                f"per node")
    nodes = max(1, math.ceil(run.num_devices / per))
    if nodes > group.nodes:
        return (f"the run's {run.num_devices} devices at {per} per node take {nodes} nodes but group "
                f"'{group.name}' has {group.nodes} nodes (of {group.devices_per_node} devices)")
    return None


__all__ = ["CalibrationError", "Run", "group_for", "read_runs", "run_setup"]
