"""The bounded stream of sample groups from the ranks that generate to the actor ranks that train.

A finished group (one ``(group_size, width)`` float64 tensor, :func:`hetero.rl.rollout.pack_group`)
is sent at once, asynchronously, to every actor rank that reads it: the last stage of every pipeline
replica (the step's loss needs the step's completion-token count, so it reads all groups) and the
first stage of the replica whose slice of the step holds the group (its token ids). The receiver
takes groups in the order it needs them; one sender's messages to one receiver arrive in the order
sent (one tag), and a sender sends each receiver its groups in (step, group) order, so a receiver
asking for group ``g`` reads the next messages from ``g``'s sender until that group is there. The
stream is bounded by the weight sync: a sender of step ``t + k + 1`` first needs the weights after
step ``t`` (``k``: the job's staleness), so at most ``k + 1`` steps of groups are ever in flight.
"""
from __future__ import annotations

import torch

from hetero.rl.rollout import row_width

CHANNEL_TAG = 71
"""The tag of sample groups (apart from the pipeline's activations and gradients)."""


def readers(plan, layout, group: int, group_size: int) -> list[int]:
    """The actor ranks that read ``group`` of a step (see the module docstring)."""
    from hetero.runtime.data import replica_slice

    out = set()
    for info in layout.ranks:
        first, last = info.holds_ends(plan)
        if last:
            out.add(info.rank)
        elif first:
            sl = replica_slice(plan, info.pipeline, info.replica)
            lo, hi = sl.offset, sl.offset + sl.micro_batches * sl.micro_batch_size
            if lo < (group + 1) * group_size and group * group_size < hi:
                out.add(info.rank)
    return sorted(out)


class Channel:
    """One rank's end of the stream: :meth:`put` on a rank that generates, :meth:`group` on an actor
    rank. ``owners[g]``: the rank that generates group ``g`` of every step."""

    def __init__(self, comm, rank: int, plan, layout, owners: list[int], group_size: int, seq_length: int):
        self.comm = comm.with_own_sends()   # the pipeline waits for its own sends, not the channel's
        self.rank, self.owners, self.G = rank, owners, group_size
        self.width = row_width(seq_length)
        self.readers = [readers(plan, layout, g, group_size) for g in range(len(owners))]
        self.inbox: dict[tuple[int, int], torch.Tensor] = {}
        self.sent: dict[int, list] = {}

    def put(self, step: int, group: int, rows: torch.Tensor) -> None:
        """Send a finished group to its readers (to this rank itself: straight into the inbox)."""
        for dst in self.readers[group]:
            if dst == self.rank:
                self.inbox[(step, group)] = rows
            else:
                self.comm.send(rows, dst, tag=CHANNEL_TAG)
        self.sent.setdefault(step, []).extend(self.comm.take_sends())

    def wait_sent(self, up_to_step: int) -> None:
        """Complete the sends of every step up to ``up_to_step`` (their readers have taken them)."""
        for step in sorted(s for s in self.sent if s <= up_to_step):
            self.comm.wait_sends(self.sent.pop(step))

    def group(self, step: int, group: int) -> torch.Tensor:
        """Group ``group`` of ``step``, received from its owner if it is not here yet."""
        key = (step, group)
        src = self.owners[group]
        while key not in self.inbox:
            rows = torch.empty(self.G, self.width, dtype=torch.float64)
            self.comm.recv(rows, src, tag=CHANNEL_TAG)
            got = (int(rows[0, 0]), int(rows[0, 1]))
            if self.owners[got[1]] != src or got in self.inbox:
                raise RuntimeError(f"channel: rank {src} sent step {got[0]} group {got[1]} out of order")
            self.inbox[got] = rows
        return self.inbox[key]

    def drop_step(self, step: int) -> None:
        """Forget the groups of ``step`` (trained on)."""
        for key in [k for k in self.inbox if k[0] <= step]:
            del self.inbox[key]
