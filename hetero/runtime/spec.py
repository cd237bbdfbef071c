"""The run file the launcher writes and every worker reads (``HETERO_RUN_SPEC``).

It carries the cluster, model and plan (as dicts), the rank layout (rank -> group, node, local
rank, pipeline, replica, stage, tp rank, layers), the node slots, and the run options. Workers take
their place from it: slot (``HETERO_NODE_SLOT``) and ``LOCAL_RANK`` give the rank, never the order
in which a rendezvous happened to admit nodes.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from hetero.layout import NodeSlot, RankInfo, RankLayout
from hetero.runtime.options import RunOptions  # defined there; imported from here as before

SPEC_ENV = "HETERO_RUN_SPEC"
SLOT_ENV = "HETERO_NODE_SLOT"


@dataclass
class RunSpec:
    """The run file: cluster, model and plan dicts, the rank layout, the node slots and the options."""

    cluster: dict
    model: dict
    plan: dict
    layout: list[dict]
    nodes: list[dict]
    options: RunOptions

    def save(self, path: str) -> None:
        d = asdict(self)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(d, f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "RunSpec":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict) -> "RunSpec":
        """The run file's content as :meth:`save` writes it (sent over the store to another machine)."""
        opts = d["options"]
        if opts.get("inject_failure") is not None:
            opts["inject_failure"] = tuple(opts["inject_failure"])
        d["options"] = RunOptions(**opts)
        return cls(**d)

    def rank_layout(self) -> RankLayout:
        ranks = tuple(RankInfo(**{**r, "layers": tuple(r["layers"]), "chunks": tuple(r.get("chunks", ()))})
                      for r in self.layout)
        return RankLayout(ranks=ranks, nodes=tuple(NodeSlot(**n) for n in self.nodes))


def describe_rank(info: RankInfo) -> str:
    """``rank 3 (group slow, pipeline 0 replica 0 stage 1, layers 2-3, tp 0/1)``."""
    a, b = info.layers
    tp = f", tp {info.tp_rank}/{info.tp_size}" if info.tp_size > 1 else ""
    chunks = (f", interleaved: virtual stages {', '.join(map(str, info.chunks))}"
              if len(info.chunks) > 1 else "")
    return (f"rank {info.rank} (group {info.group}, pipeline {info.pipeline} replica {info.replica} "
            f"stage {info.stage}, layers {a}-{b - 1}{tp}{chunks})")


def derive_rank(spec: RunSpec) -> int:
    """This process's rank: its node slot (:data:`SLOT_ENV`) and ``LOCAL_RANK`` against the run file's
    layout, checked against torchrun's ``RANK``."""
    slot = int(os.environ.get(SLOT_ENV, "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    node = spec.nodes[slot]
    if local >= node["num_ranks"]:
        raise RuntimeError(f"LOCAL_RANK {local} but node slot {slot} runs {node['num_ranks']} ranks")
    rank = node["first_rank"] + local
    env_rank = os.environ.get("RANK")
    if env_rank is not None and int(env_rank) != rank:
        raise RuntimeError(f"torchrun assigned RANK={env_rank} but the layout puts node slot {slot} local rank "
                           f"{local} at rank {rank}: the rendezvous ordered nodes differently (use static)")
    return rank


def write_rank_file(path: str, text: str) -> None:
    """Write one of a rank's small files in the run directory (pid, ready, done, error) whole: a
    reader (the launcher) sees the old file or the new one, never a part."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
