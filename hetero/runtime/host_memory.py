"""Host memory a process frees stays mapped for its next tensors, as a GPU's caching allocator keeps
device memory.

An emulated accelerator (``base: cpu``) keeps its stage, gradients and optimizer state in host
memory, allocated through glibc's ``malloc``. glibc serves a large block with its own ``mmap`` and
gives it back to the kernel (``munmap``) when it is freed, so the next tensor of that size is fresh
memory again: every page faults and is zeroed by the kernel on its first write, several times the
cost of a copy into memory already mapped (measured in docs/elastic.md). A GPU has no such cost
between tensors: torch's caching allocator keeps the
blocks a step frees and hands them to the next ones.

:func:`keep_freed_host_memory` makes a process's host heap behave the same way: large blocks come
from the heap (``M_MMAP_MAX`` 0) and a freed one stays mapped (``M_TRIM_THRESHOLD`` -1: never
trimmed). What a step frees (its gradients, the optimizer's temporaries, activations) is then
mapped memory that the next allocations reuse, in particular the tensors an in-process reshard
(:mod:`hetero.runtime.reshard`) writes in the downtime. The cost is the caching allocator's: the
process's resident memory stays at its peak, and a freed block is reused only by this process.

glibc only (``mallopt``); elsewhere, or with ``HETERO_KEEP_FREED_HOST_MEMORY=0`` in the
environment (a host short of memory), the call does nothing.

:func:`huge_pages_env` is what the launcher adds to the environment of a worker on a CPU device:
torch's CPU allocator then asks for transparent huge pages (``THP_MEM_ALLOC_ENABLE``: blocks of 2 MB
and more aligned to 2 MB and ``madvise(MADV_HUGEPAGE)`` before their first touch), as a GPU's memory
is mapped in large pages. A 2 MB page is one fault and one TLB entry instead of 512: a step's fresh
memory maps faster, and another process reads this one's state faster (the same-host exchange of a
reshard, :mod:`hetero.runtime.reshard.cma`; measured in docs/elastic.md). torch reads the variable
once, at its first allocation, so it must be in the environment the process starts with. Where the
kernel's THP setting is ``never`` the advice does nothing; a ``THP_MEM_ALLOC_ENABLE`` the user set
(``0`` to turn it off) wins.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

KEEP_ENV = "HETERO_KEEP_FREED_HOST_MEMORY"
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for transparent huge pages in its CPU allocator (read at the first allocation)."""
# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

_kept: bool | None = None


def keep_freed_host_memory() -> bool:
    """Keep the memory this process frees mapped for its next allocations (see the module
    docstring); True when it applies, False where ``mallopt`` is not there or ``KEEP_ENV`` is 0.
    Idempotent."""
    global _kept
    if _kept is None:
        _kept = os.environ.get(KEEP_ENV, "1") != "0" and _set_options()
    return _kept


def huge_pages_env(environ=None) -> dict[str, str]:
    """The variables to add to a CPU-device worker's environment (``environ``: the one it inherits,
    ``os.environ`` by default) so that torch's allocator maps its large tensors in huge pages (module
    docstring); empty where the user set :data:`HUGE_PAGES_ENV` themselves."""
    environ = os.environ if environ is None else environ
    return {} if HUGE_PAGES_ENV in environ else {HUGE_PAGES_ENV: "1"}


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def _set_options() -> bool:
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:   # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # order matters: with mmap off first, no block freed between the two calls is unmapped
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1


MADV_DONTNEED = 4
"""<sys/mman.h>: the pages' contents are dropped and their memory given back; the next touch maps
a zero page."""


def release_unused_pages(tensors) -> int:
    """Give back to the kernel the whole pages of the CPU tensors' storages that none of ``tensors``
    uses (a view kept of a larger tensor, :func:`hetero.runtime.reshard.transfer.exchange`), once
    nothing else reads them: what a copy into tensors of their own would have freed, without the
    copy. Every live user of those storages must be among ``tensors`` (the old stage dropped): the
    pages any of them touches stay (several views of one flat vector keep all theirs), and a
    dropped page reads as zeros if touched again. Returns the bytes given back; 0 where
    ``madvise`` is missing."""
    madvise = getattr(_libc(), "madvise", None)
    if madvise is None:
        return 0
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    page = os.sysconf("SC_PAGE_SIZE")
    used: dict[int, tuple[int, list[tuple[int, int]]]] = {}   # storage start -> (its end, ranges in use)
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        lo = storage.data_ptr()
        first = t.data_ptr()   # the span of t's elements (whatever its strides)
        last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
        used.setdefault(lo, (lo + storage.nbytes(), []))[1].append((first, last))
    released = 0
    for lo, (hi, ranges) in used.items():
        at = lo
        for a, b in sorted(ranges) + [(hi, hi)]:
            start, stop = -(-at // page) * page, a // page * page   # whole pages only
            if stop > start and madvise(start, stop - start, MADV_DONTNEED) == 0:
                released += stop - start
            at = max(at, b)
    return released


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def mapped_free_bytes() -> int:
    """Bytes the heap holds free and mapped (glibc's ``mallinfo2().fordblks``), 0 where unknown:
    what the next allocations can take without a page fault."""
    fn = getattr(_libc(), "mallinfo2", None)
    if fn is None:
        return 0
    fn.restype = _Mallinfo2
    return int(fn().fordblks)
