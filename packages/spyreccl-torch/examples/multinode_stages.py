"""What a small multi-node operation costs, stage by stage, against gloo alone.

4 ranks on one machine split into 2 simulated nodes (SPYRECCL_NODE_ID), as
multinode_latency.py. Times, in the same rounds, the hierarchical group's all_reduce (with
and without the mismatch check), broadcast and all_gather_into_tensor, gloo's over the same
4 ranks, and each building block of the hierarchical path alone: the gloo all_reduce and the
leaders' all_to_all of one check frame between the 2 ranks of a cross-node group, and the
on-node spyreccl all_reduce of the data and of the check's digest pair. The building blocks
are reached through the group's private attributes: a diagnostic, not an API.

    torchrun --nproc-per-node 4 packages/spyreccl-torch/examples/multinode_stages.py

STAGE_SIZES (bytes, comma separated), STAGE_ROUNDS and STAGE_ITERS tune it. The tables in
docs/notes/multinode-small-messages.md ("The small path's Python cost") come from it.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.environ["SPYRECCL_NODE_ID"] = f"node{rank * 2 // world}"
torch.spyre.set_device(rank % (world // 2))
dist.init_process_group("cpu:gloo,spyre:spyreccl", timeout=datetime.timedelta(seconds=60))
from spyreccl_torch.device import host_view  # noqa: E402
from spyreccl_torch.multinode.node_check import _FRAME  # noqa: E402

hier = dist.new_group(list(range(world)))
os.environ["SPYRECCL_MULTINODE_CHECK"] = "0"
hier_unchecked = dist.new_group(list(range(world)))
del os.environ["SPYRECCL_MULTINODE_CHECK"]
gloo = dist.new_group(list(range(world)), backend="gloo")
local, cross, check_local = hier._local, hier._cross, hier._check_local


def sum_opts() -> c10d.AllreduceOptions:
    opts = c10d.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts


sizes = [int(s) for s in os.environ.get("STAGE_SIZES", "8,4096").split(",")]
rounds = int(os.environ.get("STAGE_ROUNDS", "4"))
iters = int(os.environ.get("STAGE_ITERS", "200"))
frame = torch.zeros(_FRAME, dtype=torch.int64)
frame_out = torch.empty(2 * _FRAME, dtype=torch.int64)
pair = torch.zeros(2, dtype=torch.int64, device="spyre")
results: dict[tuple[int, str], list[float]] = {}


def cases_for(nbytes: int) -> dict[str, Callable[[], object]]:
    n = max(1, nbytes // 4)
    ts, tc = torch.randn(n, device="spyre"), torch.randn(n)
    hs = host_view(ts)
    gathered_s = torch.empty(n * world, device="spyre")
    gathered_c = torch.empty(n * world)
    return {
        "all_reduce": lambda: dist.all_reduce(ts, group=hier),
        "all_reduce (no check)": lambda: dist.all_reduce(ts, group=hier_unchecked),
        "gloo all_reduce x4": lambda: dist.all_reduce(tc, group=gloo),
        "stage: gloo all_reduce x2": lambda: cross.allreduce([hs], sum_opts()).wait(),
        "stage: gloo frame all_to_all x2": lambda: cross.alltoall_base(
            frame_out, frame.repeat(2), [], [], c10d.AllToAllOptions()
        ).wait(),
        "stage: on-node all_reduce": lambda: local.allreduce([ts], sum_opts()).wait(),
        "stage: on-node digest pair": lambda: check_local.allreduce([pair], sum_opts()).wait(),
        "broadcast": lambda: dist.broadcast(ts, 0, group=hier),
        "gloo broadcast x4": lambda: dist.broadcast(tc, 0, group=gloo),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered_s, ts, group=hier),
        "gloo all_gather_into_tensor x4": lambda: dist.all_gather_into_tensor(
            gathered_c, tc, group=gloo
        ),
    }


for _ in range(rounds):
    for nbytes in sizes:
        cases = cases_for(nbytes)
        for name, fn in cases.items():
            for _ in range(10):
                fn()
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            results.setdefault((nbytes, name), []).append(
                (time.perf_counter() - start) / iters * 1e6
            )
            dist.barrier(group=gloo)
if rank == 0:
    print(f"load average {os.getloadavg()[0]:.1f}; median [min-max] us over {rounds} rounds")
    for nbytes in sizes:
        for name in [k for (s, k) in results if s == nbytes]:
            v = results[(nbytes, name)]
            print(
                f"{nbytes:>7} B  {name:32} {statistics.median(v):8.1f} [{min(v):.1f}-{max(v):.1f}]"
            )
dist.destroy_process_group()
