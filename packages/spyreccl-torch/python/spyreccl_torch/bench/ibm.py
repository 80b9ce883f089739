"""``--mode ibm``: the loop methodology of IBM's pytorch-communication-benchmarks.

Follows allreduce-loop.py / allgather-loop.py / reduce-scatter-loop.py
(github.com/IBM/pytorch-communication-benchmarks), re-implemented here, with the CUDA
synchronisations replaced by ``torch.spyre.synchronize()``:

- one process per rank, started by torchrun (environment RANK / WORLD_SIZE / LOCAL_RANK);
- global sizes in MB (1e6 bytes) on a log scale with 10 points per decade, here from
  ``--min-mb`` (0.1) to ``--max-mb``;
- per size: two untimed calls (each followed by a device synchronisation), then ``maxiter``
  timed calls (20 below 512 MB, 10 below 2000 MB, 5 above, times ``--multiplier``), each
  followed by a synchronisation; the time of call i is the interval between the ends of
  calls i-1 and i, giving tmin/tmax, and the average comes from the whole loop's elapsed time;
- all-reduce works on the first ``npts - 1`` elements of one large preallocated tensor (the
  odd length is part of the original methodology); all-gather/reduce-scatter allocate per
  size with the global count rounded to a multiple of the world size;
- bandwidths in GB/s (1e9 B/s): all-reduce 2 (n-1)/n x bytes / t, all-gather and
  reduce-scatter (n-1)/n x global bytes / t; avgbw from the average time, maxbw from tmin,
  minbw from tmax.

Without torchrun's environment the command starts itself under ``torch.distributed.run``.
Both levels run in one process group ``cpu:gloo,spyre:spyreccl``: spyre tensors go through
spyreccl, CPU tensors through gloo, as in a real job mixing the two.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import warnings

from .machine import command_line, describe_environment, timestamp
from .plan import DTYPES
from .report import write_json

__all__ = ["FORWARDED_ARGS_ENV", "ibm_iterations", "ibm_sizes_mb", "run_ibm"]

# Command-line arguments handed to the torchrun-started ranks (a JSON list).
FORWARDED_ARGS_ENV = "SPYRECCL_BENCH_FORWARDED_ARGS"

_MANTISSAS = (1.0, 1.25, 1.6, 2.0, 2.5, 3.16, 4.0, 5.0, 6.4, 8.0)


def ibm_sizes_mb(min_mb: float, max_mb: float) -> list[float]:
    """10 points per decade (1, 1.25, 1.6, 2, 2.5, 3.16, 4, 5, 6.4, 8) within [min, max]."""
    if not 0 < min_mb <= max_mb:
        raise ValueError(f"ibm sizes: expected 0 < min_mb <= max_mb, got {min_mb}, {max_mb}")
    sizes = []
    decade = 10.0 ** int(f"{min_mb:e}".split("e")[1])
    while decade * _MANTISSAS[0] <= max_mb * (1 + 1e-9):
        for m in _MANTISSAS:
            v = round(m * decade, 6)
            if min_mb * (1 - 1e-9) <= v <= max_mb * (1 + 1e-9):
                sizes.append(v)
        decade *= 10
    return sizes


def ibm_iterations(size_mb: float, multiplier: int) -> int:
    if size_mb < 512.0:
        return 20 * multiplier
    if size_mb < 2000.0:
        return 10 * multiplier
    return 5 * multiplier


def _self_launch(args: argparse.Namespace) -> int:
    """Re-runs this command under torchrun, once per requested world size."""
    json_path = args.json or os.path.join("bench-results", f"ibm-{timestamp()}.json")
    rc = 0
    for n in args.nproc:
        path = json_path if len(args.nproc) == 1 else f"{os.path.splitext(json_path)[0]}-n{n}.json"
        # Our options travel in the environment: torchrun's parser would otherwise claim
        # any of them that abbreviates one of its own (--nproc, --max, ...).
        forwarded = _strip_option(args.argv, ("--nproc", "--json")) + ["--json", path]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            "-m",
            "spyreccl_torch.bench",
        ]
        print("launching:", " ".join(cmd), "with", " ".join(forwarded), flush=True)
        env = dict(os.environ, **{FORWARDED_ARGS_ENV: json.dumps(forwarded)})
        rc = subprocess.call(cmd, env=env) or rc
    return rc


def _strip_option(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


def _time_loop(call, sync, maxiter: int) -> tuple[float, float, float]:
    """(elapsed, tmin, tmax) of ``maxiter`` calls, IBM style (end-to-end intervals)."""
    call()
    sync()
    call()
    sync()
    tbeg = time.perf_counter()
    t1 = tbeg
    tmin, tmax = float("inf"), 0.0
    for _ in range(maxiter):
        call()
        sync()
        t2 = time.perf_counter()
        tmin = min(tmin, t2 - t1)
        tmax = max(tmax, t2 - t1)
        t1 = t2
    sync()
    return time.perf_counter() - tbeg, tmin, tmax


def _run_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.set_num_threads(1)
    levels = [lv for lv in args.levels if lv in ("spyreccl", "gloo")]
    if not levels:
        raise SystemExit("spyreccl-bench --mode ibm: --levels must include spyreccl and/or gloo")
    devices = {}
    if "spyreccl" in levels:
        index = local_rank % torch.spyre.device_count()
        torch.spyre.set_device(index)
        devices["spyreccl"] = (torch.device("spyre", index), torch.spyre.synchronize)
    if "gloo" in levels:
        devices["gloo"] = (torch.device("cpu"), lambda: None)
    from spyreccl_torch import backend_name  # ours, whatever name it holds beside a vendor's

    backend = ",".join(
        f"spyre:{backend_name()}" if lv == "spyreccl" else "cpu:gloo" for lv in levels
    )
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    dtype = getattr(torch, args.dtype)
    itemsize = DTYPES[args.dtype].itemsize
    sizes = ibm_sizes_mb(args.min_mb, args.max_mb)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rows = []
    torch.manual_seed(1235911)
    for level in levels:
        device, sync = devices[level]
        big = None
        for op in args.ibm_ops:
            if rank == 0:
                print(
                    f"\n# IBM loop methodology: {op}, {level} ({device.type} tensors), "
                    f"{world} ranks, {args.dtype}"
                )
                print(
                    f"{'size(MB)':>9} {'tavg(us)':>11} {'tmin(us)':>11} {'tmax(us)':>11} "
                    f"{'avgbw(GB/s)':>12} {'maxbw(GB/s)':>12} {'minbw(GB/s)':>12}",
                    flush=True,
                )
            for size_mb in sizes:
                maxiter = ibm_iterations(size_mb, args.multiplier)
                npts = int(size_mb * 1e6 / itemsize)
                if op == "allreduce":
                    if big is None:
                        big = torch.rand(int(max(sizes) * 1e6 / itemsize)).to(dtype).to(device)
                    view = big[0 : npts - 1]
                    elems, factor = npts - 1, 2.0 * (world - 1) / world

                    def call(view=view):
                        dist.all_reduce(view)
                else:
                    nlocal = int((npts + 1) / world)
                    elems, factor = nlocal * world, (world - 1) / world
                    full = torch.rand(elems).to(dtype).to(device)
                    part = torch.rand(nlocal).to(dtype).to(device)
                    if op == "allgather":

                        def call(full=full, part=part):
                            all_gather(full, part)
                    else:

                        def call(full=full, part=part):
                            reduce_scatter(part, full)

                elapsed, tmin, tmax = _time_loop(call, sync, maxiter)
                moved = factor * elems * itemsize / 1e9
                row = {
                    "level": level,
                    "op": op,
                    "nranks": world,
                    "dtype": args.dtype,
                    "size_mb": size_mb,
                    "elements": elems,
                    "iters": maxiter,
                    "tavg_us": elapsed / maxiter * 1e6,
                    "tmin_us": tmin * 1e6,
                    "tmax_us": tmax * 1e6,
                    "avgbw_gbps": moved * maxiter / elapsed,
                    "maxbw_gbps": moved / tmin,
                    "minbw_gbps": moved / tmax,
                }
                rows.append(row)
                if rank == 0:
                    print(
                        f"{size_mb:9.3f} {row['tavg_us']:11.1f} {row['tmin_us']:11.1f} "
                        f"{row['tmax_us']:11.1f} {row['avgbw_gbps']:12.3f} "
                        f"{row['maxbw_gbps']:12.3f} {row['minbw_gbps']:12.3f}",
                        flush=True,
                    )
        del big
    dist.destroy_process_group()
    if rank == 0:
        path = args.json or os.path.join("bench-results", f"ibm-{timestamp()}.json")
        write_json(
            path,
            {
                "schema": "spyreccl-bench/1",
                "mode": "ibm",
                "command": command_line(args),
                "timestamp": timestamp(),
                "machine": describe_environment(),
                "config": {
                    "nproc": world,
                    "dtype": args.dtype,
                    "levels": levels,
                    "ops": args.ibm_ops,
                    "sizes_mb": sizes,
                    "multiplier": args.multiplier,
                },
                "results": rows,
            },
        )
        print(f"\nresults: {path}")
    return 0


def run_ibm(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return _self_launch(args)
    return _run_rank(args)
