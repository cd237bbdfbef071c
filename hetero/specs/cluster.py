"""Cluster files: groups of identical nodes, their links, and the device types they hold."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from hetero.errors import HeteroError

from .device import DeviceType, catalog_raw, load_catalog, resolve_devices
from .errors import Problem, Problems, did_you_mean, join_path
from .io import read_mapping, write_yaml_atomic
from .schema import is_missing, load_dataclass, quantity, to_plain

LOOPBACK = ("127.0.0.1", "::1", "localhost")
"""Host names and addresses that always mean this machine's loopback interface."""


def is_loopback(addr: str | None) -> bool:
    """Whether ``addr`` names this machine's loopback interface: ``localhost`` or any address of
    127.0.0.0/8 or ::1 (127.0.0.2 is this machine too)."""
    import ipaddress

    if addr is None:
        return False
    if addr in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth per direction and a fixed per-message latency."""

    bandwidth: float = quantity("bandwidth")
    """Bytes/s in one direction."""
    latency: float = quantity("time", 10e-6)
    """Seconds per message (default 10 us)."""

    def _check(self, path: str, problems: Problems) -> None:
        # bounds that also catch a unit left out: `bandwidth: 300` is 300 B/s, `latency: 5` five seconds
        if self.bandwidth <= 0:
            problems.add(join_path(path, "bandwidth"), "must be positive", "e.g. '100 GB/s'")
        elif self.bandwidth < 1e6:
            problems.add(join_path(path, "bandwidth"), f"must be at least 1 MB/s, got {self.bandwidth:g} bytes/s",
                         "give the bandwidth with its unit, e.g. '100 GB/s'")
        if self.latency > 1.0:
            problems.add(join_path(path, "latency"), f"must be at most 1 s per message, got {self.latency:g} s",
                         "give the latency with its unit, e.g. '5 us'")

    def transfer_time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Network:
    """Links between nodes: inside one group, and between groups (host-staged across vendors)."""

    inter_node: Link = field(default_factory=lambda: Link(bandwidth=25e9, latency=10e-6))
    """Per node, between nodes of one group (default 25 GB/s: one 200 Gb/s NIC)."""
    cross_group: Link = field(default_factory=lambda: Link(bandwidth=12.5e9, latency=20e-6))
    """Between groups; across vendors traffic is staged through host memory (default 12.5 GB/s)."""


@dataclass(frozen=True)
class Group:
    """Nodes that all hold the same device type."""

    name: str
    device: str
    """A catalog key or a key under the cluster's ``devices:``."""
    nodes: int
    devices_per_node: int
    intra_node: Link = field(default_factory=lambda: Link(bandwidth=32e9, latency=5e-6))
    """Device-to-device inside a node, one direction (default: PCIe 4.0 x16, 32 GB/s)."""
    hosts: list[str] | None = None
    """Host names, one per node; ``hosts`` is needed by ``launch`` for multi-node runs."""

    def _check(self, path: str, problems: Problems) -> None:
        if self.nodes < 1:
            problems.add(join_path(path, "nodes"), f"must be >= 1, got {self.nodes}", "give the number of nodes")
        if self.devices_per_node < 1:
            problems.add(join_path(path, "devices_per_node"), f"must be >= 1, got {self.devices_per_node}",
                         "give the number of devices in each node")
        if self.hosts is not None and len(self.hosts) != self.nodes:
            problems.add(join_path(path, "hosts"), f"lists {len(self.hosts)} hosts for {self.nodes} nodes",
                         "give one host per node, or drop 'hosts'")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class _ClusterFile:
    _file_kind = "cluster"   # a class attribute, not a field: names model / plan fields given here
    name: str
    groups: list[Group]
    devices: dict[str, dict] = field(default_factory=dict)
    network: Network = field(default_factory=Network)


@dataclass(frozen=True)
class Cluster:
    """A validated cluster: groups, links and the resolved device type of every group."""

    name: str
    groups: tuple[Group, ...]
    network: Network
    devices: dict[str, dict]
    """The file's own ``devices:`` entries as written (kept for saving back)."""
    device_types: dict[str, DeviceType] = field(repr=False, default_factory=dict)
    """Device type of every group, by group name."""
    source: str = "<dict>"

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def device_type(self, group: str) -> DeviceType:
        return self.device_types[group]

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    @property
    def num_devices(self) -> int:
        return sum(g.num_devices for g in self.groups)

    def vendor(self, group: str) -> str:
        return self.device_types[group].vendor

    def link_between(self, group_a: str, group_b: str, same_node: bool = False) -> Link:
        """The link class a message between two devices of these groups crosses."""
        if group_a != group_b:
            return self.network.cross_group
        return self.group(group_a).intra_node if same_node else self.network.inter_node

    def to_dict(self) -> dict:
        out = {"name": self.name}
        if self.devices:
            out["devices"] = self.devices
        out["groups"] = [to_plain(g) for g in self.groups]
        out["network"] = to_plain(self.network)
        return out

    def save(self, path) -> None:
        write_yaml_atomic(path, self.to_dict())


def model_problems(cluster: Cluster, model, groups=None) -> list[Problem]:
    """Problems of training ``model`` on ``cluster`` that neither file shows alone, each named in
    the cluster file: a device type with no matrix peak for the model's dtype (an fp32 model on a
    device that lists only bf16), or else no elementwise peak for it. ``groups``: the group names
    to look at (default: all)."""
    out: list[Problem] = []
    seen: set[str] = set()
    for i, g in enumerate(cluster.groups):
        if (groups is not None and g.name not in groups) or g.device in seen or g.name not in cluster.device_types:
            continue
        seen.add(g.device)
        device = cluster.device_type(g.name)
        # one problem a device type, the matrix one first: its usual fix (an fp32 entry in
        # peak_flops) mends the elementwise one too, and what remains is told on the next run
        bad, table = device.peak_problem(model.dtype), "peak_flops"
        if bad is None:
            bad, table = device.vector_problem(model.dtype), "peak_flops_vector"
        if bad:
            message, fix = bad
            path = (join_path(join_path("devices", g.device), table) if g.device in cluster.devices
                    else join_path(join_path("groups", i), "device"))
            out.append(Problem(path, f"device type '{g.device}' (group '{g.name}'), model '{model.name}': {message}",
                               fix, cluster.source))
    return out


def load_cluster(path_or_dict, source: str | None = None) -> Cluster:
    """Load and validate a cluster file (a path or a dict); raises SpecError with every problem."""
    data, source = read_mapping(path_or_dict, "cluster", source)
    problems = Problems(source=source)
    parsed = load_dataclass(_ClusterFile, data, "", problems)
    if is_missing(parsed):
        problems.raise_if_any()
    known_raw = catalog_raw()
    catalog = load_catalog()
    local = resolve_devices(parsed.devices, known_raw, "devices", problems)
    device_types: dict[str, DeviceType] = {}
    seen: set[str] = set()
    if not parsed.groups:
        problems.add("groups", "a cluster needs at least one group", "add a group under 'groups:'")
    for i, g in enumerate(parsed.groups):
        path = join_path("groups", i)
        if g.name in seen:
            problems.add(join_path(path, "name"), f"duplicate group name '{g.name}'", "give every group its own name")
        seen.add(g.name)
        if g.device in local:
            device_types[g.name] = local[g.device]
        elif g.device in parsed.devices:
            pass  # already reported while resolving the device entry
        elif g.device in catalog:
            device_types[g.name] = catalog[g.device]
        else:
            problems.add(join_path(path, "device"), f"unknown device type '{g.device}'",
                         f"{did_you_mean(g.device, list(catalog) + list(parsed.devices))} "
                         f"(or define it under 'devices:')")
    problems.raise_if_any()
    return Cluster(name=parsed.name, groups=tuple(parsed.groups), network=parsed.network,
                   devices=dict(parsed.devices), device_types=device_types, source=source)


def without_devices(cluster: Cluster, lost: list) -> Cluster:
    """``cluster`` less the devices of the ``lost`` ranks (:class:`hetero.layout.RankInfo`). A group of
    one node loses them from ``devices_per_node``; in a group of several nodes, a node that lost some
    becomes a group of its own (``<group>-n<node>``) with the devices it has left. Groups left with no
    device are dropped."""
    count: dict[tuple[str, int], int] = {}
    for info in lost:
        count[(info.group, info.node)] = count.get((info.group, info.node), 0) + 1
    d = copy.deepcopy(cluster.to_dict())
    groups = []
    for g in d["groups"]:
        touched = {n: c for (name, n), c in count.items() if name == g["name"]}
        if not touched:
            groups.append(g)
            continue
        hosts = g.get("hosts")
        whole = [n for n in range(g["nodes"]) if n not in touched]
        if whole:
            groups.append({**g, "nodes": len(whole), **({"hosts": [hosts[n] for n in whole]} if hosts else {})})
        for n, c in sorted(touched.items()):
            left = g["devices_per_node"] - c
            if left <= 0:
                continue
            name = g["name"] if g["nodes"] == 1 else f"{g['name']}-n{n}"
            groups.append({**g, "name": name, "nodes": 1, "devices_per_node": left,
                           **({"hosts": [hosts[n]]} if hosts else {})})
    if not groups:
        raise HeteroError("elastic: no device is left to train on")
    d["groups"] = groups
    return load_cluster(d, source=f"{cluster.name} less {len(lost)} device(s)")
