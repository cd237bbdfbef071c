"""Per-rank communication statistics: bytes per path (bridge, each vendor), operation counts and a
bounded trace of the sub-operations each collective or transfer was made of."""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence


class TraceEntry(NamedTuple):
    op: str  # the user-facing operation (all_reduce, send, ...)
    path: str  # "vendor" or "bridge"
    vendor: str | None  # the vendor tag of a vendor path (None on the bridge)
    ranks: tuple[int, ...]  # global ranks of the group the sub-operation ran on
    nbytes: int  # bytes this rank put into the sub-operation


@dataclass
class CommStats:
    """Bytes this rank moved per path, operation counts and a bounded trace of sub-operations."""

    bridge_bytes: int = 0
    vendor_bytes: dict[str, int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)
    trace: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10000))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, op: str, path: str, vendor: str | None, ranks: Sequence[int], nbytes: int,
               count: bool = False) -> None:
        with self._lock:
            if count:
                self.ops[op] = self.ops.get(op, 0) + 1
            if path == "bridge":
                self.bridge_bytes += nbytes
            else:
                self.vendor_bytes[vendor] = self.vendor_bytes.get(vendor, 0) + nbytes
            self.trace.append(TraceEntry(op, path, vendor, tuple(ranks), nbytes))

    def count(self, op: str) -> None:
        with self._lock:
            self.ops[op] = self.ops.get(op, 0) + 1

    def reset(self) -> None:
        with self._lock:
            self.bridge_bytes = 0
            self.vendor_bytes.clear()
            self.ops.clear()
            self.trace.clear()

    def to_dict(self) -> dict:
        with self._lock:
            return {"bridge_bytes": self.bridge_bytes, "vendor_bytes": dict(self.vendor_bytes), "ops": dict(self.ops),
                    "trace": [e._asdict() for e in self.trace]}
