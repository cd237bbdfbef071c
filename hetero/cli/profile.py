"""``hetero profile``: operator micro-benchmarks on this machine's device, written as profile records.

The records go to the per-device cache (``$HETERO_CACHE_DIR/profiles/<device>.csv``, read by the
predictor for cpu-family devices) and, with ``-o``, to a file of your choice. A ``--quick`` run (a
smoke test on a small grid) never writes the cache: its records would replace the full profile the
predictor reads; they go to ``-o`` (or stdout) only. On a CPU the profile
also times the runtime's transformer block and AdamW step at a few shapes (block probes, in the
``<device>.meta.json`` sidecar with the thread count and load average), and runs with 1 thread
unless ``--threads`` says otherwise: ``hetero launch`` workers run 1 thread each by default.
"""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure operator latencies on this machine",
        description="Time the operators of a transformer layer (linear, bmm, ln, softmax, gelu, add, mul, "
                    "div, pow, tanh, relu) over a grid of shapes on this machine's device and write profile "
                    "records (docs/formats.md). The result is cached per device and used by the predictor.")
    p.add_argument("--device", metavar="NAME",
                   help="device type written in the records: a catalog name (`hetero devices`) or, with "
                        "--cluster, one of that cluster's own types (default: the local accelerator's catalog "
                        "name, or 'cpu'); a cpu-family type profiles the CPU")
    p.add_argument("--cluster", metavar="FILE", help="cluster file whose own device types (under 'devices:') "
                                                     "--device may name")
    p.add_argument("-o", "--output", metavar="FILE", help="also write the records to FILE (CSV)")
    p.add_argument("--quick", action="store_true",
                   help="a small grid in a few seconds (smoke tests): the records go to -o (or stdout) only, "
                        "the per-device cache the predictor reads is left as it is")
    p.add_argument("--dtype", default=None, metavar="LIST",
                   help="comma-separated dtypes (default: fp32 on CPU, fp32,fp16 on accelerators)")
    p.add_argument("--no-cache", action="store_true", help="do not update the per-device cache")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on CPU, like each `hetero launch` worker; "
                        "torch's default on accelerators)")
    p.add_argument("--no-blocks", action="store_true",
                   help="skip the block probes (the runtime's transformer block, AdamW step and mixture-of-experts layer; CPU only)")
    p.set_defaults(func=run,  # the files read and written: check_outputs_apart
                   inputs={"--cluster": "cluster"}, outputs={"-o": "output", "-o (its .meta.json)": _meta})


def _meta(args) -> str | None:
    """The sidecar ``-o FILE`` writes beside the records (the thread count, the block probes)."""
    from hetero.predictor.profiles import meta_path

    return meta_path(args.output) if args.output else None


def run(args) -> int:
    from hetero.errors import HeteroError
    from hetero.predictor import profiles as P
    from hetero.measure import decode_floor as DF
    from hetero.measure import profiling as M

    from ._common import check_output, console, write_output

    if args.threads is not None and args.threads < 1:
        raise HeteroError(f"--threads: must be >= 1, got {args.threads}")
    requested = requested_type(args)
    if args.output is not None:  # before minutes of measuring, not after ("" too: an error)
        check_output(args.output, "-o")
        check_output(P.meta_path(args.output), "-o (its .meta.json)")
    try:   # after the checks that need no torch: a misspelt name is said before torch loads
        import torch
    except ImportError:
        raise HeteroError("hetero profile needs PyTorch: pip install torch") from None
    try:
        name, torch_device = ((args.device, "cpu") if requested is not None and requested.family == "cpu"
                              else M.detect_device(args.device))
    except RuntimeError as e:
        raise HeteroError(str(e)) from None
    if requested is not None and requested.family != "cpu" and torch_device == "cpu":
        raise HeteroError(f"--device {args.device}: a {requested.family} device type and no accelerator was found "
                          f"here (fix: profile it on a machine that has one)")
    threads = args.threads or (1 if torch_device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    import os
    import time

    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    dtypes = [d.strip() for d in (args.dtype or ("fp32" if torch_device == "cpu" else "fp32,fp16")).split(",") if d.strip()]
    if not dtypes:   # `--dtype ,`: nothing to measure, and an empty profile would replace the cached one
        raise HeteroError(f"--dtype {args.dtype!r} names no dtype (fix: give one or more of "
                          f"{', '.join(M.TORCH_DTYPES)}, comma-separated)")
    bad = [d for d in dtypes if d not in M.TORCH_DTYPES]
    if bad:
        raise HeteroError(f"--dtype: unknown dtype '{bad[0]}' (choose from {', '.join(M.TORCH_DTYPES)})")
    grid = M.default_grid(quick=args.quick)
    if torch_device != "cpu":  # 20 probe shapes pin the learned model to this accelerator
        grid += M.probe_grid(grid)
    err = console(stderr=True)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    probes = M.default_block_probes(quick=args.quick) if (torch_device == "cpu" and not args.no_blocks) else []
    moe_probes = M.default_moe_probes(quick=args.quick) if probes else []
    # generation's host floor (hetero rl's rollout on a CPU); a --quick smoke test leaves it out
    decode_cases = DF.profile_case_count() if probes and not args.quick else 0
    # the runtime's small messages between two processes here (emulated clusters' floors)
    loopback_cases = 1 if decode_cases else 0
    total = len(grid) * len(dtypes) + len(probes) + len(moe_probes) + decode_cases + loopback_cases
    err.print(f"profiling {total} operators on {name} ({torch_device}, {torch.get_num_threads()} threads, "
              f"dtypes {','.join(dtypes)})")
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=False) as progress:
        task = progress.add_task("profile", total=total)

        def step(label: str) -> None:
            progress.update(task, advance=1, description=f"{label:<36}")

        records = M.measure(grid, name, torch_device, dtypes=dtypes, quick=args.quick, progress=step)
        blocks = M.measure_blocks(probes, quick=args.quick, progress=step) if probes else []
        moe_blocks = M.measure_moe_blocks(moe_probes, quick=args.quick, progress=step) if moe_probes else []
        decode = DF.measure_decode_dispatch(progress=step) if decode_cases else None
        loopback = None
        if loopback_cases:
            from hetero.measure.loopback import measure_loopback

            loopback = measure_loopback()
            step("loopback p2p and all-reduce")
        progress.update(task, description="done")
    meta = {"device": name, "torch_device": torch_device, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": bool(args.quick),
            "statistic": "operators: fastest block of repeated calls; blocks: median of repeated rounds",
            "load_average": {"before": list(load_before) if load_before else None,
                             "after": list(os.getloadavg()) if load_before else None},
            "blocks": blocks, "moe_blocks": moe_blocks}
    if decode:
        meta["decode_dispatch"] = decode
    if loopback:
        meta["loopback"] = loopback
    elif loopback_cases:
        err.print("note: the two-process loopback measurement did not run (no free port or a rank failed); "
                  "emulated clusters are predicted with their links' latencies alone")
    written = []
    if not args.no_cache and not args.quick:
        written.append(P.write_records(P.cache_path(name), records))
        P.write_meta(P.cache_path(name), meta)
    elif args.quick and not args.no_cache:
        err.print(f"--quick (a smoke test): the cached profile {P.cache_path(name)} is left as it is; "
                  f"run without --quick to update it")
    if args.output:
        write_output(args.output, "-o", lambda path: P.write_records(path, records))
        write_output(P.meta_path(args.output), "-o (its .meta.json)", lambda _: P.write_meta(args.output, meta))
        written.append(args.output)
    out = console()
    for path in written:
        out.print(f"wrote {len(records)} records to {path}")
    if not written:
        out.print(P.records_to_csv(records), end="")
    return 0


def requested_type(args):
    """The device type ``--device`` names (None when not given): a catalog entry or, with ``--cluster``,
    one of the types that cluster defines under ``devices:`` (used by a group or not). Records name a
    device type whose specs are known (docs/formats.md), so any other name is an error listing the valid ones."""
    from hetero.errors import HeteroError

    if args.device is not None and not args.device.strip():
        raise HeteroError("--device '': an empty device name (fix: name a device type, or leave --device out "
                          "to profile the device found here)")
    if not args.device:
        if args.cluster:
            raise HeteroError("--cluster names the file whose own device types --device may name: give --device too")
        return None
    from hetero.specs.device import catalog_raw, load_catalog, resolve_devices
    from hetero.specs.errors import Problems, did_you_mean

    known = dict(load_catalog())
    if args.cluster:
        from hetero.specs.cluster import load_cluster

        cluster = load_cluster(args.cluster)   # a group's type is a catalog entry or one of these
        # the file loaded, so its own entries resolve without problems
        known.update(resolve_devices(cluster.devices, catalog_raw(), "devices", Problems(args.cluster)))
    if args.device not in known:
        where = f"the catalog or cluster {args.cluster}" if args.cluster else "the catalog"
        raise HeteroError(f"--device {args.device!r}: not a device type of {where} (fix: "
                          f"{did_you_mean(args.device, known)}; `hetero devices` lists the catalog; for a type of "
                          f"your own define it under a cluster file's 'devices:' and add --cluster FILE)")
    return known[args.device]
