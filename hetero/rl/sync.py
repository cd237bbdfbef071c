"""The weight sync: the actor's parameters, in the actor plan's layout, to every whole copy that
generates (the rollout ranks; collocated: each actor rank's temporary copy).

It is a transition of the virtual parameter space (:mod:`hetero.runtime.reshard`): the sources are
the regions each actor rank holds (its stage's tensors, its tp slice of the split ones), the targets
the whole tensors of every generating rank, and :func:`~hetero.runtime.reshard.transition.plan_transition`
picks who sends what (a rank of the receiver's vendor first; every rank computes the same pieces).
Only parameter values move (no optimizer state). The pieces from one rank to another travel in
buckets (one flat tensor of at most ``bucket_mb``) through the run's communicator: the vendor's
library inside a vendor, the host bridge across vendors.

Every sync has a version (the number of updates behind the weights) and a checksum per piece: CRC32
of the piece's bytes where it was sent from and where it landed, compared at the end of the run
(:func:`checksums_match`), so a sync that changed one bit is caught.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from hetero.runtime.reshard.space import ParameterSpace, full_box, relative
from hetero.runtime.reshard.transition import Piece, plan_transition

SYNC_TAG = 72
"""The tag of weight-sync buckets."""


def crc(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (host copy, row-major)."""
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


@dataclass
class SyncLog:
    """What one rank sent or received: ``(version, src, dst, name, box) -> crc`` and the bytes."""

    sent: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)
    bytes_received: int = 0
    seconds: float = 0.0


class WeightSync:
    """The pieces from the actor's layout to whole copies on ``receivers`` (world ranks)."""

    def __init__(self, model, plan, layout, receivers: list[int], vendors: dict[int, str], bucket_mb: float = 25.0):
        self.space = ParameterSpace(model)
        self.held = self.space.layout_regions(plan, layout)
        whole = {name: full_box(shape) for name, shape in self.space.shapes.items()}
        transition = plan_transition(self.held, {r: dict(whole) for r in receivers}, vendors)
        if transition.missing:
            dst, region = transition.missing[0]
            raise RuntimeError(f"weight sync: no actor rank holds {region.name} {region.box} for rank {dst}")
        self.pieces = transition.pieces
        self.cap = max(1, int(bucket_mb * 2**20 // 4))
        self.log = SyncLog()

    def buckets(self, src: int, dst: int) -> list[list[Piece]]:
        """The pieces from ``src`` to ``dst`` in buckets of at most the cap's elements (a bigger piece alone)."""
        out, size = [], 0
        for p in (p for p in self.pieces if p.src == src and p.dst == dst):
            if not out or size + p.numel > self.cap:
                out.append([])
                size = 0
            out[-1].append(p)
            size += p.numel
        return out

    def _source_view(self, params: dict, rank: int, p: Piece) -> torch.Tensor:
        """The piece's values on its source, as fp32 (the whole copies' dtype and the wire's)."""
        local = params[p.name]
        return local[relative(p.box, self.held[rank][p.name])].float()

    def send(self, comm, rank: int, params: dict[str, torch.Tensor], version: int) -> None:
        """Actor rank ``rank``: post its buckets to every other receiver (copies: the next update may
        run while they travel); ``params``: name -> this rank's local tensor (a tp shard's local part)."""
        for dst in sorted({p.dst for p in self.pieces if p.src == rank and p.dst != rank}):
            for bucket in self.buckets(rank, dst):
                parts = [self._source_view(params, rank, p) for p in bucket]
                for p, part in zip(bucket, parts):
                    self.log.sent[(version, p.src, p.dst, p.name, p.box)] = crc(part)
                comm.send(torch.cat([t.reshape(-1) for t in parts]), dst, tag=SYNC_TAG)

    def receive(self, comm, rank: int, whole: dict[str, torch.Tensor], version: int,
                params: dict[str, torch.Tensor] | None = None) -> None:
        """Receiver ``rank``: fill ``whole`` (name -> full tensor) from every sender's buckets; pieces
        it holds itself (collocated) are copied from ``params``, its own local tensors."""
        for p in (p for p in self.pieces if p.dst == rank and p.src == rank):
            part = self._source_view(params, rank, p)
            self.log.sent[(version, p.src, p.dst, p.name, p.box)] = crc(part)
            self._put(whole, p, part, version)
        for src in sorted({p.src for p in self.pieces if p.dst == rank and p.src != rank}):
            for bucket in self.buckets(src, rank):
                flat = torch.empty(sum(p.numel for p in bucket), dtype=torch.float32)
                comm.recv(flat, src, tag=SYNC_TAG)
                self.log.bytes_received += flat.numel() * flat.element_size()
                at = 0
                for p in bucket:
                    self._put(whole, p, flat[at:at + p.numel], version)
                    at += p.numel

    def _put(self, whole: dict, p: Piece, values: torch.Tensor, version: int) -> None:
        target = whole[p.name][relative(p.box, full_box(whole[p.name].shape))]
        target.copy_(values.reshape(target.shape))
        self.log.received[(version, p.src, p.dst, p.name, p.box)] = crc(target)


def local_params(module) -> dict[str, torch.Tensor]:
    """name -> the tensor this rank holds of each parameter (a DTensor's local shard)."""
    from hetero.runtime.model import is_dtensor

    return {n: (p.to_local() if is_dtensor(p) else p).detach() for n, p in module.named_parameters()}


def whole_model(model, device) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """An uninitialised whole-model module (its values come from a sync) and name -> its tensors."""
    from hetero.runtime.model import StageModel, skip_init

    with skip_init():
        m = StageModel(model, (0, model.num_layers), True, True)
    m = m.to(device).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m, dict(m.named_parameters())


def checksums_match(logs: list[SyncLog]) -> tuple[bool, int]:
    """Whether every piece received has the checksum it was sent with (and every piece sent arrived);
    returns (match, pieces compared)."""
    sent, received = {}, {}
    for log in logs:
        sent.update(log.sent)
        received.update(log.received)
    return sent == received and bool(sent), len(sent)

