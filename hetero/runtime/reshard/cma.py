"""Same-host transport of a reshard: the receiver reads the sender's state straight out of its memory.

When every rank of a reconfiguration is a process on one machine holding its state in host memory
(the emulated devices of a local launch), a moved piece needs no socket: the receiver reads it
from the sender's address space with Linux's cross-memory attach (``process_vm_readv``), one copy
from the sender's tensor into the receiver's new tensor, as MPI libraries move large intra-node
messages (Open MPI's and MPICH's CMA transports). Over Gloo's loopback TCP the same bytes are
copied into a socket buffer, through the kernel and out again, on the same two cores.

The protocol, on the coordinator's store (keys under one prefix per reconfiguration):

1. every rank publishes its process id and, for each piece it sends, the address, shape and
   strides of each part (master values, both moments) and its AdamW step; the tensors stay as they
   are (a strided tp slice is read as its rows, no staging copy);
2. a receiver reads each of its pieces from the sender's process into its new tensors, then says
   it is done;
3. a sender returns once every receiver of its pieces is done (until then its state must not
   change or be freed), checking meanwhile that they are alive.

A peer that is gone ends the exchange with its rank named (the read fails at once with ESRCH; a
receiver that died is seen by its process id), never a hang. :func:`usable` says whether this
machine lets a process read another's memory (same user; no Yama ptrace restriction; no seccomp
filter on the call); where it does not, the exchange goes over torch.distributed as elsewhere.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import json
import math
import os
import time

import torch

IOV_MAX = 1024
"""Ranges per system call (Linux's UIO_MAXIOV)."""
MAX_CALL_BYTES = 1 << 30
"""Bytes per system call: Linux moves at most about 2 GiB in one (MAX_RW_COUNT) and returns a
partial read beyond it."""

POLL_S = 0.001


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class PeerGone(RuntimeError):
    """A peer's process ended during the exchange (``rank``: its rank in the exchange)."""

    def __init__(self, rank: int, why: str):
        super().__init__(why)
        self.rank = rank


@functools.lru_cache(maxsize=1)
def _libc():
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = lib.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn


@functools.lru_cache(maxsize=1)
def usable() -> bool:
    """Whether a process may read a sibling's memory here: Linux, Yama's ptrace scope 0 (or no Yama:
    a sibling is not a descendant), and the call allowed (a read of this process's own memory)."""
    if not os.path.exists("/proc/self"):
        return False
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if int(f.read().strip() or 0) > 0:
                return False
    except OSError:
        pass
    try:
        src, dst = torch.arange(4, dtype=torch.float32), torch.zeros(4)
        _read(os.getpid(), *pair(runs(dst), runs(src)))
        return bool(torch.equal(src, dst))
    except (OSError, AttributeError):
        return False


Runs = tuple[torch.Tensor, int]
"""A tensor's memory as runs of equal length: (the start address of each run, int64; its bytes)."""


def runs(t: torch.Tensor) -> Runs:
    """The contiguous byte runs of ``t``'s elements in row-major order."""
    return remote_runs(t.data_ptr(), list(t.shape), list(t.stride()), t.element_size())


def remote_runs(address: int, shape: list[int], strides: list[int], size: int = 4) -> Runs:
    """:func:`runs` of a tensor described by its address, shape and strides (in elements), such as
    one in another process: one run per index of the dims before the longest dense trailing block."""
    if any(n == 0 for n in shape):
        return torch.empty(0, dtype=torch.int64), 0
    k, inner = _dense_tail(shape, strides)
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(shape[:k], strides[:k]):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride
    return address + size * offsets.reshape(-1), inner * size


def _dense_tail(shape: list[int], strides: list[int]) -> tuple[int, int]:
    """(how many leading dims lie outside the longest dense trailing block, that block's elements):
    a row-major contiguous tensor is all one block (0 leading dims)."""
    inner, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == inner):
        inner *= shape[k - 1]
        k -= 1
    return k, inner


def pair(local: Runs, remote: Runs) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(local addresses, remote addresses, bytes each): both sides cut into runs of one length (the
    greatest common divisor of theirs), so the i-th local run receives the i-th remote one."""
    (la, ln), (ra, rn) = local, remote
    if la.numel() == 0:
        return la, ra, 0
    g = math.gcd(ln, rn)

    def cut(addresses: torch.Tensor, n: int) -> torch.Tensor:
        return (addresses.unsqueeze(-1) + torch.arange(0, n, g, dtype=torch.int64)).reshape(-1)
    return cut(la, ln), cut(ra, rn), g


class Segments:
    """The byte ranges of several reads from one process, gathered so that they go out in as few
    system calls as the kernel takes (:func:`_read`): a piece's parts are mostly whole contiguous
    tensors, each one range, which are kept as plain numbers; strided ones are cut into runs
    (:func:`pair`)."""

    def __init__(self):
        self._local: list[int] = []
        self._remote: list[int] = []
        self._lengths: list[int] = []
        self._runs: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def add(self, view: torch.Tensor, address: int, shape: list[int], strides: list[int]) -> None:
        """Read the remote tensor at ``address`` (its shape and strides, in elements) into ``view``."""
        if view.is_contiguous() and _dense_tail(shape, strides)[0] == 0:
            if view.numel():
                self._local.append(view.data_ptr())
                self._remote.append(address)
                self._lengths.append(view.numel() * view.element_size())
        else:
            local, remote, length = pair(runs(view), remote_runs(address, shape, strides, view.element_size()))
            if length:
                self._runs.append((local, remote, length))

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(local addresses, remote addresses, lengths), int64, for :func:`_read`."""
        def i64(values):
            return torch.tensor(values, dtype=torch.int64)
        local = [i64(self._local)] + [r[0] for r in self._runs]
        remote = [i64(self._remote)] + [r[1] for r in self._runs]
        lengths = [i64(self._lengths)] + [torch.full_like(r[0], r[2]) for r in self._runs]
        return torch.cat(local), torch.cat(remote), torch.cat(lengths)


def _bounded(local: torch.Tensor, remote: torch.Tensor, lengths: torch.Tensor, cap: int):
    """The same ranges with any longer than ``cap`` bytes cut into pieces of at most ``cap``."""
    if not bool((lengths > cap).any()):
        return local, remote, lengths
    k = (lengths + cap - 1) // cap   # pieces per range
    which = torch.repeat_interleave(torch.arange(lengths.numel()), k)
    offset = (torch.arange(int(k.sum())) - torch.repeat_interleave(k.cumsum(0) - k, k)) * cap
    return local[which] + offset, remote[which] + offset, torch.clamp(lengths[which] - offset, max=cap)


def _read(pid: int, local: torch.Tensor, remote: torch.Tensor, length: int | torch.Tensor) -> int:
    """Copy the bytes at each remote address of process ``pid`` to the local address of the same
    index, ``length`` bytes each (one number, or one per address); the bytes read. As few system
    calls as Linux takes: at most :data:`IOV_MAX` ranges and :data:`MAX_CALL_BYTES` each."""
    fn, total, n = _libc(), 0, local.numel()
    if n == 0:
        return 0
    lengths = length if isinstance(length, torch.Tensor) else torch.full((n,), length, dtype=torch.int64)
    local, remote, lengths = _bounded(local, remote, lengths, MAX_CALL_BYTES)
    n = local.numel()
    # the iovec arrays: int64 pairs (address, length), one tensor per side
    lv, rv = torch.stack((local, lengths), 1).contiguous(), torch.stack((remote, lengths), 1).contiguous()
    ends = lengths.cumsum(0)
    iov = ctypes.POINTER(_IOVec)
    lo = 0
    while lo < n:
        base = int(ends[lo - 1]) if lo else 0
        fits = int(torch.searchsorted(ends, base + MAX_CALL_BYTES, right=True))
        hi = max(lo + 1, min(n, lo + IOV_MAX, fits))
        want, count = int(ends[hi - 1]) - base, hi - lo
        got = fn(pid, ctypes.cast(lv.data_ptr() + 16 * lo, iov), count, ctypes.cast(rv.data_ptr() + 16 * lo, iov),
                 count, 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        if got != want:   # a partial read: the remote range ended (the peer is tearing down)
            raise OSError(errno.EFAULT, f"read {got} of {want} bytes")
        total += got
        lo = hi
    return total


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Exchange:
    """One rank's side of a same-host exchange on ``store`` under ``prefix`` (see the module
    docstring); ``pids``: every rank of the exchange -> its process id (from the check-ins)."""

    def __init__(self, store, prefix: str, rank: int, pids: dict[int, int], timeout_s: float):
        self.store, self.prefix, self.rank, self.pids, self.timeout_s = store, prefix, rank, pids, timeout_s

    def _key(self, what: str) -> str:
        return f"{self.prefix}/{what}"

    def _check_alive(self, rank: int, doing: str) -> None:
        pid = self.pids.get(rank)
        if pid is not None and not _alive(pid):
            raise PeerGone(rank, f"its process ended before it had {doing}")

    def publish(self, sent: dict[int, tuple[list[torch.Tensor], float | None]]) -> None:
        """Say where the pieces this rank sends are (piece index -> (its parts, its step))."""
        desc = {str(i): {"parts": [[t.data_ptr(), list(t.shape), list(t.stride())] for t in parts], "step": step}
                for i, (parts, step) in sent.items()}
        self.store.set(self._key(f"src/{self.rank}"), json.dumps({"pid": os.getpid(), "pieces": desc}))

    def _source(self, src: int, cache: dict) -> dict:
        if src not in cache:
            key = self._key(f"src/{src}")
            deadline = time.monotonic() + self.timeout_s
            while not self.store.check([key]):
                self._check_alive(src, "published its state")
                if time.monotonic() > deadline:
                    raise PeerGone(src, f"it did not publish its state within {self.timeout_s:g} s")
                time.sleep(POLL_S)
            cache[src] = json.loads(self.store.get(key))
        return cache[src]

    def receive(self, pieces: list[tuple[int, int, list[torch.Tensor]]]) -> dict[int, float | None]:
        """Read every (piece index, source rank, destination views) into the views; returns each
        piece's step. Then says this rank is done."""
        cache: dict[int, dict] = {}
        steps = {}
        by_source: dict[int, list[tuple[int, list[torch.Tensor]]]] = {}
        for index, src, views in pieces:
            by_source.setdefault(src, []).append((index, views))
        for src, wanted in by_source.items():   # one source's pieces together: fewer system calls
            meta = self._source(src, cache)
            segments = Segments()
            for index, views in wanted:
                desc = meta["pieces"][str(index)]
                for view, (address, shape, strides) in zip(views, desc["parts"]):
                    segments.add(view, address, shape, strides)
                steps[index] = desc["step"]
            try:
                _read(meta["pid"], *segments.arrays())
            except OSError as e:
                raise PeerGone(src, f"reading its state failed: {e}") from None
        self.store.set(self._key(f"done/{self.rank}"), "1")
        return steps

    def serve(self, receivers: set[int]) -> None:
        """Wait until every rank in ``receivers`` has read its pieces from this process."""
        keys = {r: self._key(f"done/{r}") for r in receivers}
        deadline = time.monotonic() + self.timeout_s
        while keys:
            for r in [r for r, k in keys.items() if self.store.check([k])]:
                del keys[r]
            if not keys:
                return
            for r in keys:
                self._check_alive(r, "read its state")
            if time.monotonic() > deadline:
                raise PeerGone(min(keys), f"it did not read its state within {self.timeout_s:g} s")
            time.sleep(POLL_S)
