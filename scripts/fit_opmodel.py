#!/usr/bin/env python
"""Regenerate predictor/data/opmodel.json from the NeuSight profile data.

Data: $HETERO_SHARED_DATA or <repo>/../shared/data (neusight/ops/*.csv, neusight/devices/*.json).
Usage: python scripts/fit_opmodel.py [--exclude DEVICE ...] [--out PATH] [--max-rows-per-group N] [--design D]
The shipped files: opmodel.json (all five GPUs) and, with
  --exclude "Tesla V100-PCIE-32GB" --out predictor/data/opmodel_no_v100.json, the variant without V100.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    from hetero.predictor.opmodel import OpModel, load_neusight, shared_data_dir
    from hetero.predictor.opmodel.lodo import select_design, stratified_sample
    from hetero.predictor.opmodel.model import DEFAULT_DESIGN, DESIGNS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="shared data folder (default: $HETERO_SHARED_DATA or ../shared/data)")
    ap.add_argument("--out", default=str(REPO / "predictor" / "data" / "opmodel.json"))
    ap.add_argument("--exclude", action="append", default=[], help="device name to leave out (repeatable)")
    ap.add_argument("--max-rows-per-group", type=int, default=4000,
                    help="at most this many rows per (op, device), fixed seed (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--design", choices=("auto",) + DESIGNS, default="auto",
                    help="model design; auto (default): the candidate with the lowest mean leave-one-device-out "
                         "MAPE over the training devices (the rule benchmarks/bench_opmodel.py applies nested)")
    args = ap.parse_args(argv)

    data = Path(args.data) if args.data else shared_data_dir(REPO)
    t0 = time.time()
    rec, devices = load_neusight(data)
    if args.max_rows_per_group:
        rec = rec.subset(stratified_sample(rec, args.max_rows_per_group, args.seed))
    selection = None
    design = args.design
    if design == "auto":
        train = rec.subset(~np.isin(rec.device, args.exclude))
        selection = select_design(train, devices, DESIGNS)
        design = selection["chosen"]
        print("design selection (mean LODO MAPE over the training devices): "
              + ", ".join(f"{c} {m:.4f}" for c, m in selection["inner_mean_mape"].items()) + f" -> {design}")
    model = OpModel().fit(rec, devices, exclude_devices=args.exclude, seed=args.seed, design=design)
    model.meta["source"] = ("NeuSight artifact ops/*.csv (PyTorch 2.1, fp32), device specs from configs/devices.yaml; "
                            "fitted by scripts/fit_opmodel.py")
    model.meta["max_rows_per_group"] = args.max_rows_per_group
    if selection:
        model.meta["design_selection"] = {"rule": "lowest mean leave-one-device-out overall MAPE over the "
                                                  "training devices (400 rows per (op, device), 80 rounds)",
                                          "inner_mean_mape": selection["inner_mean_mape"]}
    model.save(args.out)
    size = os.path.getsize(args.out)
    print(f"fitted on {model.meta['trained_devices']} ({model.meta['rows']} rows) in {time.time() - t0:.1f}s;"
          f" wrote {args.out} ({size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
