"""Live-state handoff for elastic runs (``hetero launch --elastic``).

When a peer fails, every surviving rank writes what it holds, as of the last optimizer step it
applied, into the run directory before it exits (and so does every rank when they pause for a
change of the cluster file, :mod:`hetero.runtime.elastic.watch`): its parameters and AdamW
moments (tp ranks: their local shards, with the split dimension), the step, the fp16 loss scale,
and the step results every rank shares (losses, times). That is the live state: nothing is read
back from an older checkpoint.

The launcher then assembles the full tensors from the survivors (:meth:`Survivors.assemble`): each
parameter from one tp group whose shards all survived at the newest step every parameter has such
a copy at (survivors a step apart: see there), any data-parallel replica will do, and writes them as
the plan-independent checkpoint of :mod:`hetero.runtime.checkpoint`
(:func:`~hetero.runtime.checkpoint.save_assembled_checkpoint`), which ranks of the new plan
load and reshard as any ``--load``. A parameter no survivor holds (a stage without a replica) ends
the run with an error that names its layers.

Files per rank ``r``: ``rank<r>.handoff.pt`` (tensors only; read with ``torch.load(weights_only=True)``)
and ``rank<r>.handoff.json`` (the step, results and shard layout), written before ``rank<r>.error.json``
so the launcher never sees a report whose state is half-written.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from hetero.errors import HeteroError
from hetero.runtime.spec import describe_rank


def write_handoff(base: str, trainer) -> None:
    """Write this rank's live state next to ``base`` (``<run_dir>/rank<r>``); no communication."""
    from hetero.runtime.grads import local_part

    engine, me = trainer.engine, trainer.ctx.me
    state: dict[str, torch.Tensor] = {}
    shards: dict[str, dict] = {}
    for name, p in engine.module.named_parameters():
        dim = _shard_dim(p)
        state[f"model/{name}"] = local_part(p.detach()).to("cpu", copy=True)
        st = engine.optimizer.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                state[f"optim/{name}/{k}"] = local_part(st[k]).to("cpu", copy=True)
        if "step" in st:
            state[f"optim/{name}/step"] = torch.as_tensor(st["step"], dtype=torch.float32).to("cpu", copy=True)
        if me.tp_size > 1:
            shards[name] = {"dim": dim, "tp_rank": _mesh_rank(p, me.tp_rank), "tp_size": me.tp_size}
    tmp = f"{base}.handoff.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, base + ".handoff.pt")
    scaler = getattr(engine, "scaler", None)
    meta = {"rank": trainer.rank, "applied_step": trainer.applied_step,
            "results": [asdict(r) for r in trainer.state.results], "shards": shards,
            "loss_scale": scaler.scale if scaler else None,
            # --trace: this rank's forward / backward events, since the survivors cannot gather them
            "events": trainer.state.events if trainer.ctx.options.trace else []}
    tmp = f"{base}.handoff.json.tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, base + ".handoff.json")


def _shard_dim(p) -> int | None:
    """The dimension a tp DTensor parameter is split along (None: replicated or not a DTensor)."""
    for placement in getattr(p, "placements", ()):
        if getattr(placement, "is_shard", lambda: False)():
            return int(placement.dim)
    return None


def _mesh_rank(p, default: int) -> int:
    mesh = getattr(p, "device_mesh", None)
    return int(mesh.get_local_rank()) if mesh is not None else default


class Survivors:
    """The handoffs that survivors of a failed attempt left in its run directory."""

    def __init__(self, run_dir: str, layout):
        self.layout = layout
        self.meta: dict[int, dict] = {}
        for info in layout.ranks:
            path = os.path.join(run_dir, f"rank{info.rank}.handoff.json")
            if os.path.exists(path) and os.path.exists(path[:-len(".json")] + ".pt"):
                with open(path) as f:
                    self.meta[info.rank] = json.load(f)
        self.run_dir = run_dir

    @property
    def ranks(self) -> list[int]:
        return sorted(self.meta)

    def results(self) -> list[dict]:
        """The step results of the attempt (every rank has them after each step's all-reduce)."""
        return max((m["results"] for m in self.meta.values()), key=len, default=[])

    def loss_scale(self, step: int) -> float | None:
        """The fp16 loss scale of the ranks whose state is at ``step`` (None: not fp16)."""
        return next((m["loss_scale"] for m in self.meta.values()
                     if m["applied_step"] == step and m.get("loss_scale") is not None), None)

    def events(self) -> list[list]:
        """Every rank's trace events as handed off (a lost rank's: none)."""
        return [self.meta.get(info.rank, {}).get("events", []) for info in self.layout.ranks]

    def _tensors(self, rank: int) -> dict[str, torch.Tensor]:
        path = os.path.join(self.run_dir, f"rank{rank}.handoff.pt")
        return torch.load(path, map_location="cpu", weights_only=True)

    def assemble(self, holders: dict[str, tuple[int, ...]]) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest step at which every parameter has a whole copy among the survivors whose state is
        at that step, and the full tensors there (``holders``: name -> ranks of the failed plan): every
        parameter and its AdamW state, keyed as the checkpoint keys them.

        Survivors normally all stand at one step. A rank lost inside a step's gradient-norm
        all-reduce can leave some at step t (they got the norm and applied the update) and the rest
        at t - 1. Every replica applies the same update, so parameters taken from ranks at t make
        the model of step t whichever ranks they come from; when some parameter has no whole copy at
        t, step t - 1 is tried the same way. Raises naming the parameters with no usable copy."""
        tensors = {r: self._tensors(r) for r in self.ranks}
        steps = sorted({m["applied_step"] for m in self.meta.values()}, reverse=True)
        for step in steps:
            at = {r: t for r, t in tensors.items() if self.meta[r]["applied_step"] == step}
            out: dict[str, torch.Tensor] = {}
            missing = []
            for name, ranks in holders.items():
                got = self._one(name, ranks, at)
                if got is None:
                    missing.append(name)
                else:
                    out.update(got)
            if not missing:
                return step, out
            if len(steps) == 1:
                lost = sorted(set(holders[missing[0]]) - set(self.ranks))
                where = "; ".join(describe_rank(self.layout.ranks[r]) for r in lost[:3])
                raise HeteroError(f"elastic: no surviving rank holds a whole copy of {len(missing)} parameter(s), "
                                  f"e.g. {layer_of(missing[0])} ({missing[0]}), held only by {where}: the live "
                                  f"state cannot be rebuilt (fix: a plan whose stages have data-parallel replicas, "
                                  f"'replicas: 2' or a second pipeline, or restart from a --save checkpoint)")
        by = ", ".join(f"rank {r}: {m['applied_step']}" for r, m in sorted(self.meta.items()))
        raise HeteroError(f"elastic: the surviving ranks stopped at different steps ({by}) and at none of them "
                          f"does every parameter have a whole copy, so their live state is not one model (fix: "
                          f"restart from a checkpoint written by --save)")

    def _one(self, name: str, ranks: tuple[int, ...], tensors: dict) -> dict[str, torch.Tensor] | None:
        """``name``'s full tensors from the first tp group (one stage of one replica) whose every shard
        survived; None when there is none."""
        by_stage: dict[tuple, list[int]] = {}
        for r in ranks:
            info = self.layout.ranks[r]
            by_stage.setdefault((info.pipeline, info.replica, info.stage), []).append(r)
        for members in by_stage.values():
            alive = [r for r in members if r in tensors]
            if not alive:
                continue
            shard = self.meta[alive[0]]["shards"].get(name)
            if shard is None or shard["dim"] is None:   # whole on every tp rank: any one will do
                return {k: v for k, v in tensors[alive[0]].items() if _param_of(k) == name}
            pieces = {self.meta[r]["shards"][name]["tp_rank"]: r for r in alive}
            if len(pieces) < shard["tp_size"]:
                continue
            order = [pieces[i] for i in range(shard["tp_size"])]
            keys = [k for k in tensors[order[0]] if _param_of(k) == name]
            out = {}
            for k in keys:
                parts = [tensors[r][k] for r in order]
                out[k] = parts[0] if k.endswith("/step") else torch.cat(parts, dim=shard["dim"])
            return out
        return None


def _param_of(key: str) -> str:
    """``model/<name>`` / ``optim/<name>/<state>`` -> ``<name>``."""
    kind, rest = key.split("/", 1)
    return rest if kind == "model" else rest.rsplit("/", 1)[0]


def layer_of(name: str) -> str:
    """The layer a parameter belongs to, in words (``layer 3``), or ``the embedding or head``."""
    parts = name.split(".")
    return f"layer {parts[1]}" if parts[0] == "layers" and len(parts) > 1 else "the embedding or head"
