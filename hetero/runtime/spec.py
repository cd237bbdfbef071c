"""The run file the launcher writes and every worker reads (``HETERO_RUN_SPEC``).

It carries the cluster, model and plan (as dicts), the rank layout (rank -> group, node, local
rank, pipeline, replica, stage, tp rank, layers), the node slots, and the run options. Workers take
their place from it: slot (``HETERO_NODE_SLOT``) and ``LOCAL_RANK`` give the rank, never the order
in which a rendezvous happened to admit nodes.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from hetero.layout import NodeSlot, RankInfo, RankLayout

SPEC_ENV = "HETERO_RUN_SPEC"
SLOT_ENV = "HETERO_NODE_SLOT"


@dataclass
class RunOptions:
    """Everything about a run that is not the cluster, model or plan."""

    steps: int = 5
    seed: int = 0
    data: str | None = None
    """Token file (.npy / .bin) or text file; None: the seeded synthetic stream."""
    engine: str = "native"
    """native (hand-written pipeline + holder-set gradient sync) | deepspeed (ZeRO, one stage per pipeline)."""
    timeout_s: float = 60.0
    """Communicator timeout: a peer silent this long ends the job with an error naming it."""
    summary: str | None = None
    trace: str | None = None
    inject_failure: tuple[int, int] | None = None
    """(step, rank): that rank exits at the start of that step (1-based), to test failure handling."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip: float = 1.0
    loss_scale: float | None = None
    """fp16 only: the initial dynamic loss scale (None: 2^16; see hetero.runtime.loss_scale)."""
    save: str | None = None
    """Directory for a torch.distributed.checkpoint at the end of the run."""
    load: str | None = None
    """Directory of a checkpoint to start from (any plan of the same model)."""
    run_dir: str = ""
    """Where workers leave pid / ready / done / error files for the launcher."""
    threads: int = 1
    """torch intra-op threads per worker."""
    quiet: bool = False
    elastic: bool = False
    """On a peer's failure, survivors hand off their live state (:mod:`hetero.runtime.handoff`) and the
    launcher replans on the remaining devices (:mod:`hetero.runtime.elastic`)."""
    extra: list[str] = field(default_factory=list)
    allocator: str = "caching"
    """caching (PyTorch's default allocator) | planned (the step's memory plan served from one arena,
    :mod:`hetero.memplan.serve`)."""
    overlap: bool = True
    """Native engine: each bucket's gradient reduction starts as soon as the step's last backward has
    finished it, under the rest of the backward (:mod:`hetero.runtime.overlap`); False: every bucket
    after the schedule (``--no-overlap``)."""
    compile: bool | None = None
    """Native engine: ``torch.compile`` every transformer block (:func:`hetero.runtime.model.compile_blocks`);
    None: on where the rank computes on an accelerator, off on the CPU (compile time)."""
    bucket_mb: float = 25.0
    """Native engine: the largest bucket of gradients one collective sums (MB of fp32), DDP's default."""


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
