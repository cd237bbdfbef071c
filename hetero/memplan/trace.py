"""An allocation trace: the ordered allocs and frees of one device, and what can be read off it.

A trace comes from :func:`hetero.memplan.record.record_stage` (one stage's training steps, traced
without memory) or from a CUDA memory snapshot (:func:`load_snapshot`, the pickle that
``torch.cuda.memory._dump_snapshot`` writes). Time is the event index: the allocator sees only the
order of requests, not their durations.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path

from hetero.errors import HeteroError

MAX_SNAPSHOT_BYTES = 2 * 1024**3
"""A snapshot larger than this is refused: it would not be one device's trace."""


@dataclass
class Block:
    """One allocation: ``size`` bytes, live over events ``[start, end)``, its trace id ``key``.
    ``start`` is -1 for a block the trace frees without having shown its allocation (allocated
    before recording began)."""
    key: int
    size: int
    start: int
    end: int


@dataclass
class AllocationTrace:
    """``events``: ``("alloc" | "free", block id, size)`` in order; a block id may be reused after its
    free (addresses in a CUDA snapshot are). ``source`` says where the trace came from.
    ``segment_addresses``: where the driver put each segment the allocator reserved, in order (a
    snapshot's ``segment_alloc`` events; empty for a recorded trace), for the caching replay."""
    events: list[tuple[str, int, int]] = field(default_factory=list)
    source: str = ""
    segment_addresses: list[int] = field(default_factory=list)

    def blocks(self) -> list[Block]:
        """Every allocation with its lifetime; a block still live at the end lives to ``len(events)``."""
        open_: dict[int, Block] = {}
        done: list[Block] = []
        for t, (kind, key, size) in enumerate(self.events):
            if kind == "alloc":
                if key in open_:   # an id reused without its free in the trace: close the old block here
                    done.append(open_.pop(key))
                    done[-1].end = t
                open_[key] = Block(key, size, t, -1)
            else:
                blk = open_.pop(key, None)
                if blk is None:
                    done.append(Block(key, size, -1, t))
                else:
                    blk.end = t
                    done.append(blk)
        end = len(self.events)
        for blk in open_.values():
            blk.end = end
            done.append(blk)
        return done

    def live_bytes(self) -> list[int]:
        """Bytes live before the first event and after each event (``len(events) + 1`` entries),
        over the :meth:`blocks`: blocks the trace frees without their allocation count as live from
        the start."""
        # slot 0 is before the first event, slot t + 1 after event t
        change = [0] * (len(self.events) + 2)
        for b in self.blocks():
            change[b.start + 1] += b.size
            change[b.end + 1] -= b.size
        out, live = [], 0
        for c in change[:-1]:   # the last slot only frees what lives to the end
            live += c
            out.append(live)
        return out

    def lower_bound_bytes(self) -> int:
        """The most bytes live at once (:meth:`live_bytes`): no allocator can do with less."""
        return max(self.live_bytes())


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, tuples, strings and numbers only: a snapshot holds nothing else, and a
    pickle naming any class or function (the way a pickle runs code) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}; a memory snapshot holds plain data only")


def load_snapshot(path, device: int | None = None) -> AllocationTrace:
    """The allocation trace of one device in a CUDA memory snapshot (``torch.cuda.memory._dump_snapshot``
    after ``_record_memory_history``), read without running any code from the file. ``device``:
    which device's trace (default: the one with the most events). Allocations are its ``alloc``
    events, frees its ``free_completed`` ones (a block freed on one stream but still used on
    another is not reusable before)."""
    path = Path(path)
    what = f"--trace {path}"
    try:
        size = path.stat().st_size
    except OSError as e:
        raise HeteroError(f"{what}: cannot read it: {e.strerror} (fix: check the path)") from None
    if size > MAX_SNAPSHOT_BYTES:
        raise HeteroError(f"{what}: {size / 2**30:.1f} GiB, more than one device's snapshot "
                          f"(fix: record fewer steps, or a smaller max_entries)")
    if not path.is_file():
        raise HeteroError(f"{what}: not a file (fix: give the snapshot file torch.cuda.memory._dump_snapshot wrote)")
    try:
        with open(path, "rb") as f:
            data = _PlainDataUnpickler(f).load()
    except OSError as e:
        raise HeteroError(f"{what}: cannot read it: {e.strerror} (fix: check the path and its permissions)") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
        raise HeteroError(f"{what}: not a memory snapshot: {e} (fix: write it with "
                          f"torch.cuda.memory._dump_snapshot(path))") from None
    traces = data.get("device_traces") if isinstance(data, dict) else None
    if not isinstance(traces, list) or not any(isinstance(t, list) and t for t in traces):
        raise HeteroError(f"{what}: the snapshot has no allocation events (fix: call "
                          f"torch.cuda.memory._record_memory_history() before the steps to record)")
    if device is None:
        device = max(range(len(traces)), key=lambda i: len(traces[i]) if isinstance(traces[i], list) else 0)
    elif not 0 <= device < len(traces):
        raise HeteroError(f"{what}: no device {device}; the snapshot has devices 0-{len(traces) - 1}")
    events, segments = [], []
    for i, e in enumerate(traces[device]):
        if not isinstance(e, dict):
            raise HeteroError(f"{what}: device_traces[{device}][{i}] is not an event (fix: use an unmodified snapshot)")
        action = e.get("action")
        if action in ("alloc", "free_completed"):
            addr, nbytes = e.get("addr"), e.get("size")
            if not all(type(v) is int and 0 <= v < 2**63 for v in (addr, nbytes)):
                raise HeteroError(f"{what}: device_traces[{device}][{i}] ({action}) has no addr and size "
                                  f"that are integers in [0, 2**63) (fix: use an unmodified snapshot)")
            events.append(("alloc" if action == "alloc" else "free", addr, nbytes))
        elif action == "segment_alloc" and type(e.get("addr")) is int and 0 <= e["addr"] < 2**63:
            segments.append(e["addr"])
    if not events:
        raise HeteroError(f"{what}: device {device}'s trace has no alloc / free_completed events")
    return AllocationTrace(events, source=f"snapshot {path.name}, device {device}", segment_addresses=segments)
