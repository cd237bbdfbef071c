"""One rank's view of the run: the loaded specs, the rank layout, its place in it, its device and its
process groups (:class:`~hetero.runtime.parallel.ParallelLayout`), built once from the run file."""
from __future__ import annotations

import torch

from hetero.runtime.device import rank_device, torch_device_type
from hetero.runtime.parallel import ParallelLayout


class RunContext:
    """The specs, the layout and this rank's place in it."""

    def __init__(self, spec, rank: int):
        # from the specs, not the package's front door (hetero/__init__ imports the predictor, which
        # reaches the runtime for its allocator replay: an import circle)
        from hetero.specs.cluster import load_cluster
        from hetero.specs.model import load_model
        from hetero.specs.plan import load_plan

        self.spec = spec
        self.options = spec.options
        self.cluster = load_cluster(spec.cluster)
        self.model = load_model(spec.model)
        self.plan = load_plan(spec.plan)
        self.layout = spec.rank_layout()
        self.rank = rank
        self.me = self.layout.ranks[rank]
        self.pipeline = self.plan.pipelines[self.me.pipeline]
        self.num_stages = len(self.pipeline.stages)
        """Virtual stages (the stage list; more than the physical stages when interleaved)."""
        self.num_physical = len(self.plan.physical_stages(self.pipeline))
        self.vstages = self.me.virtual_stages
        """The virtual stages this rank runs, in pipeline order (one unless interleaved)."""
        self.first, self.last = self.me.holds_ends(self.plan)
        self.slowdown = float(self.cluster.device_type(self.me.group).slowdown)
        families = [self.cluster.device_type(r.group).family for r in self.layout.ranks]
        native = spec.options.engine == "native"
        self.device_types = [torch_device_type(f) if native else "cpu" for f in families]
        """Every rank's torch device type (cpu for emulated devices, and for every rank of the
        DeepSpeed engine)."""
        self.device = rank_device(families[rank]) if native else torch.device("cpu")
        """Where this rank computes (see :mod:`hetero.runtime.device`; the DeepSpeed engine stays on
        the CPU accelerator)."""
        self.parallel = ParallelLayout.build(self.model, self.plan, self.layout, rank, spec.options.engine)
        """Every rank set of the run, this rank's tp mesh and the parameters' holders (the one owner of
        process groups: the trainer creates them from it, the engine asks it)."""
