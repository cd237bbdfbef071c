"""An elastic run's reconfigurations, as the launcher prints them."""
from __future__ import annotations


def reconfiguration_table(reconfigurations: list[dict]):
    """A rich table of an elastic run's reconfigurations (the summary's entries): when, why, the
    world sizes, and the downtime split."""
    from rich.table import Table

    table = Table(title="reconfigurations")
    for name in ("before step", "reason", "ranks", "devices +/-", "handoff s", "replan s", "restart / reshard s",
                 "event -> first step s", "transfer s (predicted)", "MB moved", "new plan predicted tok/s"):
        table.add_column(name, justify="left" if name == "reason" else "right", overflow="fold")

    for rc in reconfigurations:
        table.add_row(str(rc["step"]), rc["reason"], _ranks_cell(rc),
                      f"+{rc.get('devices_added', 0)} / -{rc.get('devices_removed', 0)}", seconds_cell(rc.get("handoff_time_s")),
                      seconds_cell(rc.get("replan_time_s")), _restart_cell(rc), seconds_cell(rc.get("reshard_time_s")),
                      # in-process reshards: the measured transfer beside the predictor's
                      f"{seconds_cell(rc.get('transfer_s'))} ({seconds_cell(rc.get('predicted_downtime_s'))})",
                      "-" if rc.get("bytes_moved") is None else f"{rc['bytes_moved'] / 1e6:,.1f}",
                      f"{rc['predicted_tokens_per_s']:,.0f}")
    return table


def replanned(devices_left: int, ranks: int, seconds: str) -> str:
    """The launcher's 'replanned' line up to the plan: the devices the replanner had and the ranks
    its plan uses, which can be fewer (the reconfiguration table's row reads 'ranks 4 -> 2 (of 3
    devices left)'), so the two never seem to disagree."""
    used = f"all {ranks}" if ranks == devices_left else f"{ranks} of them"
    return f"elastic: replanned for the {devices_left} device(s) left in {seconds}: a plan on {used}"


def _ranks_cell(rc: dict) -> str:
    """The world sizes, and the devices the replanner had when its plan uses fewer of them (the
    launcher's line says 'replanned for the 3 device(s) left ...: a plan on 2')."""
    cell = f"{rc['world_size_before']} -> {rc['world_size_after']}"
    left = rc.get("devices_left")
    return cell if left is None or left == rc["world_size_after"] else f"{cell} (of {left} devices left)"


def _restart_cell(rc: dict) -> str:
    """The decision to every rank ready for its first step (``restart_time_s``), saying how: the
    survivors resharded in place (an in-process reconfiguration keeps their processes) or the
    workers restarted from a checkpoint."""
    v = rc.get("restart_time_s")
    if v is None:
        return seconds_cell(v)
    return f"{seconds_cell(v)} ({'reshard' if rc.get('path') == 'in-process' else 'restart'})"


def seconds_cell(v: float | None) -> str:
    """A duration for the reconfiguration table and messages: two decimals, '-' where there is none."""
    return "-" if v is None else f"{v:.2f}"
