"""A transition's transfer time from the bytes each link carries and the cluster's link classes.

Each rank sends its pieces one message at a time and receives likewise, so a rank is busy for the
sum over its links of ``latency x messages + bytes / bandwidth``, on the sending side and on the
receiving side; the exchange ends with its busiest rank. The link class between two ranks is the
cluster's (:meth:`hetero.specs.cluster.Cluster.link_between`: a group's ``intra_node`` link inside
a node, ``inter_node`` across nodes of a group, ``cross_group`` between groups, where the vendors'
host bridge runs). In-memory copies of what a rank keeps are not counted.
"""
from __future__ import annotations

import math


def predict_transfer_s(transition, cluster, places: dict, chunk_bytes: int | None = None) -> dict:
    """``{"transfer_s": the estimate, "busiest_rank": r, "per_rank_s": {rank: seconds}}`` for
    ``transition`` on ``cluster``; ``places``: each rank of the exchange -> its device (anything with
    ``group`` and ``node``, e.g. a :class:`hetero.layout.RankInfo`);
    ``chunk_bytes``: the exchange's message size (None: one message per piece)."""
    from hetero.runtime.reshard.transfer import DEFAULT_MAX_BYTES

    chunk = chunk_bytes or max(1 << 20, DEFAULT_MAX_BYTES // 4)
    send: dict[int, float] = {}
    recv: dict[int, float] = {}
    for (src, dst), nbytes in transition.link_bytes().items():
        a, b = places[src], places[dst]
        link = cluster.link_between(a.group, b.group, same_node=(a.group, a.node) == (b.group, b.node))
        t = link.latency * max(1, math.ceil(nbytes / chunk)) + nbytes / link.bandwidth
        send[src] = send.get(src, 0.0) + t
        recv[dst] = recv.get(dst, 0.0) + t
    per_rank = {r: max(send.get(r, 0.0), recv.get(r, 0.0)) for r in set(send) | set(recv)}
    busiest = max(per_rank, key=per_rank.get, default=None)
    return {"transfer_s": per_rank.get(busiest, 0.0), "busiest_rank": busiest, "per_rank_s": per_rank}
