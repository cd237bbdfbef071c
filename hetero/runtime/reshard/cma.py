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
import itertools
import json
import os
import time

import torch

IOV_MAX = 1024
"""Segments per system call (Linux's UIO_MAXIOV)."""

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
        _read(os.getpid(), [(dst.data_ptr(), src.data_ptr(), 16)])
        return bool(torch.equal(src, dst))
    except (OSError, AttributeError):
        return False


def runs(t: torch.Tensor) -> list[tuple[int, int]]:
    """The contiguous byte runs (address, length) of ``t``'s elements in row-major order."""
    return remote_runs(t.data_ptr(), list(t.shape), list(t.stride()), t.element_size())


def remote_runs(address: int, shape: list[int], strides: list[int], size: int = 4) -> list[tuple[int, int]]:
    """:func:`runs` of a tensor described by its address, shape and strides (in elements), such as
    one in another process."""
    if any(n == 0 for n in shape):
        return []
    # the longest trailing block laid out densely: one run per index of the dims before it
    inner, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == inner):
        inner *= shape[k - 1]
        k -= 1
    return [(address + size * sum(i * s for i, s in zip(index, strides)), inner * size)
            for index in itertools.product(*(range(n) for n in shape[:k]))]


def _pair(local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(local address, remote address, bytes) segments where both sides are contiguous."""
    out, i, j = [], 0, 0
    la, ln = local[0] if local else (0, 0)
    ra, rn = remote[0] if remote else (0, 0)
    while i < len(local) and j < len(remote):
        n = min(ln, rn)
        out.append((la, ra, n))
        la, ln, ra, rn = la + n, ln - n, ra + n, rn - n
        if ln == 0:
            i += 1
            if i < len(local):
                la, ln = local[i]
        if rn == 0:
            j += 1
            if j < len(remote):
                ra, rn = remote[j]
    return out


def _read(pid: int, segments: list[tuple[int, int, int]]) -> int:
    """Copy every (local, remote, bytes) segment out of process ``pid``; the bytes read."""
    fn, total = _libc(), 0
    for lo in range(0, len(segments), IOV_MAX):
        batch = segments[lo:lo + IOV_MAX]
        local = (_IOVec * len(batch))(*[_IOVec(a, n) for a, _, n in batch])
        remote = (_IOVec * len(batch))(*[_IOVec(b, n) for _, b, n in batch])
        want = sum(n for _, _, n in batch)
        got = fn(pid, local, len(batch), remote, len(batch), 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        if got != want:   # a partial read: the remote range ended (the peer is tearing down)
            raise OSError(errno.EFAULT, f"read {got} of {want} bytes")
        total += got
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
        for index, src, views in pieces:
            meta = self._source(src, cache)
            desc = meta["pieces"][str(index)]
            segments = []
            for view, (address, shape, strides) in zip(views, desc["parts"]):
                segments += _pair(runs(view), remote_runs(address, shape, strides, view.element_size()))
            try:
                _read(meta["pid"], segments)
            except OSError as e:
                raise PeerGone(src, f"reading its state failed: {e}") from None
            steps[index] = desc["step"]
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
