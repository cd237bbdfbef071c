"""What PyTorch's CUDA caching allocator reserves for a trace: a replay of its block policy.

The policy is ``c10/cuda/CUDACachingAllocator.cpp``'s with its default settings (no
``max_split_size_mb``, no ``expandable_segments``, no ``roundup_power2_divisions``, no memory
cap, so no segment is ever released):

- a request is rounded up to a multiple of 512 bytes (512 at least);
- requests of at most 1 MiB come from the small pool, larger ones from the large pool;
- a request takes the smallest free cached block of its pool that holds it (best fit, lowest address
  among equals); with none, a new segment is reserved: 2 MiB for a small request, 20 MiB for a
  large one under 10 MiB, else the request rounded up to 2 MiB;
- a block larger than the request is split when the rest is worth keeping: at least 512 bytes in
  the small pool, more than 1 MiB in the large pool (a smaller rest stays inside the block, unused);
- a freed block merges with free neighbours of its segment.

Reserved bytes only grow, so the peak reserved is the reserved at the end. The difference to the
trace's lower bound is fragmentation: rounding, unsplit rests, and free blocks too small or in the
wrong pool for the requests that come.

Where the driver puts each segment matters: among free blocks of one size (common: small requests
round to a few sizes) the lowest address is taken, and which one that is decides what merges later.
A CUDA memory snapshot records each segment's address, and the replay uses them when it has them
(``segment_addresses``); measured on an H100 (driver 580, torch 2.11), 12 random traces of 3,000
events replayed with their recorded addresses reserve exactly what the allocator reserved. Without
addresses each new segment is placed below the earlier ones, as the driver mostly placed them
there: exact on 8 of the 12, within 4 MiB on the rest (placing them above: exact on 4, off by up to
30 MiB). tests/data/cuda_allocator_h100.json holds those measurements.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from hetero.memplan.trace import AllocationTrace

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20            # kSmallSize: the small pool's largest request
SMALL_BUFFER = 2 << 20          # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20         # kLargeBuffer: a large-pool segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc
ROUND_LARGE = 2 << 20           # kRoundLarge: larger requests reserve their size rounded to this
ADDRESS_TOP = 1 << 48           # below this, segments without a recorded address are placed downwards


def round_size(size: int) -> int:
    """The bytes a request of ``size`` occupies (a multiple of 512, at least 512)."""
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)


def segment_size(size: int) -> int:
    """The bytes reserved for a new segment when no cached block holds a request of ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None


@dataclass
class CachingResult:
    """``reserved_bytes``: segment bytes at the end (the peak); ``segments``: how many were reserved;
    ``peak_allocated_bytes``: the most bytes in blocks handed out at once (rounded requests and
    unsplit rests); ``reserved_at_live_peak_bytes``: the segment bytes when the requested bytes live
    first reached their peak (what fragmentation there is by then; the rest comes later)."""
    reserved_bytes: int
    segments: int
    peak_allocated_bytes: int
    reserved_at_live_peak_bytes: int = 0


class CachingAllocatorModel:
    """The caching allocator's block bookkeeping, without memory: :meth:`malloc` and :meth:`free`
    return and take addresses. New segments take the addresses given to
    :meth:`take_segment_addresses` in order (the driver's, from a snapshot); past them, each is
    placed below every segment so far."""

    def __init__(self):
        self._free = {True: [], False: []}   # per pool (small?): sorted (size, addr) of free blocks
        self._blocks: dict[int, _Block] = {}  # addr -> block, every block of every segment
        self._recorded: list[int] = []        # addresses for the next new segments, the next last
        self._floor = ADDRESS_TOP   # user-space addresses are below 2**47: no recorded one is up here
        self.reserved = 0
        self.segments = 0
        self.allocated = 0
        self.peak_allocated = 0

    def take_segment_addresses(self, addresses: Sequence[int]) -> None:
        """The next new segments start at ``addresses``, in order; later ones go below them all."""
        self._recorded = list(addresses)[::-1]   # popped from the end: the first recorded first
        self._floor = min(self._floor, *self._recorded) if self._recorded else self._floor

    def _insert_free(self, b: _Block) -> None:
        bisect.insort(self._free[b.small], (b.size, b.addr))

    def _remove_free(self, b: _Block) -> None:
        pool = self._free[b.small]
        del pool[bisect.bisect_left(pool, (b.size, b.addr))]

    def malloc(self, size: int) -> int:
        """A block for a request of ``size`` bytes; returns its address."""
        size = round_size(size)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            b = self._blocks[pool[i][1]]
            del pool[i]
        else:
            seg = segment_size(size)
            if self._recorded:
                start = self._recorded.pop()
            else:
                start = self._floor = self._floor - seg
            b = _Block(start, seg, small)
            self._blocks[b.addr] = b
            self.reserved += seg
            self.segments += 1
        rest = b.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = _Block(b.addr + size, rest, small, True, b, b.next)
            if b.next is not None:
                b.next.prev = tail
            b.next, b.size = tail, size
            self._blocks[tail.addr] = tail
            self._insert_free(tail)
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b.addr

    def free(self, addr: int) -> None:
        """Return the block at ``addr`` to its pool, merged with free neighbours of its segment."""
        b = self._blocks[addr]
        b.free = True
        self.allocated -= b.size
        for other in (b.prev, b.next):
            if other is not None and other.free:
                self._remove_free(other)
                first, second = (other, b) if other is b.prev else (b, other)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                del self._blocks[second.addr]
                b = first
        self._insert_free(b)


def simulate_caching_allocator(trace: AllocationTrace) -> CachingResult:
    """Replay ``trace`` through :class:`CachingAllocatorModel`, with the trace's recorded segment
    addresses where it has them. A block the trace frees without its allocation (recorded before the
    trace began) is allocated at the start."""
    model = CachingAllocatorModel()
    addr: dict[int, tuple[int, int]] = {}   # trace id -> (address, requested bytes)
    for b in trace.blocks():
        if b.start < 0:   # reserved before the snapshot recorded: their addresses are not in it
            addr[b.key] = (model.malloc(b.size), b.size)
    model.take_segment_addresses(trace.segment_addresses)
    live = peak_live = sum(size for _, size in addr.values())
    at_peak = model.reserved
    for kind, key, size in trace.events:
        if kind == "alloc":
            if key in addr:   # an id reused without its free in the trace
                old, old_size = addr.pop(key)
                model.free(old)
                live -= old_size
            addr[key] = (model.malloc(size), size)
            live += size
            if live > peak_live:
                peak_live, at_peak = live, model.reserved
        elif key in addr:
            old, old_size = addr.pop(key)
            model.free(old)
            live -= old_size
    return CachingResult(model.reserved, model.segments, model.peak_allocated, at_peak)

