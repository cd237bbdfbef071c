"""The planner-facing cost model: stage times, memory, capacity, p2p and DP sync, all memoised.

``predict()`` scores plans with this same object, so the planner and the predictor cannot
disagree (the predictor is the single source of cost truth).

    cm = StageCostModel(cluster, model, calibration=None)
    fwd, bwd = cm.layer_times("a100", tp=2, mbs=4, recompute="none")
    fwd, bwd = cm.stage_times("a100", 2, 4, (0, 14), "none", first=True, last=False)
    nbytes = cm.stage_memory("a100", 2, 4, (0, 14), "none", zero_stage=0, dp=4, in_flight=4,
                             first=True, last=False)
    cm.capacity("a100"); cm.p2p_time("a100", "mi250", 4); cm.dp_sync_time(plan)

Compute: a layer's kernels run in order on one device stream. Their latencies come from the
device's op model as an isolated call measures them (host dispatch + kernel); in a step the host
queues kernels ahead of the device, so a layer takes max(host dispatch, device work), not the sum
(:func:`~hetero.predictor.optime.stream_time`; CPU devices run ops synchronously and sum them).

Data-parallel gradient synchronisation (see :meth:`StageCostModel.dp_sync_time` and
:mod:`.placement`): every layer's gradient is summed over every replica that holds it, whatever its
pipeline's shape. Replicas in one group all-reduce among themselves (NVLink when they share a node,
else the network: a node's NIC carries one ring per tp rank it hosts, and the rings of every stage
placed in that node share it); when replicas span groups the
reduction is hierarchical: inside each group, then between the group leaders over
``network.cross_group`` (host-staged when vendors differ), then broadcast back (the in-group
all-reduce accounts for reduce + broadcast). A device syncs its layers one after another (bucketed),
devices in parallel. It is not overlapped with backward (the hetero runtime, and Megatron's default
without --overlap-grad-reduce): a device starts when its own schedule is done, and each bucket's
all-reduce starts when the last of its holders gets to it (:meth:`.placement.SyncPlan.spans`, used by
``predict()``). ZeRO-1/2 replace the all-reduce by a
reduce-scatter of gradients plus an all-gather of updated parameters (same ring volume).
Embedding and head gradients are synced like a layer among first / last stages; with tied
embeddings the last stages' copy of the word embedding is summed with the first stages' (Megatron's
embedding all-reduce). Where ranks sit (which p2p and which rings cross the network) follows a
placement: the hetero runtime's (``packed``, default) or Megatron's rank order (``megatron``).
"""
from __future__ import annotations

import os

from hetero.specs.cluster import Cluster, is_loopback
from hetero.specs.model import ModelSpec

from . import comm
from . import memory as mem
from .allocator import reserved_bytes
from . import placement as _placement
from . import ops as O
from .factors import IDENTITY, CalibrationFactors
from .ops import GRAD_NORM_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM  # defined there: profiles read them too
from .optime import ROOFLINE, kernel_cost, op_model_for, stream_split



KERNEL_BUILDERS = {   # name -> (model, micro-batch, tp, recompute) -> the kernels, in order
    "layer_forward": lambda m, b, t, r: O.layer_forward_ops(m, b, m.seq_length, t),
    "layer_backward": lambda m, b, t, r: O.layer_backward_ops(m, b, m.seq_length, t, r),
    "embedding_forward": lambda m, b, t, r: O.embedding_forward_ops(m, b, m.seq_length, t),
    "embedding_backward": lambda m, b, t, r: O.embedding_backward_ops(m, b, m.seq_length, t),
    "head_forward": lambda m, b, t, r: O.head_forward_ops(m, b, m.seq_length, t),
    "head_backward": lambda m, b, t, r: O.head_backward_ops(m, b, m.seq_length, t),
}
_KERNEL_COSTS: dict = {}
_KERNEL_COSTS_MAX = 8_000


def kernel_costs(opm, device, dtype: str, kind: str, model: ModelSpec, mbs: int, tp: int,
                 recompute: str = "none") -> tuple[tuple[tuple, bool], ...]:
    """Each kernel's (isolated-call cost from ``opm`` on ``device``, whether it is a GEMM) for one
    :data:`KERNEL_BUILDERS` entry. Neither depends on a calibration, so every cost model on the same
    op model and device shares them: a calibration fit builds a cost model per trial of its factors
    and would otherwise rebuild and re-cost every kernel each time. Keyed on the op model's and the
    device's identity (held, so an id is never reused while its entry lives)."""
    return _by_identity(_KERNEL_COSTS, _KERNEL_COSTS_MAX, (opm, device), (dtype, kind, model, mbs, tp, recompute),
                        lambda: tuple((kernel_cost(opm, o, dtype, device), o.op in O.GEMM_OPS)
                                      for o in KERNEL_BUILDERS[kind](model, mbs, tp, recompute)))


def _by_identity(store: dict, limit: int, objects: tuple, rest: tuple, compute):
    """``compute()``, memoised in ``store`` on the identity of ``objects`` (held with the value, so
    an id is never reused while its entry lives) and the hashable ``rest``. The store is emptied
    when it reaches ``limit`` entries (objects rebuilt by new profiles leave their old entries)."""
    key = (*map(id, objects), *rest)
    hit = store.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], objects)):
        return hit[1]
    if len(store) >= limit:
        store.clear()
    value = compute()
    store[key] = (objects, value)
    return value


class StageCostModel:
    """Memoised costs of stages of ``model`` on the groups of ``cluster``."""

    def __init__(self, cluster: Cluster, model: ModelSpec, calibration=None, allocator: str | None = None):
        self.cluster = cluster = _with_calibrated_network(cluster, calibration)
        self.allocator = allocator
        """The allocator fit is judged by (:mod:`.allocator`): :meth:`stage_memory` gives the bytes it
        reserves; None: the live peak."""
        self.model = model
        self.calibration = calibration
        self.dtype = model.dtype
        self.e = O.DTYPE_BYTES[model.dtype]
        self._groups = {g.name: g for g in cluster.groups}
        self._dev = {name: cluster.device_type(name) for name in self._groups}
        self._factors: dict[str, CalibrationFactors] = {}
        self._opm: dict[str, object] = {}
        self._prov: dict[str, str] = {}
        self._opkind: dict[str, str] = {}
        by_device: dict[str, tuple] = {}
        self._sources: dict[str, tuple] = {}  # device type -> (DeviceType, its op-time source)
        self._profiles_stamp = _profiles_stamp()
        for name, g in self._groups.items():
            dev = self._dev[name]
            if g.device not in by_device:
                opm, prov = _op_model_for(g.device, dev, self._profiles_stamp)
                self._sources[g.device] = (dev, _source_of(opm))
                f = None
                if calibration is not None:
                    f = calibration.factors_for(g.device, dev)
                if f is not None:
                    if f.op_model == "roofline" and prov != "profile":  # a local profile stays the better source
                        opm = ROOFLINE
                    prov = f.source or "calibration"
                by_device[g.device] = (opm, prov, f or IDENTITY)
            opm, prov, f = by_device[g.device]
            self._opm[name], self._prov[name], self._factors[name] = opm, prov, f
            self._opkind[name] = getattr(opm, "kind", None) or ("profile" if prov == "profile" else "learned")
        self._cache: dict = {}
        self._dp_cache: dict = {}
        self._params_per_layer = model.params_per_layer()
        self.loopback = self._loopback_floors()
        """The runtime's measured small-message costs (``{"p2p_s", "allreduce_s"}``) when every
        device is a CPU process of this machine whose profile measured them, else None: no message
        between two ranks of such a cluster costs less (:mod:`hetero.measure.loopback`)."""

    def _loopback_floors(self) -> dict | None:
        for name, g in self._groups.items():
            hosts = g.hosts or (["localhost"] if g.nodes == 1 else [])
            if self._dev[name].family != "cpu" or not hosts or not all(map(is_loopback, hosts)):
                return None
        # the profile's own model (an emulated slower device wraps it: ``source_model``)
        floors = [getattr(getattr(self._opm[name], "source_model", self._opm[name]), "loopback", None)
                  for name in self._groups]
        if not floors or any(f is None for f in floors):
            return None
        return {k: max(f[k] for f in floors) for k in ("p2p_s", "allreduce_s")}

    def sources_changed(self) -> bool:
        """Whether a device's operator-time source changed since this model was built (a profile
        written or rewritten by ``hetero profile`` meanwhile): memoised cost models are then stale."""
        stamp = _profiles_stamp()
        if stamp is not None and stamp == self._profiles_stamp:  # profiles are written by rename: the folder's mtime moves
            return False
        self._profiles_stamp = stamp
        return any(_source_of(op_model_for(name, dev)[0]) is not src for name, (dev, src) in self._sources.items())

    # ------------------------------------------------------------------ basics
    def device(self, group: str):
        """The ``DeviceType`` of ``group``."""
        return self._dev[group]

    def op_model(self, group: str):
        """The operator model that costs ``group``'s kernels (a profile, the learned model, a roofline)."""
        return self._opm[group]

    def factors(self, group: str) -> CalibrationFactors:
        """The calibration factors applied to ``group`` (identity without a calibration)."""
        return self._factors[group]

    def provenance(self) -> dict[str, dict]:
        """Per device type: where its numbers come from (catalog / cluster file / profile /
        calibration) and which operator model ran (learned / roofline / profile). Fixed when the
        cost model is built, so it is worked out once; each call gets its own copy."""
        known = self._cache.get("provenance")
        if known is None:
            known = self._cache["provenance"] = self._provenance()
        return {device: {**entry, "groups": list(entry["groups"])} for device, entry in known.items()}

    def _provenance(self) -> dict[str, dict]:
        out = {}
        for name, g in self._groups.items():
            if g.device not in out:
                note = getattr(self._opm[name], "accuracy_note", None)
                source = self._prov[name]
                if source == "catalog" and g.device in self.cluster.devices:   # defined or overridden there
                    source = "cluster file"
                out[g.device] = {"device": g.device, "groups": [], "source": source,
                                 "op_model": self._opkind[name], "note": note(self._dev[name]) if note else ""}
            out[g.device]["groups"].append(name)
        return out

    def peak_flops(self, group: str) -> float:
        """Peak matrix FLOP/s of one device of ``group`` in the model dtype (MFU denominator)."""
        key = ("pf", group)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = float(self._dev[group].matrix_flops(self.dtype))
        return hit

    def capacity(self, group: str) -> float:
        """Memory bytes of one device of ``group``."""
        return float(self._dev[group].memory)

    # ------------------------------------------------------------------ compute
    def _ops_split(self, group: str, kind: str, mbs: int, tp: int, recompute: str = "none") -> tuple[float, float]:
        """(host dispatch, device work) seconds of one builder's kernels (``kind``: a key of
        :data:`KERNEL_BUILDERS`) on one device stream, with the group's matrix factor on the GEMMs'
        device share and its compute factor and per-kernel dispatch floor
        (:func:`~hetero.predictor.optime.stream_split`)."""
        factors = self._factors[group]
        costs = kernel_costs(self._opm[group], self._dev[group], self.dtype, kind, self.model, mbs, tp, recompute)
        matrix = factors.matrix
        if matrix != 1.0:   # device share scaled, host share kept
            costs = [(c[1] + (c[0] - c[1]) * matrix, c[1]) if gemm else c for c, gemm in costs]
        else:
            costs = [c for c, _ in costs]
        return stream_split(costs, factors.compute, factors.op_floor_s)

    def memoised(self, key: tuple, compute):
        """``compute()``, kept under ``key`` (a tuple starting with its kind) for this cost model's life."""
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = compute()
        return hit

    def kernels_time(self, group: str, ops) -> float:
        """Seconds of the kernels ``ops`` (:class:`~hetero.predictor.ops.Op`) in order on one device
        stream of ``group``, costed as :meth:`_ops_split` costs a builder's (MoE experts, routers)."""
        factors, opm, dev = self._factors[group], self._opm[group], self._dev[group]
        costs = []
        for o in ops:
            c = kernel_cost(opm, o, self.dtype, dev)
            costs.append((c[1] + (c[0] - c[1]) * factors.matrix, c[1]) if o.op in O.GEMM_OPS and factors.matrix != 1.0
                         else c)
        return max(stream_split(costs, factors.compute, factors.op_floor_s))

    def _ops_time(self, group: str, kind: str, mbs: int, tp: int) -> float:
        """Seconds of one builder's kernels in order on one device stream: host dispatch overlaps
        the device, the slower sets the pace (:func:`~hetero.predictor.optime.stream_time`)."""
        return max(self._ops_split(group, kind, mbs, tp))

    def _layer_splits(self, group: str, tp: int, mbs: int, recompute: str) -> tuple[tuple[float, float], ...]:
        """((host, device) of one layer's forward kernels, the same of its backward kernels), one
        micro-batch; memoised (both the layer times and the launch-bound verdict read it)."""
        key = ("ls", group, tp, mbs, recompute)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = (self._ops_split(group, "layer_forward", mbs, tp),
                                      self._ops_split(group, "layer_backward", mbs, tp, recompute))
        return hit

    def layer_stream(self, group: str, tp: int, mbs: int, recompute: str = "none") -> tuple[float, float]:
        """(host dispatch, device work) seconds of one layer's kernels, forward plus backward, for one
        micro-batch (no communication). Host >= device means the layer is launch-bound: the device
        waits for the host to issue kernels, and only bigger kernels or fewer launches help."""
        (hf, df), (hb, db) = self._layer_splits(group, tp, mbs, recompute)
        return hf + hb, df + db

    def _layer_ratio(self, group: str, mbs: int, which: str = "layer_ratio") -> tuple[float, float]:
        """Operator sum -> measured layer (or edge: ``which="edge_ratio"``) time, for op models that
        know it (a CPU profile with block probes: Python / autograd dispatch and the runtime's fused
        kernels); else (1, 1)."""
        fn = getattr(self._opm[group], which, None)
        if fn is None:
            return 1.0, 1.0
        try:
            return fn(self.model, mbs, self.model.seq_length)
        except Exception:  # noqa: BLE001 - a broken probe sidecar must not break predictions
            return 1.0, 1.0

    def _tp_allreduce(self, group: str, tp: int, mbs: int) -> float:
        """One Megatron tensor-parallel all-reduce of the b x s x h activation: inside a node, or, for
        a tp group over k whole nodes, hierarchically (reduce-scatter in the node, all-reduce of the
        whole activation over the k nodes' inter-node links, all-gather in the node)."""
        if tp <= 1:
            return 0.0
        g = self._groups[group]
        link = g.intra_node
        nbytes = mbs * self.model.seq_length * self.model.hidden_size * self.e
        if tp <= g.devices_per_node:
            return comm.allreduce(nbytes, tp, link.bandwidth, link.latency) * self._factors[group].communication
        per, k, net = g.devices_per_node, tp // g.devices_per_node, self.cluster.network.inter_node
        t = (comm.reduce_scatter(nbytes, per, link.bandwidth, link.latency)
             + comm.allreduce(nbytes, k, net.bandwidth, net.latency)
             + comm.allgather(nbytes, per, link.bandwidth, link.latency))
        return t * self._factors[group].communication

    def layer_compute_times(self, group: str, tp: int, mbs: int, recompute: str) -> tuple[float, float]:
        """Per layer, compute only (no communication, no overhead)."""
        key = ("lc", group, tp, mbs, recompute)
        hit = self._cache.get(key)
        if hit is None:
            fwd, bwd = self._layer_splits(group, tp, mbs, recompute)
            rf, rb = self._layer_ratio(group, mbs)
            hit = self._cache[key] = (max(fwd) * rf, max(bwd) * rb)
        return hit

    def layer_times(self, group: str, tp: int, mbs: int, recompute: str = "none") -> tuple[float, float]:
        """(forward, backward) seconds of one transformer layer for one micro-batch, including its
        tensor-parallel all-reduces (2 forward, 2 backward, 2 more with full recomputation) and the
        calibration's per-layer overhead."""
        key = ("l", group, tp, mbs, recompute)
        hit = self._cache.get(key)
        if hit is None:
            f, b = self.layer_compute_times(group, tp, mbs, recompute)
            ar = self._tp_allreduce(group, tp, mbs)
            ov = self._factors[group].layer_overhead_s
            hit = self._cache[key] = (f + 2 * ar + ov, b + (4 if recompute == "full" else 2) * ar + 2 * ov)
        return hit

    def edge_times(self, group: str, tp: int, mbs: int, first: bool, last: bool) -> tuple[float, float]:
        """(forward, backward) of the embedding (first) and final norm + LM head + loss (last)."""
        key = ("e", group, tp, mbs, first, last)
        hit = self._cache.get(key)
        if hit is None:
            rf, rb = self._layer_ratio(group, mbs, "edge_ratio")
            f = b = 0.0
            if first:
                f += self._ops_time(group, "embedding_forward", mbs, tp) * rf + self._tp_allreduce(group, tp, mbs)
                b += self._ops_time(group, "embedding_backward", mbs, tp) * rb
            if last:
                f += self._ops_time(group, "head_forward", mbs, tp) * rf
                b += self._ops_time(group, "head_backward", mbs, tp) * rb + self._tp_allreduce(group, tp, mbs)
            hit = self._cache[key] = (f, b)
        return hit

    def stage_times(self, group: str, tp: int, mbs: int, layers, recompute: str = "none",
                    first: bool = False, last: bool = False) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch through a stage holding ``layers``
        ([start, end)), plus the embedding on the first stage and the head on the last."""
        n = layers[1] - layers[0]
        lf, lb = self.layer_times(group, tp, mbs, recompute)
        if first or last:
            ef, eb = self.edge_times(group, tp, mbs, first, last)
            return n * lf + ef, n * lb + eb
        return n * lf, n * lb

    def optimizer_time(self, group: str, tp: int, layers, first: bool, last: bool,
                       zero_stage: int = 0, dp: int = 1, placement: str = "packed") -> float:
        """The optimizer step of one device's shard, the gradient-norm pass and Adam: memory-bound over
        params, grads and states (or, on a CPU profiled with block probes, the measured seconds per
        parameter). An fp16 / bf16 model under ``megatron`` also writes the model-dtype copy of
        the updated fp32 master weights (+e bytes per parameter); hetero's runtime (``packed``)
        updates its fp32 parameters in place and has no such copy."""
        copy = self.e if placement == "megatron" and self.e < 4 else 0
        # hetero's runtime gathering bf16 values under ZeRO (:func:`.memory.gathers_in_bf16`): the
        # updated slice is cast to bf16 (read 4, write 2 bytes a slice parameter) and every
        # parameter of the stage takes its gathered value back in fp32 (read 2, write 4)
        low = placement == "packed" and dp > 1 and tp == 1 and mem.gathers_in_bf16(self.dtype, zero_stage)
        key = ("o", group, tp, layers[1] - layers[0], first, last, zero_stage, dp, copy, low)
        hit = self._cache.get(key)
        if hit is None:
            params = mem.stage_params(self.model, layers[1] - layers[0], tp, first, last)
            casts = params * 6 * (1 + 1 / dp) if low else 0.0
            if zero_stage >= 1:
                params /= max(1, dp)
            measured = None
            fn = getattr(self._opm[group], "optimizer_time", None)
            if fn is not None:  # a CPU profile's measured norm pass + AdamW step (slowdown applied)
                try:
                    measured = fn(params, self.model.hidden_size)
                except Exception:  # noqa: BLE001
                    measured = None
            bw = self._dev[group].effective_memory_bandwidth
            if measured is not None:
                hit = self._cache[key] = (measured + casts / bw) * self._factors[group].compute
            else:
                per = GRAD_NORM_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM + copy
                hit = self._cache[key] = (params * per + casts) / bw * self._factors[group].compute
        return hit

    # ------------------------------------------------------------------ memory
    def stage_memory_breakdown(self, group: str, tp: int, mbs: int, layers, recompute: str,
                               zero_stage: int, dp: int, in_flight: float, first: bool,
                               last: bool, grads_while_held: bool = True,
                               summed_params: float = 0.0, grad_buffer: bool = False) -> mem.MemoryBreakdown:
        """Peak bytes on one device of a stage, by kind (see :func:`.memory.stage_memory`)."""
        key = ("m", group, tp, mbs, layers[1] - layers[0], recompute, zero_stage, dp, in_flight, first, last,
               grads_while_held, summed_params, grad_buffer)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = mem.stage_memory(
                self.model, self._dev[group].family, tp, mbs, layers[1] - layers[0], recompute,
                zero_stage, dp, in_flight, first, last, grads_while_held, summed_params, grad_buffer)
        return hit

    def stage_summary(self, group: str, tp: int, mbs: int, num_layers: int, recompute: str, zero_stage: int,
                      dp: int, in_flight: float, first: bool, last: bool, grads_while_held: bool, replicas: int,
                      no_tp: bool, placement: str = "packed") -> tuple:
        """What :func:`~hetero.predictor.predict` reports of one device of a stage holding
        ``num_layers``, from one memoised look-up: (:meth:`stage_memory_breakdown`, its total bytes,
        the device's bytes, :meth:`optimizer_time`, :meth:`layer_stream`). Its gradient buffer
        follows :func:`.memory.summed_params` (``replicas``: model copies in the plan) and
        :func:`.memory.uses_gradient_buffers` (``no_tp``: no stage of the plan splits tensors)."""
        key = ("sum", group, tp, mbs, num_layers, recompute, zero_stage, dp, in_flight, first, last,
               grads_while_held, replicas, no_tp, placement)
        hit = self._cache.get(key)
        if hit is None:
            layers = (0, num_layers)
            br = self.stage_memory_breakdown(group, tp, mbs, layers, recompute, zero_stage, dp, in_flight, first, last,
                                             grads_while_held,
                                             mem.summed_params(self.model, num_layers, tp, first, last, replicas),
                                             no_tp and grads_while_held)
            hit = self._cache[key] = (br, int(br.total), int(self.capacity(group)),
                                      self.optimizer_time(group, tp, layers, first, last, zero_stage, dp, placement),
                                      self.layer_stream(group, tp, mbs, recompute))
        return hit

    def stage_memory(self, group: str, tp: int, mbs: int, layers, recompute: str = "none",
                     zero_stage: int = 0, dp: int = 1, in_flight: float = 1, first: bool = False,
                     last: bool = False, summed_params: float = 0.0) -> float:
        """Peak bytes on one device of a stage (see :mod:`hetero.predictor.memory`); with an
        :attr:`allocator`, the bytes it reserves for that peak."""
        br = self.stage_memory_breakdown(group, tp, mbs, layers, recompute, zero_stage, dp,
                                         in_flight, first, last, True, summed_params)
        return br.total if self.allocator is None else reserved_bytes(self.allocator, br)

    # ------------------------------------------------------------------ communication
    def p2p_time(self, group_a: str, group_b: str, mbs: int, same_node: bool | None = None,
                 streams: int = 1, tp_a: int = 1, tp_b: int = 1) -> float:
        """Send one micro-batch's activation (b x s x h) from a stage in ``group_a`` to one in
        ``group_b``. Same group: the intra-node link when ``same_node`` (default: when the group is
        a single node), else inter-node. Different groups: cross-group link, plus host staging
        when the vendors differ (and neither side is a CPU). ``streams``: replicas whose transfers
        leave one node over the inter-node network at the same moment (they share its NIC, whose
        bandwidth is per node; see :mod:`.placement`). NVLink is per device and ignores it, and so
        does the cross-group link (docs/formats.md does not say it is per node).

        ``tp_a`` / ``tp_b``: the two stages' tp sizes. The hand-off is a scatter-gather
        (:mod:`hetero.runtime.pipeline`, as Megatron-LM's): the slices add up to one activation on
        the link, then the receiving stage all-gathers them on its intra-node link. Forward
        gathers among ``tp_b`` ranks, backward among ``tp_a``; one transfer time serves both
        directions, so the larger gather is charged."""
        key = ("p", group_a, group_b, mbs, same_node, streams, tp_a, tp_b)
        hit = self._cache.get(key)
        if hit is None:
            act = mbs * self.model.seq_length * self.model.hidden_size * self.e   # one activation
            nbytes = act
            fa, fb = self._factors[group_a].communication, self._factors[group_b].communication
            if group_a == group_b:
                g = self._groups[group_a]
                if same_node is None:
                    same_node = g.nodes == 1
                if same_node:
                    # NVLink-class links are per device: the slices travel on parallel device pairs,
                    # the busiest sender (forward: ceil(b / a) slices of 1/b) or receiver sets the time
                    link = g.intra_node
                    nbytes = act * max(-(-tp_b // tp_a) / tp_b, -(-tp_a // tp_b) / tp_a)
                else:
                    link = self.cluster.network.inter_node
                    nbytes *= max(1, streams)
                hit = comm.p2p(nbytes, link.bandwidth, link.latency) * fa
            else:
                link = self.cluster.network.cross_group
                hit = comm.p2p(nbytes, link.bandwidth, link.latency, self._staged(group_a, group_b)) * max(fa, fb)
            hit += max(self._gather_time(group_a, tp_a, act), self._gather_time(group_b, tp_b, act))
            if self.loopback:
                hit = max(hit, self.loopback["p2p_s"])
            self._cache[key] = hit
        return hit

    def _gather_time(self, group: str, tp: int, nbytes: float) -> float:
        """All-gather of one activation (``nbytes``) among a stage's ``tp`` ranks (one node; over k
        whole nodes: across the nodes' inter-node links, then inside each node)."""
        if tp <= 1:
            return 0.0
        g = self._groups[group]
        link = g.intra_node
        if tp <= g.devices_per_node:
            return comm.allgather(nbytes, tp, link.bandwidth, link.latency) * self._factors[group].communication
        per, k, net = g.devices_per_node, tp // g.devices_per_node, self.cluster.network.inter_node
        t = comm.allgather(nbytes, k, net.bandwidth, net.latency) + comm.allgather(nbytes, per, link.bandwidth,
                                                                                   link.latency)
        return t * self._factors[group].communication

    def _staged(self, a: str, b: str) -> bool:
        da, db = self._dev[a], self._dev[b]
        return da.vendor != db.vendor and da.family != "cpu" and db.family != "cpu"

    def grad_bytes(self, placement: str = "packed") -> int:
        """Bytes per gradient element as the DP sync sums it. hetero's runtime (``packed``) keeps fp32
        parameters under autocast, so it sums fp32 gradients whatever the model's dtype. Megatron-LM
        (``megatron``) sums fp16 gradients in fp16 (its default, what the vTrain runs calibrate) and
        bf16 ones in fp32 (it forces accumulate_allreduce_grads_in_fp32 for bf16)."""
        return self.e if placement == "megatron" and self.dtype == "fp16" else 4

    def layer_grad_bytes(self, placement: str = "packed") -> float:
        """Gradient bytes of one transformer layer (all tp shards together), as summed (:meth:`grad_bytes`)."""
        return float(self._params_per_layer * self.grad_bytes(placement))

    def dp_sync_time(self, plan, placement: str = "packed") -> float:
        """Data-parallel gradient synchronisation of ``plan`` (seconds; slowest device)."""
        return max(self.dp_sync_times(plan, placement).values(), default=0.0)

    def _struct(self, plan, placement: str) -> tuple:
        return (placement, plan.zero_stage, plan.schedule, plan.interleave,
                tuple((p.replicas, tuple((s.group, s.tp, s.layers[0], s.layers[1]) for s in p.stages))
                      for p in plan.pipelines))

    def _placed(self, plan, placement: str) -> tuple[dict, "_placement.SyncPlan", dict, list | None]:
        """(DP sync times, DP sync plan, p2p links, ZeRO degrees or None) of ``plan`` under
        ``placement``, from one placement of its blocks on nodes; memoised on the plan's structure
        (which holds everything the ZeRO degrees read: layers, tp, replicas, chunks)."""
        struct = self._struct(plan, placement)
        hit = self._dp_cache.get(struct)
        if hit is None:
            if len(self._dp_cache) > 100_000:
                self._dp_cache.clear()
            where = _placement.block_nodes(self._groups, plan, placement)
            hit = self._dp_cache[struct] = (*_placement.dp_sync(self, plan, placement, where),
                                            _placement.p2p_links(plan, where),
                                            mem.zero_degrees(self.model, plan) if plan.zero_stage else None)
        return hit

    def plan_structure(self, plan, placement: str = "packed") -> tuple:
        """(:meth:`dp_sync_plan`, :meth:`p2p_links`, ZeRO's per-stage sharding degrees
        (:func:`.memory.zero_degrees`) or None without ZeRO) of ``plan``, from one memoised look-up
        of its structure: what :func:`~hetero.predictor.predict` needs of it. A subclass's own
        :meth:`dp_sync_plan` or :meth:`p2p_links` (hand-set costs in tests) is asked instead."""
        cls = type(self)
        if cls.dp_sync_plan is StageCostModel.dp_sync_plan and cls.p2p_links is StageCostModel.p2p_links:
            hit = self._placed(plan, placement)
            return hit[1], hit[2], hit[3]
        return (self.dp_sync_plan(plan, placement), self.p2p_links(plan, placement),
                mem.zero_degrees(self.model, plan) if plan.zero_stage else None)

    def dp_sync_times(self, plan, placement: str = "packed") -> dict[tuple[int, int], float]:
        """Per (pipeline, physical stage): seconds that device spends syncing its gradients, with
        the ranks placed on nodes by ``placement`` (:mod:`.placement`: which rings cross the
        network and share a NIC); memoised on the plan's structure."""
        return self._placed(plan, placement)[0]

    def dp_sync_plan(self, plan, placement: str = "packed") -> "_placement.SyncPlan":
        """The gradient all-reduces of a step, in the order every rank runs them, and who holds
        each (memoised; see :class:`.placement.SyncPlan`)."""
        return self._placed(plan, placement)[1]

    def p2p_links(self, plan, placement: str = "packed") -> dict[tuple[int, int], tuple[bool, int]]:
        """Per (pipeline, virtual stage with a successor): (same_node, streams) of its p2p
        transfers under ``placement`` (memoised; see :func:`.placement.p2p_links`)."""
        return self._placed(plan, placement)[2]

__all__ = ["StageCostModel", "OPTIMIZER_BYTES_PER_PARAM", "GRAD_NORM_BYTES_PER_PARAM"]


def _with_calibrated_network(cluster: Cluster, calibration) -> Cluster:
    """``cluster`` with its inter-node network slowed by the calibration's ``network`` factor (the
    largest over the cluster's device types); links that are the network (e.g. a tensor-parallel
    group wider than a node) too."""
    if calibration is None:
        return cluster
    fitted = [f.network for g in cluster.groups
              if (f := calibration.factors_for(g.device, cluster.device_type(g.name))) is not None]
    factor = max(fitted) if fitted else 1.0   # a fitted factor below 1 (a faster network) counts too
    if factor == 1.0:
        return cluster
    import dataclasses

    from hetero.specs.cluster import Link

    old = cluster.network.inter_node
    new = Link(bandwidth=old.bandwidth / factor, latency=old.latency * factor)
    groups = tuple(dataclasses.replace(g, intra_node=new) if g.intra_node is old else g for g in cluster.groups)
    return dataclasses.replace(cluster, groups=groups, network=dataclasses.replace(cluster.network, inter_node=new))


_OP_MODELS: dict = {}


def _op_model_for(name: str, device, stamp) -> tuple[object, str]:
    """:func:`~hetero.predictor.optime.op_model_for`, remembered while the profile folder's stamp
    holds (profiles are written there by rename, which moves it): a calibration fit builds a cost
    model per trial of its factors, and each would otherwise look up every device's profile again."""
    if stamp is None:   # no profile machinery to ask whether profiles changed
        return op_model_for(name, device)
    return _by_identity(_OP_MODELS, 256, (device,), (stamp, name), lambda: op_model_for(name, device))


def _source_of(opm):
    """The cached model object behind ``opm`` (a CPU profile is wrapped anew on each lookup)."""
    return getattr(opm, "source_model", opm)


def _profiles_stamp() -> tuple | None:
    """(profile cache folder, its mtime): changes whenever a profile is written there; None when
    there is no profile machinery to ask."""
    try:
        from .profiles import cache_dir_str
    except ImportError:  # no profile machinery: op_model_for itself is the check
        return None
    d = cache_dir_str()
    try:
        return d, os.stat(d).st_mtime_ns
    except OSError:  # no folder yet; creating it (to write a profile) changes the stamp
        return d, None
