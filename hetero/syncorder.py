"""The order in which every rank runs its gradient all-reduces (shared by the runtime and the predictor).

Each bucket of gradients is summed by one blocking all-reduce over its holder set (the ranks that
hold those parameters, :mod:`hetero.runtime.grads`). Any order that all ranks agree on is free of
deadlock: the earliest bucket not yet run can always start. But a plain sorted order can serialise
pipelines of different shapes: with stage boundaries staggered, bucket k shares a stage with bucket
k + 1, so rank by rank the all-reduces form a chain and run one after another (a two-pipeline
Llama-2-70B plan with 8 and 12 stages: 5.5 s of predicted gradient sync).

So the buckets are run in rounds: walking the agreed order, each bucket goes to the earliest round
in which none of its holders has a bucket yet (a greedy colouring of the "shares a holder" graph),
and ranks run round by round, the agreed order inside a round. Buckets of one round touch disjoint
holders and run at the same time; the chain of the example becomes two rounds (1.8 s predicted).

Holders are given as sets of any hashable: ranks in the runtime; in the predictor, each stage
stands for its tp x replicas ranks (stages hold disjoint ranks, so the two colourings agree). A
bucket held by one rank alone runs no collective and takes no round.
"""
from __future__ import annotations

from typing import Hashable, Iterable, Sequence

BUCKET_CAP_BYTES = 25 * 2**20
"""The largest bucket of gradients one collective sums (fp32 bytes), DDP's default: small enough
that the first buckets of a backward are finished, and on their way, while the rest of the backward
runs (:mod:`hetero.runtime.overlap`); large enough that each collective moves megabytes, not a
tensor at a time. The runtime cuts each holder set's parameters so, and the predictor counts the
last bucket as what the backward cannot hide."""


def sync_rounds(holder_sets: Sequence[Iterable[Hashable]]) -> list[int]:
    """Round of each holder set, walking them in the given (agreed) order; -1 for a set of one
    holder (nothing to sum with anyone)."""
    used: list[set] = []   # per round, the holders that already have a bucket in it
    out = []
    for hs in holder_sets:
        hs = set(hs)
        if len(hs) < 2:
            out.append(-1)
            continue
        r = 0
        while r < len(used) and not used[r].isdisjoint(hs):
            r += 1
        if r == len(used):
            used.append(set())
        used[r] |= hs
        out.append(r)
    return out


def in_sync_order(holder_sets: Sequence[Iterable[Hashable]]) -> list[int]:
    """Indices of ``holder_sets`` (given in the agreed order) in the order the ranks run them:
    round by round (:func:`sync_rounds`), the agreed order inside a round; sets of one holder first."""
    rounds = sync_rounds(holder_sets)
    return sorted(range(len(rounds)), key=lambda i: (rounds[i], i))


__all__ = ["BUCKET_CAP_BYTES", "in_sync_order", "sync_rounds"]
