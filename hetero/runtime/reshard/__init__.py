"""Live resharding of training state between two plans, rank to rank (no disk, no restart).

- :mod:`.space`: the virtual parameter space (tensor name + box) and each rank's regions in a plan;
- :mod:`.transition`: the intersections between old and new owners, sources chosen among replicas;
- :mod:`.transfer`: the point-to-point exchange under a memory bound and the rebuilt stage;
- :mod:`.predict`: a transition's downtime from the bytes each link carries.

The package's error, :class:`ReconfigurationError`, sits here so that every module of it (the
exchange and the coordination alike) raises the one class without importing another.
"""
from hetero.errors import HeteroError


class ReconfigurationError(HeteroError):
    """A reconfiguration could not finish (a peer lost during it, a coordinator that never decided)."""
