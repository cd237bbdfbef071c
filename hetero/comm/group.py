"""A communicator group: a set of global ranks and how operations over it are routed (flat on one
vendor's library, or hierarchical across vendors; see :mod:`hetero.comm.communicator`)."""
from __future__ import annotations

from typing import Sequence

from .bridge import BridgeGroup


class Group:
    """A set of global ranks and how operations over it are routed (see :mod:`hetero.comm.communicator`).
    ``comm``: the communicator that makes it (which imports this module: not imported back)."""

    def __init__(self, comm, name: str, ranks: Sequence[int]):
        self.name = name
        self.ranks: list[int] = sorted(ranks)
        self.size = len(self.ranks)
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self.rank = self._index.get(comm.rank, -1)
        self.is_member = self.rank >= 0
        self.vendor_ranks: dict[str, list[int]] = {}
        for r in self.ranks:
            self.vendor_ranks.setdefault(comm.vendor_of_rank[r], []).append(r)
        self.vendors: list[str] = list(self.vendor_ranks)
        self.leaders: dict[str, int] = {v: rs[0] for v, rs in self.vendor_ranks.items()}
        self.hierarchical = len(self.vendors) > 1
        self.vendor = comm.vendor
        self.my_vendor_ranks: list[int] = self.vendor_ranks.get(comm.vendor, [])
        self.leader: int | None = self.leaders.get(comm.vendor)
        self.is_leader = self.is_member and self.leader == comm.rank
        self.vendor_pg = None  # this rank's vendor part of the group (None when it is one rank)
        self.bridge: BridgeGroup | None = None  # leaders only, hierarchical groups only

    def index(self, global_rank: int) -> int:
        """Group rank of a global rank."""
        return self._index[global_rank]

    def __repr__(self) -> str:
        kind = "hierarchical" if self.hierarchical else "flat"
        return f"<Group {self.name} ranks={self.ranks} vendors={self.vendors} {kind}>"
