"""``hetero env``: accelerators, vendor libraries and distributed backends found on this machine."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="show accelerators, vendor libraries and backends found here",
                       description="Show torch, CUDA/NCCL, ROCm/RCCL, torch_npu/CANN/HCCL, MPI, Gloo and "
                       "DeepSpeed as found on this machine, and the backend hetero would select.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    from hetero.backends import env_report

    rows = env_report()
    from ._common import console, print_json

    if getattr(args, "json", False):
        print_json([r._asdict() for r in rows])
        return 0
    from rich.table import Table

    table = Table(title="hetero env")
    table.add_column("component")
    table.add_column("status")
    table.add_column("version / reason")
    for r in rows:
        style = "green" if r.status == "found" else "yellow"
        table.add_row(r.component, f"[{style}]{r.status}[/{style}]", r.detail)
    console().print(table)
    return 0
