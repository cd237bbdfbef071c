"""``hetero devices``: the device catalog as a table (or JSON)."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("devices", help="show the device catalog", description="Show the built-in device catalog "
                       "(and the devices a cluster file adds with --cluster).")
    p.add_argument("--cluster", help="also show the device types this cluster file defines")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.table import Table

    from hetero.specs.device import load_catalog
    from hetero.specs.units import format_quantity as fq

    from ._common import console, print_json

    devices = dict(load_catalog())
    if args.cluster:
        from hetero.specs.cluster import load_cluster

        cluster = load_cluster(args.cluster)
        for g in cluster.groups:
            devices[g.device] = cluster.device_types[g.name]
    if args.json:
        from dataclasses import asdict

        print_json({name: asdict(d) for name, d in devices.items()})
        return 0
    table = Table(title=f"Device catalog ({len(devices)} types)")
    for col in ("device", "vendor", "memory", "mem bw", "bf16/fp16", "fp32", "units", "L2", "link", "TDP", "$/h"):
        table.add_column(col, justify="left" if col in ("device", "vendor") else "right")
    for name, d in sorted(devices.items(), key=lambda kv: (kv[1].vendor, kv[0])):
        half = d.peak_flops.get("bf16") or d.peak_flops.get("fp16")
        table.add_row(
            name + (f" (x{d.slowdown:g} slower)" if d.slowdown != 1 else ""), d.vendor,
            fq(d.memory, "bytes"), fq(d.memory_bandwidth, "bandwidth"),
            fq(half, "flops") if half else "-", fq(d.peak_flops.get("fp32", 0), "flops") if "fp32" in d.peak_flops else "-",
            str(d.compute_units or "-"), fq(d.l2_cache, "bytes") if d.l2_cache else "-",
            fq(d.link_bandwidth, "bandwidth") if d.link_bandwidth else "-",
            fq(d.tdp, "power") if d.tdp else "-", f"{d.price_per_hour:.2f}" if d.price_per_hour else "-")
    console().print(table)
    return 0
