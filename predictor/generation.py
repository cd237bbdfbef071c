"""Generation on one device: prefill, decode steps with a key/value cache, the cache's memory, and
the two transfers an RL step adds (the weight sync, the collocated context switch). Pure functions
of (cluster, group, model, sizes); no torch.

Decode (one new token for each of ``rows`` sequences holding ``kv_length`` cached positions) reads
every weight of the copy and every row's whole cache once, and does about 2 FLOPs per weight per
row: each kernel of :func:`decode_layer_ops` takes the longer of its bytes over the device's memory
bandwidth and its FLOPs over its matrix (or vector) peak, at the roofline's efficiencies
(:mod:`.optime`). Until the batch reaches about peak / bandwidth rows (some 260 rows of bf16 on an
H100) the weights' bytes set the pace and a step costs nearly the same for 1 row as for 64; beyond,
the GEMMs are compute-bound. The keys and values add ``2 x layers x kv_dim x bytes`` per row and
cached token, so a step grows linearly with both the batch and the context.

The host issues every kernel of a step (eager PyTorch, :mod:`hetero.rl.generate`): on an
accelerator the device runs behind the host, so a step takes the longer of the two
(:func:`~.optime.stream_time`'s reasoning); small models are dispatch-bound there. On a CPU the
kernels run on the host, one after another, and the step is their sum. The host's share on a CPU
is measured by ``hetero profile`` with the CPU profile (:func:`cpu_dispatch`;
:mod:`hetero.measure.decode_floor`), as the block probes are, so it follows the machine's speed of
the day; without such a profile the predictor takes :data:`CPU_DISPATCH`, measured once by
``benchmarks/bench_decode_floor.py`` (``benchmarks/results/decode_floor_cpu.json``). The per-row
figure (sampling and the stop check, Python) counts on every device. The accelerators' launch
figure :data:`KERNEL_LAUNCH_S` is the usual eager-mode cost of one CUDA launch from Python, to be
checked by ``benchmarks/gpu/decode_model_cuda.py`` where a GPU is lent.

Prefill is the model's forward over ``rows x prompt`` tokens: the operator model's times of the
forward kernels (:func:`~.ops.layer_forward_ops`) on an accelerator, as training's forward is
costed; the head runs on the last position only.

Tensor-parallel generation (``tp`` devices of one node hold one copy): weights, heads and cache are
split ``tp`` ways, and each layer adds two all-reduces of the rows' hidden states on the node's link.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import comm
from . import ops as O
from .optime import GEMM_EFFICIENCY, MEMORY_EFFICIENCY, kernel_cost, op_model_for, stream_split

CPU_DISPATCH = {
    "decode_per_step_s": 21e-6,
    "decode_per_layer_s": {"gpt": 153e-6, "llama": 279e-6},
    "per_row_s": 25e-6,
    "prefill_per_layer_s": {"gpt": 220e-6, "llama": 376e-6},
    "prefill_per_row_s": 59e-6,
}
"""Host seconds of :func:`hetero.rl.generate.generate` on this machine's CPU, one thread, for models
too small for their arithmetic to count (hidden 64): a decode step costs ``decode_per_step_s +
decode_per_layer_s[arch] x layers + per_row_s x rows`` (the rows' sampling and stop checks are Python
per row); the first call (prefill and the first token) ``prefill_per_layer_s[arch] x layers +
prefill_per_row_s x rows``. Least squares over 32 cases (gpt and llama, 1-8 layers, 1-16 rows),
largest residual 31% (decode); ``benchmarks/results/decode_floor_cpu.json``."""

KERNEL_LAUNCH_S = 8e-6
"""Host seconds to issue one kernel from eager PyTorch on an accelerator (Python, the dispatcher and
the launch): an assumption of the usual figure, which ``benchmarks/gpu/decode_model_cuda.py`` fits."""

EXTRA_KERNELS_PER_LAYER = 6
"""Kernels of a decode layer beyond its arithmetic (:func:`decode_layer_ops`): the cache's two
appends, the views and copies of the head split and merge: launches with next to no device work."""

def cpu_dispatch(device_name: str) -> dict:
    """Generation's host figures on this machine's CPU for the device type ``device_name``: those
    ``hetero profile`` measured with its profile (its own, else the plain ``cpu`` one), which follow
    the machine as its block probes do, else :data:`CPU_DISPATCH`."""
    try:
        from .profiles import local_op_model

        for name in dict.fromkeys((device_name, "cpu")):
            local = local_op_model(name)
            if local is not None and local.decode_dispatch:
                return local.decode_dispatch
    except Exception:  # noqa: BLE001 - no profile module or no profile: the shipped figures
        pass
    return CPU_DISPATCH


@dataclass(frozen=True)
class StepTime:
    """One decode step (or one prefill) of ``rows`` sequences on one copy of the model."""

    seconds: float
    host_s: float
    """The host's dispatch (and, on a CPU, its Python per layer and row)."""
    device_s: float
    """Device work: the kernels' bytes and FLOPs at the roofline's efficiencies."""
    comm_s: float = 0.0
    """Tensor-parallel all-reduces."""
    memory_s: float = 0.0
    """Of ``device_s``, the kernels bound by memory bandwidth (the rest are compute-bound)."""

    @property
    def bound(self) -> str:
        """``host`` (dispatch-bound), ``memory`` (bandwidth-bound) or ``compute``."""
        if self.host_s >= self.device_s + self.comm_s:
            return "host"
        return "memory" if self.memory_s >= self.device_s / 2 else "compute"


def decode_layer_ops(model, rows: int, kv_length: int, tp: int = 1) -> list:
    """The kernels of one transformer block for one new token of each of ``rows`` sequences with
    ``kv_length`` cached positions (the new one included), on one of ``tp`` ranks. Attention is
    costed per key/value head: its ``heads / kv_heads`` queries share one read of the cache."""
    e = O.DTYPE_BYTES[model.dtype]
    h, a = model.hidden_size, model.num_attention_heads
    kvh = model.num_kv_heads
    d = h // a
    f = model.ffn_hidden_size
    at, kt = max(1, a // tp), max(1, kvh // tp)
    q = at // kt
    ops = [O.vec("ln1", "ln", rows, h, e), O.gemm("qkv", "linear", rows, 1, (h + 2 * model.kv_dim) // tp, h, e)]
    if model.architecture == "llama":
        rh = (h + model.kv_dim) // tp
        ops += [O.vec("rope.mul_cos", "mul", rows, rh, e), O.vec("rope.mul_sin", "mul", rows, rh, e),
                O.vec("rope.add", "add", rows, rh, e)]
    ops += [O.gemm("scores", "bmm", rows * kt, q, kv_length, d, e),
            O.vec("softmax", "softmax", rows * at, kv_length, e),
            O.gemm("context", "bmm", rows * kt, q, d, kv_length, e),
            O.gemm("out_proj", "linear", rows, 1, h, h // tp, e),
            O.vec("residual1", "add", rows, h, e), O.vec("ln2", "ln", rows, h, e)]
    ft = f // tp
    if model.gated_mlp:
        ops += [O.gemm("mlp.gate", "linear", rows, 1, ft, h, e), O.gemm("mlp.up", "linear", rows, 1, ft, h, e),
                O.vec("mlp.silu", "gelu", rows, ft, e), O.vec("mlp.gate_mul", "mul", rows, ft, e),
                O.gemm("mlp.down", "linear", rows, 1, h, ft, e)]
    else:
        ops += [O.gemm("mlp.fc1", "linear", rows, 1, ft, h, e), O.vec("mlp.act", "gelu", rows, ft, e),
                O.gemm("mlp.fc2", "linear", rows, 1, h, ft, e)]
    ops.append(O.vec("residual2", "add", rows, h, e))
    return ops


def head_ops(model, rows: int, tp: int = 1) -> list:
    """Final norm and LM head on one position of each row (what generation computes)."""
    e = O.DTYPE_BYTES[model.dtype]
    return [O.vec("final_norm", "ln", rows, model.hidden_size, e),
            O.gemm("lm_head", "linear", rows, 1, -(-model.vocab_size // tp), model.hidden_size, e)]


def _roofline(ops, device, model_dtype: str) -> tuple[float, float]:
    """(seconds, of them memory-bound) of ``ops`` one after another, each at the longer of its bytes
    over the bandwidth and its FLOPs over its peak (no launch cost: the host's share is apart)."""
    total = memory = 0.0
    bw = device.effective_memory_bandwidth * MEMORY_EFFICIENCY
    for o in ops:
        dtype = o.dtype or model_dtype
        peak = (device.matrix_flops(dtype) if o.is_gemm else device.vector_flops(dtype)) * \
            (GEMM_EFFICIENCY if o.is_gemm else 1.0)
        tb, tf = o.nbytes / bw, o.flops / peak
        total += max(tb, tf)
        if tb >= tf:
            memory += tb
    return total, memory


def _layer_host(model, device, kernels: int, prefill: bool, floor: dict = CPU_DISPATCH) -> float:
    """Host seconds per layer: measured per architecture on a CPU (``floor``: :func:`cpu_dispatch`),
    launches on an accelerator."""
    if device.family == "cpu":
        table = floor["prefill_per_layer_s" if prefill else "decode_per_layer_s"]
        return table.get(model.architecture, max(table.values()))
    return (kernels + EXTRA_KERNELS_PER_LAYER) * KERNEL_LAUNCH_S


def _tp_comm(cluster, group: str, model, rows: int, tokens: int, tp: int) -> float:
    """Two all-reduces per layer of the rows' hidden states, on the node's link."""
    if tp <= 1:
        return 0.0
    link = cluster.group(group).intra_node
    nbytes = rows * tokens * model.hidden_size * O.DTYPE_BYTES[model.dtype]
    return 2 * model.num_layers * comm.allreduce(nbytes, tp, link.bandwidth, link.latency)


def decode_step(cluster, group: str, model, rows: int, kv_length: int, tp: int = 1) -> StepTime:
    """One decode step of ``rows`` sequences with ``kv_length`` cached positions on one copy of
    ``model`` held by ``tp`` devices of ``group`` (module docstring)."""
    device = cluster.device_type(group)
    layer = decode_layer_ops(model, rows, kv_length, tp)
    lt, lm = _roofline(layer, device, model.dtype)
    ht, hm = _roofline(head_ops(model, rows, tp), device, model.dtype)
    dev = model.num_layers * lt + ht
    mem = model.num_layers * lm + hm
    floor = cpu_dispatch(cluster.group(group).device) if device.family == "cpu" else CPU_DISPATCH
    host = (floor["decode_per_step_s"] + model.num_layers * _layer_host(model, device, len(layer), False, floor)
            + rows * floor["per_row_s"])
    cm = _tp_comm(cluster, group, model, rows, 1, tp)
    return _combine(device, host, dev, cm, mem)


def _combine(device, host: float, dev: float, cm: float, mem: float) -> StepTime:
    if device.family == "cpu":   # the host runs the kernels itself: their times add up
        host *= device.slowdown
        return StepTime(host + dev + cm, host, dev, cm, mem)
    return StepTime(max(host, dev + cm), host, dev, cm, mem)


def prefill(cluster, group: str, model, rows: int, prompt_tokens: int, tp: int = 1) -> StepTime:
    """The forward of ``rows`` prompts of ``prompt_tokens`` tokens (the cache filled, the head on the
    last position), and the first token's sampling. Accelerators: the operator model's forward
    kernels; a CPU: the measured host figures plus the kernels' roofline."""
    device = cluster.device_type(group)
    name = cluster.group(group).device
    fwd = O.layer_forward_ops(model, rows, prompt_tokens, tp)
    head = head_ops(model, rows, tp)
    if device.family == "cpu":
        lt, lm = _roofline(fwd, device, model.dtype)
        ht, hm = _roofline(head, device, model.dtype)
        dev, mem = model.num_layers * lt + ht, model.num_layers * lm + hm
    else:
        opm, _ = op_model_for(name, device)
        costs = [kernel_cost(opm, o, model.dtype, device) for o in fwd]
        _, dev_layer = stream_split(costs)
        hc = [kernel_cost(opm, o, model.dtype, device) for o in head]
        dev = model.num_layers * dev_layer + stream_split(hc)[1]
        mem = 0.0
    floor = cpu_dispatch(name) if device.family == "cpu" else CPU_DISPATCH
    host = (model.num_layers * _layer_host(model, device, len(fwd), True, floor)
            + rows * floor["prefill_per_row_s"])
    cm = _tp_comm(cluster, group, model, rows, prompt_tokens, tp)
    return _combine(device, host, dev, cm, mem)


# ---------------------------------------------------------------------------- memory
def copy_weight_bytes(model, tp: int = 1) -> float:
    """Bytes of one device's share of a whole copy in the model's dtype (what a decode step reads)."""
    n = model.num_layers * model.params_per_layer() + model.vocab_size * model.hidden_size * \
        (1 if model.tie_embeddings else 2)
    return n * O.DTYPE_BYTES[model.dtype] / tp


def kv_bytes_per_token(model, tp: int = 1) -> float:
    """Cache bytes of one token of one sequence on one of ``tp`` devices: keys and values of every layer."""
    return 2.0 * model.num_layers * model.kv_dim * O.DTYPE_BYTES[model.dtype] / tp


WORKSPACE_FRACTION = 0.10
"""Device memory kept out of the cache's reach: activations of a step, allocator slack, the framework."""


def sequences_fit(cluster, group: str, model, length: int, tp: int = 1, reserved_bytes: float = 0.0) -> int:
    """How many sequences of ``length`` tokens one copy on ``tp`` devices of ``group`` can cache at
    once: the memory left after the weights, ``reserved_bytes`` (a collocated actor's state) and
    :data:`WORKSPACE_FRACTION`, over one sequence's cache (0: the copy itself does not fit)."""
    cap = cluster.device_type(group).memory * (1 - WORKSPACE_FRACTION)
    free = cap - copy_weight_bytes(model, tp) - reserved_bytes
    per = kv_bytes_per_token(model, tp) * length
    return max(0, int(free // per)) if per > 0 else 0


@dataclass(frozen=True)
class GenerationTime:
    """Generating ``new_tokens`` for ``rows`` sequences on one copy: prefill, then decode steps."""

    seconds: float
    prefill_s: float
    decode_s: float
    waves: int
    """Batches the rows are split into because the cache holds fewer at once (1: all together)."""
    first_step: StepTime
    last_step: StepTime


def generation_time(cluster, group: str, model, rows: int, prompt_tokens: int, new_tokens: int,
                    tp: int = 1, reserved_bytes: float = 0.0) -> GenerationTime:
    """Seconds to generate ``new_tokens`` (at most: no early stop assumed) after prompts of
    ``prompt_tokens`` for ``rows`` sequences, as :func:`hetero.rl.generate.generate` does: one
    prefill, then ``new_tokens - 1`` decode steps, the context growing by one each; in waves when
    the cache cannot hold every row. Raises ValueError when not one sequence fits."""
    fit = sequences_fit(cluster, group, model, prompt_tokens + new_tokens, tp, reserved_bytes)
    if fit < 1:
        raise ValueError(f"group {group}: one copy of {model.name} on {tp} device(s) leaves no room for a "
                         f"sequence's cache")
    waves = -(-rows // fit)
    per_wave = -(-rows // waves)
    pre = prefill(cluster, group, model, per_wave, prompt_tokens, tp)
    steps = [decode_step(cluster, group, model, per_wave, prompt_tokens + k, tp) for k in (1, max(1, new_tokens - 1))]
    # time is linear in the context (the cache's bytes): the mean of the first and last step is exact
    decode = (new_tokens - 1) * (steps[0].seconds + steps[1].seconds) / 2
    return GenerationTime(waves * (pre.seconds + decode), waves * pre.seconds, waves * decode, waves, steps[0], steps[1])


# ---------------------------------------------------------------------------- transfers of an RL step
SYNC_BYTES_PER_PARAM = 4
"""The weight sync sends fp32 parameters (the actor's own values, checksummed; hetero.rl.sync)."""

SYNC_BUCKET_BYTES = 25e6
"""Bytes per bucket of the sync (each bucket pays the link's latency once)."""


def total_params(model) -> float:
    """Parameters of the whole model (embedding, blocks, head; a tied head counted once)."""
    return float(copy_weight_bytes(model) / O.DTYPE_BYTES[model.dtype])


CHECKSUM_BYTES_PER_S = 0.95e9
"""Bytes per second of the sync's checksum of a piece (a host copy and CRC32, one core), measured on
this machine's CPU (``bench_decode_floor.py --checksum-only``, the JSON's ``sync_checksum``; the
figures are in docs/rl.md). Every piece is checksummed where it is sent from and where it lands."""


WHOLE_COPY_PER_TENSOR_S = 19.8e-6
"""Host seconds per parameter tensor to build a temporary whole copy (a collocated rank builds one
for each step's rollout and frees it before training): measured on this CPU with the tiny GPT's 68
tensors (``bench_decode_floor.py --checksum-only``, the JSON's ``whole_copy``)."""


def parameter_tensors(model) -> int:
    """Parameter tensors of the runtime's whole model: per block 16 (gpt: weights and biases) or 9
    (llama), and the embeddings, final norm and head."""
    per, edges = (16, 4) if model.architecture == "gpt" else (9, 3)
    return model.num_layers * per + edges - (0 if model.architecture == "gpt" or not model.tie_embeddings else 1) \
        + (1 if model.architecture == "gpt" and not model.tie_embeddings else 0)


@dataclass(frozen=True)
class SyncTime:
    """One weight sync: the senders' share (checksums before the sends, on the actor's path), the
    transfer, and the receivers' share (checksums of every landed piece, on the rollout's path)."""

    send_s: float
    transfer_s: float
    receive_s: float

    @property
    def seconds(self) -> float:
        """The whole sync when nothing overlaps it."""
        return self.send_s + self.transfer_s + self.receive_s


def _checksum_s(cluster, groups, nbytes: float) -> float:
    """Checksumming ``nbytes`` on a device of the slowest of ``groups``: host copy (accelerators) + CRC32."""
    worst = 0.0
    for g in groups:
        dev = cluster.device_type(g)
        t = nbytes / CHECKSUM_BYTES_PER_S + (nbytes / comm.HOST_STAGING_BANDWIDTH if dev.family != "cpu" else 0.0)
        worst = max(worst, t)
    return worst


def weight_sync_time(cluster, model, holders: dict[str, int], receivers: dict[str, int], copies: int,
                     collocated: bool = False, own_fraction: float = 0.0) -> SyncTime:
    """One sync of the actor's weights (fp32) to ``copies`` whole copies after an update.

    ``holders``: actor devices per group (every one holds part of the weights: the sync spreads the
    sends over all that hold a piece, hetero.runtime.reshard.transition); ``receivers``: rollout
    devices per group. Disaggregated: the holders send ``copies`` whole models between them and each
    copy receives one, over the cross-group link (host-staged when vendors differ; a split of one
    node's devices: its own link), so the slower of the busiest holder and one receiver sets the
    transfer. Collocated: every actor device gathers what it does not hold (``1 - own_fraction`` of
    the model) into a temporary whole copy on the group's own links, and sends as much to the others.
    Checksums (:data:`CHECKSUM_BYTES_PER_S`): a holder's of every piece it sends, a receiver's of every
    piece that lands (collocated, its own pieces twice: as sent and as landed)."""
    nbytes = total_params(model) * SYNC_BYTES_PER_PARAM
    n = max(1, sum(holders.values()))
    if collocated:
        g = next(iter(holders))
        group = cluster.group(g)
        link = group.intra_node if group.nodes == 1 and len(holders) == 1 else cluster.network.inter_node
        if len(holders) > 1:
            link = cluster.network.cross_group
        staged = len({cluster.device_type(h).vendor for h in holders}) > 1 and \
            all(cluster.device_type(h).family != "cpu" for h in holders)
        own = nbytes * own_fraction
        moved = nbytes - own if n > 1 else 0.0
        transfer = comm.p2p(moved, link.bandwidth, link.latency * max(1.0, moved / SYNC_BUCKET_BYTES), staged) \
            if moved > 0 else 0.0
        build = parameter_tensors(model) * WHOLE_COPY_PER_TENSOR_S
        return SyncTime(_checksum_s(cluster, holders, moved), transfer,
                        build + _checksum_s(cluster, holders, nbytes + own))
    link = cluster.network.cross_group
    if set(receivers) == set(holders) and len(holders) == 1 and cluster.group(next(iter(holders))).nodes == 1:
        link = cluster.group(next(iter(holders))).intra_node   # a split of one node's devices
    staged = any(cluster.device_type(h).vendor != cluster.device_type(r).vendor
                 and cluster.device_type(h).family != "cpu" and cluster.device_type(r).family != "cpu"
                 for h in holders for r in receivers)
    out = nbytes * copies / n
    busiest = max(out, nbytes)
    buckets = max(1.0, busiest / SYNC_BUCKET_BYTES)
    return SyncTime(_checksum_s(cluster, holders, out),
                    comm.p2p(busiest, link.bandwidth, link.latency * buckets, staged),
                    _checksum_s(cluster, receivers, nbytes))


OPTIMIZER_STATE_BYTES_PER_PARAM = 16
"""AdamW's fp32 moments and the fp32 gradient, which a collocated accelerator moves to host memory
while it generates (RLinf's context switch) when rollout would not fit beside them."""


def context_switch_time(cluster, group: str, model, params_on_device: float, needed_bytes: float) -> float:
    """A collocated device's switch between training and generation and back: 0 on a CPU or when the
    rollout's copy and cache (``needed_bytes``) fit beside the actor's state; else the optimizer
    state and gradients of its ``params_on_device`` parameters go to host memory and come back
    (each way over the host link, :data:`.comm.HOST_STAGING_BANDWIDTH`)."""
    device = cluster.device_type(group)
    if device.family == "cpu":
        return 0.0
    state = params_on_device * OPTIMIZER_STATE_BYTES_PER_PARAM
    held = params_on_device * 4 + state
    if held + needed_bytes <= device.memory * (1 - WORKSPACE_FRACTION):
        return 0.0
    return 2.0 * state / comm.HOST_STAGING_BANDWIDTH


__all__ = ["CPU_DISPATCH", "cpu_dispatch", "KERNEL_LAUNCH_S", "StepTime", "GenerationTime", "decode_layer_ops", "head_ops",
           "decode_step", "prefill", "generation_time", "copy_weight_bytes", "kv_bytes_per_token", "sequences_fit",
           "weight_sync_time", "SyncTime", "context_switch_time", "total_params"]
