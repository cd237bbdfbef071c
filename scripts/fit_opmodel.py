#!/usr/bin/env python
"""Regenerate predictor/data/opmodel.json from the NeuSight profile data.

Data: $HETERO_SHARED_DATA or <repo>/../shared/data (neusight/ops/*.csv, neusight/devices/*.json).
Usage: python scripts/fit_opmodel.py [--exclude DEVICE ...] [--out PATH] [--max-rows-per-group N]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    from hetero.predictor.opmodel import OpModel, load_neusight, shared_data_dir
    from hetero.predictor.opmodel.lodo import stratified_sample

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="shared data folder (default: $HETERO_SHARED_DATA or ../shared/data)")
    ap.add_argument("--out", default=str(REPO / "predictor" / "data" / "opmodel.json"))
    ap.add_argument("--exclude", action="append", default=[], help="device name to leave out (repeatable)")
    ap.add_argument("--max-rows-per-group", type=int, default=4000,
                    help="at most this many rows per (op, device), fixed seed (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    data = Path(args.data) if args.data else shared_data_dir(REPO)
    t0 = time.time()
    rec, devices = load_neusight(data)
    if args.max_rows_per_group:
        rec = rec.subset(stratified_sample(rec, args.max_rows_per_group, args.seed))
    model = OpModel().fit(rec, devices, exclude_devices=args.exclude, seed=args.seed)
    model.meta["source"] = "NeuSight artifact ops/*.csv (PyTorch 2.1, fp32), fitted by scripts/fit_opmodel.py"
    model.meta["max_rows_per_group"] = args.max_rows_per_group
    model.save(args.out)
    size = os.path.getsize(args.out)
    print(f"fitted on {model.meta['trained_devices']} ({model.meta['rows']} rows) in {time.time() - t0:.1f}s;"
          f" wrote {args.out} ({size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
