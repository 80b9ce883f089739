"""``--mode overhead``: per-call software cost of each layer, at world size 1.

With a single rank no peer has to be scheduled, so what remains is the cost of the call
path itself: the difference between two rows is the cost of the layer in between.
This is how the per-call hot spots in docs/performance.md were located; the run takes
a few seconds and can be repeated after a change to any layer.

Rows (8-byte float32 all_reduce unless stated):

- core: ``Communicator.all_reduce`` of spyreccl_core on numpy (pybind11 + C API + algorithm);
- torch.spyre.synchronize(): the device synchronisation every timed torch step performs;
- backend.allreduce([t]).wait(): the spyreccl c10d backend called directly (Work, future,
  progress thread, tensor translation), without torch.distributed's Python wrapper;
- dist.all_reduce(spyre): the public API, Python wrapper + c10d dispatcher + backend;
- dist.all_reduce(cpu) through gloo: the same public API on the baseline backend;
- dist.barrier() on spyreccl;
- the router of ``SPYRECCL_ROUTE_TO_VENDOR`` (spyreccl_torch.routing): ``allreduce([t])``
  on a plain group against the same call on a ``RoutingProcessGroup`` whose vendor backend
  is a second spyreccl backend (SUM goes to it, MAX to spyreccl's): the router's own cost,
  without torch's Python trampoline, which dist.* calls on any Python group add on top.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
import warnings
from collections.abc import Callable

from .machine import command_line, describe_environment, timestamp
from .report import write_json

__all__ = ["run_overhead"]


def _per_call_us(fn: Callable[[], object], seconds: float) -> dict[str, float]:
    """Median/min over repeats of the mean per-call time of a tight loop (microseconds)."""
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.05:
        fn()
        n += 1
    batch = max(10, int(n * seconds / 0.05 / 15))
    means = []
    for _ in range(15):
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        means.append((time.perf_counter_ns() - start) / batch / 1e3)
    means.sort()
    return {"median_us": means[len(means) // 2], "min_us": means[0], "calls": batch * 15}


def _routing_group(timeout: datetime.timedelta) -> object:
    """A one-rank RoutingProcessGroup over an in-process store whose "vendor" is another
    spyreccl backend (no vendor package needed: only the router is measured)."""
    import types

    import torch.distributed as dist

    from spyreccl_torch import _C, routing

    def vendor(store: object, rank: int, size: int, vendor_timeout: object) -> object:
        opts = _C.ProcessGroupSpyreccl.Options()
        opts.timeout = timeout
        opts.group_name = "bench-router-vendor"
        return _C.ProcessGroupSpyreccl(store, rank, size, opts)

    options = _C.ProcessGroupSpyreccl.Options()
    options.timeout = timeout
    options.group_name = "bench-router"
    dist_opts = types.SimpleNamespace(
        store=dist.HashStore(), group_rank=0, group_size=1, timeout=timeout
    )
    plugin = types.SimpleNamespace(creator_fn=vendor, extended_api=False)
    return routing.RoutingProcessGroup.create(dist_opts, None, plugin, options)


def run_overhead(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist

    import spyreccl_core

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    seconds = max(0.2, args.time_per_size * 5)
    rows: dict[str, dict[str, float]] = {}

    comm = spyreccl_core.Communicator(0, 1, spyreccl_core.UniqueId())
    a = np.zeros(2, dtype=np.float32)
    b = np.zeros(2, dtype=np.float32)
    rows["core Communicator.all_reduce(send, recv)"] = _per_call_us(
        lambda: comm.all_reduce(a, b), seconds
    )
    rows["core Communicator.barrier()"] = _per_call_us(comm.barrier, seconds)
    comm.destroy()

    with tempfile.TemporaryDirectory(prefix="spyreccl-bench-overhead-") as workdir:
        dist.init_process_group(
            "cpu:gloo,spyre:spyreccl",
            init_method=f"file://{os.path.join(workdir, 'store')}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
        t = torch.zeros(2, device="spyre")
        c = torch.zeros(2)
        backend = dist.group.WORLD._get_backend(torch.device("spyre"))
        rows["torch.spyre.synchronize()"] = _per_call_us(torch.spyre.synchronize, seconds)
        rows["torch.ops.spyreccl_device.current_device()"] = _per_call_us(
            torch.ops.spyreccl_device.current_device, seconds
        )
        rows["spyreccl backend.allreduce([t]).wait()"] = _per_call_us(
            lambda: backend.allreduce([t]).wait(), seconds
        )
        rows["dist.all_reduce(t) spyre/spyreccl"] = _per_call_us(
            lambda: dist.all_reduce(t), seconds
        )
        plain = dist.group.WORLD
        router = _routing_group(datetime.timedelta(seconds=args.timeout))
        sum_opts = dist.AllreduceOptions()
        max_opts = dist.AllreduceOptions()
        max_opts.reduceOp = dist.ReduceOp.MAX
        rows["plain group .allreduce([t]).wait()"] = _per_call_us(
            lambda: plain.allreduce([t], sum_opts).wait(), seconds
        )
        rows["router .allreduce([t]).wait() -> vendor (SUM)"] = _per_call_us(
            lambda: router.allreduce([t], sum_opts).wait(), seconds
        )
        rows["router .allreduce([t]).wait() -> spyreccl (MAX)"] = _per_call_us(
            lambda: router.allreduce([t], max_opts).wait(), seconds
        )
        router.shutdown()
        rows["dist.all_reduce(c) cpu/gloo"] = _per_call_us(lambda: dist.all_reduce(c), seconds)
        # device_ids: in a group that also has gloo, c10d runs a plain barrier on the CPU.
        spyre_ids = [t.device.index]
        rows["dist.barrier() (spyreccl)"] = _per_call_us(
            lambda: dist.barrier(device_ids=spyre_ids), seconds
        )
        rows["t.fill_(0) on spyre (device op, for scale)"] = _per_call_us(
            lambda: t.fill_(0), seconds
        )
        rows["c.fill_(0) on cpu (for scale)"] = _per_call_us(lambda: c.fill_(0), seconds)
        dist.destroy_process_group()

    width = max(len(k) for k in rows)
    print(
        f"# per-call cost at world size 1, 8-byte float32 (load average {os.getloadavg()[0]:.2f})"
    )
    print(f"{'call':<{width}} | {'median us':>9} {'min us':>8}")
    print("-" * (width + 21))
    for name, r in rows.items():
        print(f"{name:<{width}} | {r['median_us']:9.2f} {r['min_us']:8.2f}")
    path = args.json or os.path.join("bench-results", f"overhead-{timestamp()}.json")
    write_json(
        path,
        {
            "schema": "spyreccl-bench/1",
            "mode": "overhead",
            "command": command_line(args),
            "timestamp": timestamp(),
            "machine": describe_environment(),
            "results": rows,
        },
    )
    print(f"results: {path}")
    return 0
