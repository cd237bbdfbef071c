"""ZeRO slices that survive a lost rank: a copy of each rank's optimizer slices in a peer's host memory.

ZeRO (:mod:`hetero.runtime.zero`) keeps the AdamW state of each slice of a holder set on one rank
only, so a lost rank's slices would have no other copy. As Gemini (SOSP'23) keeps checkpoints in
peers' CPU memory, every rank of an in-process elastic run sends what its slices own and no other
rank holds, after every optimizer update, to its *buddy*: the next rank of the holder set in ring
order (``ranks[(i + 1) % k]``), which keeps it in host memory. What is copied, per slice: the fp32
master values (the rank's own part of the parameters, which its peers get only through the
all-gather that follows the update), both AdamW moments and the step counter.

Off the critical path. The sends and receives are posted, non-blocking, on a Gloo group of their
own right after the update (:meth:`SliceCopies.start`) and waited for right before the next update
(:meth:`SliceCopies.wait`), the first moment the sent tensors change. By then every rank has passed
the next step's gradient-norm all-reduce, which it enters only after posting its own side, so the
wait is for the bytes alone, moved while the gather, the next forward and backward ran. A rank keeps
two buffers per peer: the copy of the step under way lands in the one not holding the last complete
copy, so a loss during a transfer leaves the previous copy whole.

Shadows instead of transfers. Where the slices live in host memory (CPU devices) the reduction can
leave the whole summed gradient on every member: Gloo reduce-scatters by all-reducing the vector
anyway. Then the buddy needs no transfer after the first: it keeps its source's slice as a *shadow*
(master values, moments, step counter in its host memory) and updates it itself, in the same
critical section as its own slice, with the same gradient, clip factor, learning rate and kernel
(torch's fused AdamW on the CPU, element by element: bitwise the source's own update), the
redundant computation Bamboo (NSDI'23) uses to survive preemptions. A step then costs one more
AdamW over a slice on the host, where a transfer moved 12 bytes per element of it through a socket
on the cores that compute (``benchmarks/results/zero_peer_copy*.json``), and the shadow is at the
buddy's own step whenever the buddy is at a step boundary: no loss falls between a step's update and
the arrival of its copy. The first copy (at the start, after a ``--load``, after each reshard) is
still sent, as below; a source whose state is still fresh is shadowed from the parameters. Accelerator
slices keep the transfers: a host update would not be bitwise the device kernel's.
:data:`SHADOW_ENV` ``=0`` keeps the transfers everywhere.

Which copy. Every member of a holder set updates its slice in the same steps (each update follows
one global gradient norm), so a copy matches the survivors' state when its step counter equals the
buddy's own counter for that holder set: the buddy decides alone, once its world's connections are
broken (every transfer still pending then fails at once; one that completed stays complete).

After a loss. Each survivor says in its check-in which holder sets it is a member of and whether it
holds its predecessor's slices at its own step (:meth:`SliceCopies.report`); the launcher goes on
in-process only when every lost rank's slices have such a copy on a survivor and every survivor
stopped at one step (:func:`uncovered` names what is missing otherwise: a rank lost together with its
buddy, or a rank lost between the gradient-norm all-reduce of a step, after which its peers update,
and the arrival of its copy of that update). Then, in the exchange's new world, every survivor
rebuilds its stage's whole state from its own slices, the other survivors' and the copies, point to
point (:func:`whole_state`): the live state a ``zero_stage: 0`` rank holds, so the exchange that
follows is unchanged, and a rebuilt ZeRO optimizer takes its slices of it as after a checkpoint load.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

SLICE_KINDS = ("param", "exp_avg", "exp_avg_sq")
"""What a slice owns besides its step counter: the master values (``param``) and both moments."""

COPIES_ENV = "HETERO_ZERO_SLICE_COPIES"
"""``0``: an elastic ZeRO run keeps no copies (no host memory for them, no transfers; a lost rank's
slices then have no copy, and the run goes on from a ``--save`` checkpoint or ends)."""

SHADOW_ENV = "HETERO_ZERO_SLICE_SHADOWS"
"""``0``: the buddies receive a copy after every update instead of updating shadows of their sources'
slices (module docstring)."""

WITHHOLD_ENV = "HETERO_TEST_WITHHOLD_SLICE_COPIES"
"""Testing: ``<rank>``: that rank never sends its copies (its buddy holds none, as after a loss in
the middle of a transfer), so losing it takes the path of a loss the copies cannot cover."""

_TAG_BASE = 1 << 30
"""Tags of :func:`whole_state`'s messages: apart from the exchange's that follow on the same group."""


def enabled() -> bool:
    """Whether an elastic ZeRO run keeps the copies (:data:`COPIES_ENV`)."""
    return os.environ.get(COPIES_ENV, "1") != "0"


def shard_key(shard) -> str:
    """A holder set's slices, named alike on every member: its ranks and its first tensor."""
    return f"{','.join(map(str, shard.ranks))}:{shard.bucket.names[0]}"


def holder_of(ranks, index: int, survivors) -> int | None:
    """The rank that holds slice ``index`` of a holder set sharded over ``ranks`` after a loss: its
    owner while it survives, else the owner's buddy if that survives, else None."""
    owner, buddy = ranks[index], ranks[(index + 1) % len(ranks)]
    return owner if owner in survivors else (buddy if buddy in survivors else None)


def uncovered(checkins: dict[int, dict], lost) -> str | None:
    """Launcher side: why the survivors' slices and copies (their check-ins, old rank -> check-in
    with ``applied_step`` and :meth:`SliceCopies.report`'s ``slices``) cannot rebuild the lost ranks'
    slices exactly, or None when they can."""
    steps = {c["applied_step"] for c in checkins.values()}
    if len(steps) > 1:
        by = ", ".join(f"rank {r}: {c['applied_step']}" for r, c in sorted(checkins.items()))
        return f"the surviving ranks stopped at different steps ({by}), so their slices are not of one step"
    step = steps.pop() if steps else 0
    if any(c.get("slices") is None for c in checkins.values()):
        return f"the ranks keep no copies of their optimizer slices ({COPIES_ENV}=0)"
    for r, c in sorted(checkins.items()):
        for _key, ranks, held in c["slices"]:
            for j, owner in enumerate(ranks):
                buddy = ranks[(j + 1) % len(ranks)]
                if owner in lost and buddy in lost:
                    return (f"rank {owner} was lost together with rank {buddy}, which kept the only copy of its "
                            f"optimizer slices")
            source = ranks[ranks.index(r) - 1]
            if source in lost and not held:
                return (f"rank {r} holds no copy of lost rank {source}'s optimizer slices as of step {step} (rank "
                        f"{source} was lost before its first copy since the run started, resumed or resharded arrived, "
                        f"or, where a copy follows every update, after that step's gradient norm and before the "
                        f"copy of its update arrived)")
    return None


@dataclass
class _Link:
    """One holder set of this rank: its buddy (who keeps this rank's slice) and its source (whose
    slice this rank keeps, in two buffers)."""

    key: str
    shard: object
    buddy: int
    source: int
    buffers: list = field(default_factory=list)
    """Two copies of the source's slice: kind -> host tensor, and ``step``."""
    steps: list = field(default_factory=lambda: [None, None])
    """Each buffer's step counter when it holds a complete copy, else None."""
    shadow: torch.Tensor | None = None
    """Shadow mode, once a first copy is complete: the source's master values as a parameter of
    :attr:`SliceCopies.shadow_optimizer` (sharing ``buffers[0]["param"]``, whose step ``steps[0]`` is)."""


class SliceCopies:
    """One ZeRO rank's copies (see the module docstring): ``sharded`` its
    :class:`~hetero.runtime.zero.ShardedAdamW`, ``rank`` its rank in a world of ``world``. Makes the
    copies' Gloo group: every rank of the world constructs it at the same point."""

    def __init__(self, sharded, rank: int, world: int, timeout_s: float):
        self.sharded, self.rank = sharded, rank
        self.group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.links = sorted((_Link(shard_key(s), s, s.ranks[(s.index + 1) % len(s.ranks)], s.ranks[s.index - 1])
                             for s in sharded.shards if len(s.ranks) > 1), key=lambda link: link.key)
        for link in self.links:   # written once now, so that no copy lands in fresh pages during a step
            link.buffers = [{**{k: torch.zeros(link.shard.slice_len, dtype=torch.float32) for k in SLICE_KINDS},
                             "step": torch.zeros(1, dtype=torch.float32)} for _ in range(2)]
        self.withheld = os.environ.get(WITHHOLD_ENV)
        self._pending: _Transfers | None = None
        self.shadows = bool(self.links) and os.environ.get(SHADOW_ENV, "1") != "0" and all(
            link.shard.master.device.type == "cpu" and link.shard.flat is not None for link in self.links)
        """Whether the buddies update shadows of their sources' slices (module docstring)."""
        self.shadow_optimizer = None
        self._first = True
        if self.shadows:
            for link in self.links:   # the reduction keeps the source's slice of the summed gradient
                link.shard.keep_source = link.shard.ranks.index(link.source)

    def _state(self, shard) -> dict | None:
        """The AdamW state of ``shard``'s slice (None before its first update)."""
        st = self.sharded.optimizer.state.get(shard.master, {})
        return st if "exp_avg" in st else None

    def _tags(self) -> tuple[dict[str, int], dict[str, int]]:
        """Link key -> its tag base, for the sends and for the receives: the position of the holder set
        among those this rank shares with that peer in that direction, which both ends list alike."""
        sends: dict[int, int] = {}
        recvs: dict[int, int] = {}
        out: tuple[dict[str, int], dict[str, int]] = ({}, {})
        for link in self.links:
            out[0][link.key] = 8 * sends.setdefault(link.buddy, 0)
            sends[link.buddy] += 1
            out[1][link.key] = 8 * recvs.setdefault(link.source, 0)
            recvs[link.source] += 1
        return out

    def start(self) -> None:
        """Right after an update (and once when made): post this update's copies, each slice to its
        buddy, the source's slice into the buffer that does not hold the last complete copy. In shadow
        mode only the first call sends (the state there is then: loaded, rebuilt, or fresh, for
        which the parameters serve and nothing is sent); later calls update the shadows instead
        (:meth:`_shadow_step`). Both ends of a link count the calls alike, so they agree."""
        self.wait()
        first, self._first = self._first, False
        if self.shadows and not first:
            self._shadow_step()
            return
        send_tags, recv_tags = self._tags()
        works = []   # receives first: the thread that waits for them records them before any send's end
        for link in self.links:
            st = self._state(link.shard)
            if st is None:   # no update yet: every member alike, nothing to copy
                continue
            b = 0 if link.steps[0] is None else (1 if link.steps[1] is None else int(link.steps[1] < link.steps[0]))
            link.steps[b] = None   # until the whole copy has arrived
            buf = link.buffers[b]
            if self.withheld != str(link.source):
                for i, kind in enumerate((*SLICE_KINDS, "step")):
                    work = dist.irecv(buf[kind], link.source, group=self.group, tag=recv_tags[link.key] + i)
                    works.insert(0, (work, link, b))
            if self.withheld == str(self.rank):
                continue
            mine = {"param": link.shard.master.detach(), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                    "step": torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).clone()}
            for i, kind in enumerate((*SLICE_KINDS, "step")):
                t = mine[kind].detach()
                t = t if t.device.type == "cpu" else t.to("cpu")   # Gloo carries host memory
                works.append((dist.isend(t, link.buddy, group=self.group, tag=send_tags[link.key] + i), None, None))
        if works:
            self._pending = _Transfers(works)
        elif self.shadows:
            self._open_shadows()

    def _shadow_step(self) -> None:
        """Shadow mode: update every shadow with its source's slice of the summed gradient (kept by the
        reduction) as the source updates it: the update that just ran, at the main optimizer's rate
        and :attr:`~hetero.runtime.zero.ShardedAdamW.coef`, with the same kernel."""
        from hetero.runtime.grads import scaled_step

        updated = [link for link in self.links if link.shadow is not None and link.shard.source_grad is not None]
        for link in self.links:
            if link.shadow is None:
                link.shard.source_grad = None
        if not updated or self.shadow_optimizer is None:
            return
        for link in updated:
            link.shadow.grad, link.shard.source_grad = link.shard.source_grad, None
        for group in self.shadow_optimizer.param_groups:
            group["lr"] = self.sharded.optimizer.param_groups[0]["lr"]
        scaled_step(self.shadow_optimizer, [link.shadow for link in updated], self.sharded.coef)
        for link in updated:
            link.shadow.grad = None
            st = self.shadow_optimizer.state[link.shadow]
            b = link.buffers[0]
            b["exp_avg"], b["exp_avg_sq"], b["step"] = st["exp_avg"], st["exp_avg_sq"], st["step"].reshape(1)
            link.steps[0], link.steps[1] = float(st["step"]), None

    def _begin_shadow(self, link: _Link) -> None:
        """Make ``link``'s shadow from its complete copy at this rank's own step, or from the
        parameters before any update; none when there is neither (a copy withheld or cut off)."""
        if link.shadow is not None or self.withheld == str(link.source):
            return
        st = self._state(link.shard)
        if st is None:   # no update yet: the source's part of the parameters, fresh moments
            link.buffers[0]["param"].copy_(_part_of_parameters(link.shard, link.shard.ranks.index(link.source)))
            link.buffers[0]["step"].zero_()
            link.steps[0], link.steps[1] = 0.0, None
        else:
            step = float(torch.as_tensor(st["step"]))
            b = next((b for b in (0, 1) if link.steps[b] == step), None)
            if b is None:
                return
            if b == 1:
                link.buffers[0], link.buffers[1] = link.buffers[1], link.buffers[0]
            link.steps[0], link.steps[1] = step, None
        link.shadow = torch.nn.Parameter(link.buffers[0]["param"])

    def _open_shadows(self) -> None:
        """Once the first copies are in: the shadows of every link that has its copy, and their AdamW
        (the runtime's, as the sources': fused on the CPU), holding the copied moments."""
        from hetero.runtime.grads import make_optimizer

        if self.shadow_optimizer is not None:
            return
        for link in self.links:
            self._begin_shadow(link)
        shadowed = [link for link in self.links if link.shadow is not None]
        if not shadowed:
            return
        for link in shadowed:   # the buffer a next copy would land in is not needed again
            link.buffers[1] = None
        main = self.sharded.optimizer.defaults
        self.shadow_optimizer = make_optimizer([link.shadow for link in shadowed], main["lr"], main["weight_decay"])
        for link in shadowed:
            if link.steps[0] > 0:   # copied moments; before any update AdamW makes them as the source does
                b = link.buffers[0]
                self.shadow_optimizer.state[link.shadow] = {
                    "step": b["step"].reshape(()).clone(), "exp_avg": b["exp_avg"], "exp_avg_sq": b["exp_avg_sq"]}

    def wait(self) -> None:
        """Complete the copies under way (right before the next update, and when the run ends or
        pauses): a received copy is marked complete with its step counter. A transfer that failed (a
        peer lost) leaves its buffer marked empty and raises. Waited in slices, so the launcher's
        lost-peer signal stops it (:class:`_Transfers`)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            while not pending.done.wait(0.05):
                pass
            pending.record()
            if self.shadows:
                self._open_shadows()
            if pending.error is not None:
                raise pending.error

    def settle(self, grace_s: float = 0.1) -> list:
        """After a loss, once this rank's connections are broken (what is still under way then fails at
        once, but a receive whose sender died in the middle of it may wait for the group's timeout):
        what arrived within ``grace_s`` is recorded, the rest counts as missing; returns :meth:`report`."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.done.wait(grace_s)
            pending.record()
        return self.report()

    def _copy_at(self, link: _Link, step) -> dict | None:
        for b in (0, 1):
            if link.steps[b] is not None and link.steps[b] == float(step):
                return link.buffers[b]
        return None

    def report(self) -> list:
        """For the check-in: ``[key, ranks, held]`` per holder set of this rank, ``held`` whether it holds
        its source's slice as of its own state's step (before any update: the parameters themselves,
        where it holds its source's part of them without a tp gather)."""
        out = []
        for link in self.links:
            st = self._state(link.shard)
            held = (link.shard.flat is not None or link.shard.own) if st is None else \
                self._copy_at(link, torch.as_tensor(st["step"]).item()) is not None
            out.append([link.key, list(link.shard.ranks), held])
        return out

    def _slice(self, shard, index: int, st) -> dict[str, torch.Tensor]:
        """Slice ``index`` of ``shard`` as this rank holds it: its own, or its source's copy."""
        if shard.ranks[index] == self.rank:
            own = {"param": shard.master.detach()}
            if st is not None:
                own.update(exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"])
            return {k: v.detach().to("cpu") for k, v in own.items()}
        if st is None:   # before any update every member's parameters are whole and alike
            return {"param": _part_of_parameters(shard, index).to("cpu")}
        link = next(lk for lk in self.links if lk.key == shard_key(shard))
        copy = self._copy_at(link, torch.as_tensor(st["step"]).item())
        if copy is None:
            raise RuntimeError(f"no copy of rank {shard.ranks[index]}'s slices at this step (the launcher checks)")
        return copy


def _part_of_parameters(shard, index: int) -> torch.Tensor:
    """Slice ``index`` of ``shard``'s parameters end to end: what every member holds of it before any
    update (tp > 1: a gather inside the tp group, which its members call together)."""
    from hetero.runtime.zero import ShardedAdamW

    whole = shard.flat if shard.flat is not None else ShardedAdamW._flat_params(shard)
    lo = index * shard.slice_len
    return whole[lo:lo + shard.slice_len].detach()


class _Transfers:
    """One update's copies in flight, waited for by a thread of their own: in Gloo a receive whose
    sender died in the middle of it ends only at the group's timeout, and a signal's handler does not
    run while the main thread is inside that wait, so the main thread waits for this thread instead,
    in slices. A wait with a timeout is no way out: the buffer it times out is unusable after."""

    def __init__(self, works: list):
        import threading

        self.works = works   # (work, link, buffer) for a receive, (work, None, None) for a send
        self.ok: list[bool | None] = [None] * len(works)
        self.error: Exception | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, name="hetero-slice-copies", daemon=True).start()

    def _run(self) -> None:
        for i, (work, _, _) in enumerate(self.works):
            try:
                work.wait()
                self.ok[i] = True
            except Exception as e:  # noqa: BLE001 - a peer lost: the main thread raises it
                self.ok[i], self.error = False, self.error or e
        self.done.set()

    def record(self) -> None:
        """Mark each receiving buffer complete (its step counter) when every part of it arrived, else
        empty (a part failed, or is still waited for)."""
        received: dict[tuple[int, int], list] = {}
        for (_, link, b), ok in zip(self.works, list(self.ok)):
            if link is not None:
                entry = received.setdefault((id(link), b), [link, b, True])
                entry[2] = entry[2] and ok is True
        for link, b, ok in received.values():
            link.steps[b] = float(link.buffers[b]["step"][0]) if ok else None


def whole_state(copies: SliceCopies, module, regions: dict, world_rank: dict[int, int], survivors,
                describe=lambda r: f"rank {r}") -> dict:
    """This survivor's stage state, whole (:func:`hetero.runtime.reshard.transfer.live_state`'s form:
    name -> TensorState for ``regions``), from its slices, the other survivors' and the copies of the
    lost ranks' slices, in the exchange's world (``world_rank``: old rank -> rank there; every survivor
    calls it). A slice goes from its holder (:func:`holder_of`) to every other surviving member of its
    holder set, point to point."""
    from hetero.runtime.grads import local_part
    from hetero.runtime.reshard import ReconfigurationError
    from hetero.runtime.reshard.transfer import TensorState

    sharded, me = copies.sharded, copies.rank
    survivors = set(survivors)
    counters: dict[tuple[int, int], int] = {}
    works, flats = [], []
    for shard in sorted(sharded.shards, key=shard_key):
        st = copies._state(shard)
        kinds = SLICE_KINDS if st is not None else ("param",)
        flat = {k: torch.zeros(shard.padded, dtype=torch.float32) for k in SLICE_KINDS}
        for i in range(len(shard.ranks)):
            holder = holder_of(shard.ranks, i, survivors)
            part = slice(i * shard.slice_len, (i + 1) * shard.slice_len)
            data = copies._slice(shard, i, st) if holder == me else None
            if data is not None:
                for k in kinds:
                    flat[k][part].copy_(data[k])
            for m in shard.ranks:
                if m == holder or m not in survivors or me not in (holder, m):
                    continue
                for k in kinds:   # both ends count the messages of their pair alike
                    tag = _TAG_BASE + counters.get((holder, m), 0)
                    counters[(holder, m)] = counters.get((holder, m), 0) + 1
                    if me == holder:
                        works.append((dist.isend(data[k].contiguous(), world_rank[m], tag=tag), m))
                    else:
                        works.append((dist.irecv(flat[k][part], world_rank[holder], tag=tag), holder))
        flats.append((shard, flat, None if st is None else torch.as_tensor(st["step"]).detach().to("cpu").clone()))
    for work, peer in works:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - named
            raise ReconfigurationError(f"reshard: {describe(world_rank[peer])} was lost while the survivors rebuilt "
                                       f"the lost ranks' optimizer slices ({str(e).splitlines()[0][:200]})") from None
    out = {}
    for shard, flat, step in flats:
        for name, p, shape, lo, hi in zip(shard.bucket.names, shard.params, shard.shapes, shard.offsets,
                                          shard.offsets[1:]):
            box = regions[name]
            idx = tuple(slice(a, b) for a, b in box)   # a full tensor (not own) is cut to the region
            tensors = {k: (flat[k][lo:hi].view(shape) if shard.own else flat[k][lo:hi].view(shape)[idx]).contiguous()
                       for k in SLICE_KINDS}
            out[name] = TensorState(box, tensors, step)
    names = {id(p): n for n, p in module.named_parameters()}
    for p in sharded.local:   # held by this rank alone: as a zero_stage 0 rank holds them
        name, st = names[id(p)], sharded.optimizer.state.get(p, {})
        local = local_part(p.detach())
        tensors = {"param": local, **{k: local_part(st[k]) if k in st else torch.zeros_like(local)
                                      for k in SLICE_KINDS[1:]}}
        out[name] = TensorState(regions[name], tensors,
                                torch.as_tensor(st["step"]).detach().cpu() if "step" in st else None)
    missing = sorted(set(regions) - set(out))
    if missing:
        raise RuntimeError(f"the rebuilt ZeRO state lacks {missing[:3]} ({len(missing)} tensors)")
    return out
