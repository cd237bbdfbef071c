"""Breaking a dropped world's connections, so that nothing waits on them.

Gloo has no abort: ``ProcessGroupGloo`` leaves ``Backend.abort`` a no-op, so neither
``torch.distributed``'s ``_abort_process_group`` nor ``destroy_process_group`` ends a receive that
is already blocked in C++ (only the group's timeout does, minutes later). A blocked receive does end
at once when its connection breaks. And destroying a group closes its connections only once the
last reference to it is gone, which an operation still in flight on another thread, or a traceback
kept somewhere, can delay for as long as that lives.

So a survivor breaks the connections itself: it shuts down (``shutdown(2)``, both ways) every TCP
connection of its process except those to the coordinator's store. Its own blocked operations then
fail with a closed connection at once, and so do its peers' operations on it, whatever still holds
the groups. Shutting a socket down does not close its descriptor, so the group's own teardown later
closes it as usual. Reads return end-of-file and writes fail, exactly what a peer's death causes,
which every operation already handles.

Only the old world has connections when this runs: the new generation's world is formed after.
"""
from __future__ import annotations

import os
import socket

_LISTEN = "0A"
"""A listening socket's state in /proc/net/tcp (it has no connection to break)."""


def _tcp_endpoints() -> dict[int, tuple[int, int, str]]:
    """Socket inode -> (local port, remote port, state) of every TCP socket visible to this process."""
    out: dict[int, tuple[int, int, str]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, remote, state, inode = cols[1], cols[2], cols[3], int(cols[9])
                    out[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
        except OSError:
            continue
    return out


def _socket_inode(fd: int) -> int | None:
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return int(link[8:-1]) if link.startswith("socket:[") else None


def break_connections(keep_ports: set[int]) -> int:
    """Shut down every connected TCP socket of this process whose local or remote port is not in
    ``keep_ports`` (the stores'); returns how many. Harmless where there is nothing to break (no
    /proc: returns 0)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    endpoints = _tcp_endpoints()
    broken = 0
    for fd in fds:
        inode = _socket_inode(fd)
        ends = endpoints.get(inode) if inode is not None else None
        if ends is None:
            continue
        local, remote, state = ends
        if state == _LISTEN or local in keep_ports or remote in keep_ports:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue   # closed meanwhile
        try:
            if _socket_inode(dup) != inode:   # the number was reused meanwhile: not ours to break
                continue
            s = socket.socket(fileno=dup)
            dup = -1   # the socket object owns it now
            try:
                s.shutdown(socket.SHUT_RDWR)
                broken += 1
            except OSError:
                pass   # not connected any more
            finally:
                s.close()   # closes the duplicate only
        finally:
            if dup >= 0:
                os.close(dup)
    return broken
