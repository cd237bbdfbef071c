"""Communication costs: latency + bandwidth per link class, collectives, host staging.

Link classes (docs/formats.md, cluster file): ``group.intra_node`` (device to device inside one node),
``cluster.network.inter_node`` (between nodes of one group), ``cluster.network.cross_group``
(between groups). Traffic between different vendors cannot use a vendor library: it is staged
through host memory (device -> host copy on the sender, host -> device on the receiver), each at
:data:`HOST_STAGING_BANDWIDTH`, a PCIe 4.0 x16 class figure (about 25 GB/s achieved of 32 GB/s
theoretical). CPU-family devices already live in host memory and pay no staging.

Collective formulas (Thakur et al. 2005; NCCL's docs for the tree):
- ring all-reduce: 2 (n-1)/n x bytes / bw + 2 (n-1) x latency;
- tree all-reduce (small messages): 2 ceil(log2 n) x (latency + bytes / bw) -- a reduce up and a
  broadcast down a binary tree, each hop forwarding the whole message; the faster of the two is used;
- all-gather / reduce-scatter: (n-1)/n x bytes / bw + (n-1) x latency (bytes = the full tensor).
"""
from __future__ import annotations

import math

HOST_STAGING_BANDWIDTH = 25e9
"""Bytes/s of one device <-> host copy used for cross-vendor staging (PCIe 4.0 x16, achieved)."""


def ring_allreduce(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` among ``n`` ranks (seconds; module docstring)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2.0 * (n - 1) * latency


def tree_allreduce(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Binary-tree all-reduce of ``nbytes`` among ``n`` ranks (seconds; module docstring)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * math.ceil(math.log2(n)) * (latency + nbytes / bandwidth)


def allreduce(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """All-reduce of ``nbytes`` among ``n`` ranks: the faster of ring and tree."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return min(ring_allreduce(nbytes, n, bandwidth, latency), tree_allreduce(nbytes, n, bandwidth, latency))


def allgather(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """All-gather (or reduce-scatter) of a tensor of ``nbytes`` in total among ``n`` ranks (ring)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


reduce_scatter = allgather


def staging_time(nbytes: float) -> float:
    """Host staging of one cross-vendor message: device -> host, then host -> device."""
    return 2.0 * nbytes / HOST_STAGING_BANDWIDTH


def p2p(nbytes: float, bandwidth: float, latency: float, staged: bool = False) -> float:
    """One point-to-point message; ``staged`` adds the host-staging copies."""
    t = latency + nbytes / bandwidth
    return t + staging_time(nbytes) if staged else t


__all__ = ["HOST_STAGING_BANDWIDTH", "ring_allreduce", "tree_allreduce", "allreduce", "allgather",
           "reduce_scatter", "staging_time", "p2p"]
