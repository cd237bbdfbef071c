"""Builders for the dicts a test hands to ``hetero.load_cluster`` / ``load_model`` / ``load_plan`` (or
writes to YAML for ``hetero launch``): clusters, groups, links, emulated device types, tiny models
and plans. Each returns a fresh plain dict, equal to the one a test would write out by hand, so a
test can still mutate or ``{**spread}`` it; keyword overrides change one field and keep the rest.
The ``_dict`` suffix keeps the builders apart from the names tests give to loaded specs
(``cluster = hetero.load_cluster(cluster_dict(...))``).

The suite's shared defaults are built here too: :data:`CLUSTER` (two emulated vendors, two CPU
devices each), :data:`GPT` and :data:`LLAMA` (4-layer models that train in a second). Treat them as
read-only; build a fresh one with the builder to change it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["emulated_device", "link_dict", "network_dict", "group_dict", "cluster_dict", "local_cluster", "tiny_model",
           "stage_dict", "plan_dict", "CLUSTER", "GPT", "LLAMA"]


# ---------------------------------------------------------------------------- clusters


def emulated_device(vendor: str, slowdown: float | None = None, **fields: Any) -> dict:
    """A CPU device type with a vendor tag of its own (``{base: cpu, vendor: emu-b, slowdown: 2.0}``):
    each tag is its own process group, so a CPU-only machine runs a mixed-vendor cluster. ``fields``:
    any other device field (``memory="1 MiB"``)."""
    device = {"base": "cpu", "vendor": vendor}
    if slowdown is not None:
        device["slowdown"] = slowdown
    return {**device, **fields}


def link_dict(bandwidth: str, latency: str | float | None = None) -> dict:
    """A link of a group (``intra_node``) or of the network (``inter_node``, ``cross_group``)."""
    return {"bandwidth": bandwidth} if latency is None else {"bandwidth": bandwidth, "latency": latency}


def network_dict(inter_node: dict | None = None, cross_group: dict | None = None) -> dict:
    """A cluster's ``network`` section from :func:`link_dict` dicts; a link left out is not written (its
    default applies)."""
    out = {}
    if inter_node is not None:
        out["inter_node"] = inter_node
    if cross_group is not None:
        out["cross_group"] = cross_group
    return out


def group_dict(name: str, device: str, nodes: int = 1, devices_per_node: int = 1, **fields: Any) -> dict:
    """One group of a cluster: ``nodes`` machines of ``devices_per_node`` devices of type ``device``.
    ``fields``: ``intra_node=link_dict(...)``, ``hosts=[...]`` or any other group field."""
    return {"name": name, "device": device, "nodes": nodes, "devices_per_node": devices_per_node, **fields}


def cluster_dict(*groups: dict, name: str = "test", devices: dict | None = None,
                 network: dict | None = None) -> dict:
    """A cluster of :func:`group_dict` dicts; ``devices`` (device types of its own, by name) and ``network``
    are written only when given, as a hand-written file would."""
    out: dict = {"name": name}
    if devices is not None:
        out["devices"] = devices
    out["groups"] = list(groups)
    if network is not None:
        out["network"] = network
    return out


def local_cluster(devices: int | Sequence[int] = 2, *, vendors: Sequence[str] = ("emu-a", "emu-b"),
                  slowdown: float | None | Sequence[float | None] = 2.0, groups: Sequence[str] = ("fast", "slow"),
                  hosts: Sequence[list[str]] | None = None, name: str = "local-cpu-test") -> dict:
    """The emulated mixed cluster on this machine: one CPU device type ``cpu-<vendor>`` and one
    one-node group per vendor tag.

    ``devices``: devices per group (one count for every group, or one per vendor; 0 leaves that
    group out while its device type stays defined). ``slowdown``: one value for every vendor after
    the first (the first computes at full speed), or one per vendor; None writes no slowdown.
    ``groups``: the group names, one per vendor. ``hosts``: each group's host list, when given.
    ``local_cluster()`` is :data:`CLUSTER`: ``fast`` (emu-a) and ``slow`` (emu-b, 2x slower), two
    devices each."""
    n = len(vendors)
    counts = [devices] * n if isinstance(devices, int) else list(devices)
    slowdowns = [None] + [slowdown] * (n - 1) if slowdown is None or isinstance(slowdown, (int, float)) \
        else list(slowdown)
    if not len(counts) == len(slowdowns) == len(groups) == n or (hosts is not None and len(hosts) != n):
        raise ValueError(f"local_cluster: {n} vendors need as many device counts, slowdowns, group names "
                         f"and host lists (got {counts}, {slowdowns}, {list(groups)}, {hosts})")
    types = {f"cpu-{v}": emulated_device(v, s) for v, s in zip(vendors, slowdowns)}
    members = [group_dict(g, f"cpu-{v}", 1, k, **({} if hosts is None else {"hosts": hosts[i]}))
               for i, (g, v, k) in enumerate(zip(groups, vendors, counts)) if k]
    return cluster_dict(*members, name=name, devices=types)


# ---------------------------------------------------------------------------- models and plans

_TINY = {
    "gpt": {"name": "tiny", "architecture": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
            "vocab_size": 512, "seq_length": 32, "dtype": "fp32", "tie_embeddings": True},
    "llama": {"name": "tiny-llama", "architecture": "llama", "num_layers": 4, "hidden_size": 64,
              "num_attention_heads": 4, "num_kv_heads": 2, "vocab_size": 512, "seq_length": 32, "dtype": "fp32"},
}


def tiny_model(architecture: str = "gpt", **over: Any) -> dict:
    """A 4-layer model of width 64 (``gpt``: tied embeddings; ``llama``: grouped-query attention with
    2 KV heads), fp32: a launch on CPU trains it in about a second. ``over`` replaces fields
    (``num_layers=12``, ``dtype="bf16"``)."""
    if architecture not in _TINY:
        raise ValueError(f"tiny_model: architecture {architecture!r}: expected one of {sorted(_TINY)}")
    return {**_TINY[architecture], **over}


def stage_dict(group: str, first: int, end: int, tp: int | None = None, **fields: Any) -> dict:
    """One stage of a pipeline: layers ``[first, end)`` on ``group``, ``tp`` written only when given."""
    out: dict = {"group": group}
    if tp is not None:
        out["tp"] = tp
    return {**out, "layers": [first, end], **fields}


def plan_dict(pipelines: list[dict] | None = None, gbs: int = 8, mbs: int = 2, *, stages: list[dict] | None = None,
              replicas: int | None = None, micro_batches: int | None = None, **fields: Any) -> dict:
    """A plan of ``pipelines`` (dicts as a plan file writes them), or of one pipeline given as
    ``stages`` (:func:`stage_dict` dicts) with its ``replicas`` and ``micro_batches``. ``fields``: any other
    plan field (``zero_stage=1``, ``schedule="1f1b"``)."""
    if (pipelines is None) == (stages is None) or (pipelines is not None and (replicas, micro_batches) != (None, None)):
        raise ValueError("plan_dict: give either pipelines, or stages with their replicas and micro_batches")
    if stages is not None:
        one: dict = {} if replicas is None else {"replicas": replicas}
        if micro_batches is not None:
            one["micro_batches"] = micro_batches
        pipelines = [{**one, "stages": list(stages)}]
    return {"global_batch_size": gbs, "micro_batch_size": mbs, "pipelines": pipelines, **fields}


CLUSTER = local_cluster()
GPT = tiny_model()
LLAMA = tiny_model("llama")
