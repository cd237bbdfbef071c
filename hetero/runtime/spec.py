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
            d = json.load(f)
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
