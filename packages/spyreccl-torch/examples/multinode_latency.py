"""Small-message all_reduce latency of a multi-node group's routes against gloo, interleaved.

4 ranks on one machine, split into 2 simulated nodes (SPYRECCL_NODE_ID); one group per
variant (route thresholds and the mismatch check are read when a group is created), and
gloo over the same ranks. Every round times every size on every variant in turn, so load
changes hit all of them alike; rank 0 prints the median and range over the rounds.

    torchrun --nproc-per-node 4 packages/spyreccl-torch/examples/multinode_latency.py

LAT_SIZES (bytes, comma separated), LAT_ROUNDS, LAT_ITERS tune it. The numbers in
docs/notes/multinode-small-messages.md ("Multiple nodes: small-message routes and the check") come
from it.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.environ["SPYRECCL_NODE_ID"] = f"node{rank * 2 // world}"
torch.spyre.set_device(rank % (world // 2))
dist.init_process_group("cpu:gloo,spyre:spyreccl", timeout=datetime.timedelta(seconds=60))

FLAT_OFF = {"SPYRECCL_MULTINODE_FLAT_MAX_BYTES": "0"}
FLAT_ALWAYS = {"SPYRECCL_MULTINODE_FLAT_MAX_BYTES": str(1 << 40)}
VARIANTS = {
    "leader+check": {"SPYRECCL_MULTINODE_CHECK": "1", **FLAT_OFF},
    "leader": {"SPYRECCL_MULTINODE_CHECK": "0", **FLAT_OFF},
    "flat+check": {"SPYRECCL_MULTINODE_CHECK": "1", **FLAT_ALWAYS},
    "flat": {"SPYRECCL_MULTINODE_CHECK": "0", **FLAT_ALWAYS},
}


def group_with(env: dict[str, str]) -> dist.ProcessGroup:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return dist.new_group(list(range(world)))
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


groups = {name: group_with(env) for name, env in VARIANTS.items()}
groups["gloo"] = dist.new_group(list(range(world)), backend="gloo")
sizes = [int(s) for s in os.environ.get("LAT_SIZES", "8,256,4096,65536,262144").split(",")]
rounds, iters = int(os.environ.get("LAT_ROUNDS", "4")), int(os.environ.get("LAT_ITERS", "60"))
results: dict[tuple[int, str], list[float]] = {}
for _ in range(rounds):
    for nbytes in sizes:
        for name, group in groups.items():
            t = torch.ones(nbytes // 4, device="cpu" if name == "gloo" else "spyre")
            for _ in range(5):
                dist.all_reduce(t, group=group)
            dist.barrier(group=groups["gloo"])
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t, group=group)
            results.setdefault((nbytes, name), []).append(
                (time.perf_counter() - start) / iters * 1e6
            )
if rank == 0:
    print(f"load average {os.getloadavg()[0]:.1f}; median [min-max] us over {rounds} rounds")
    for nbytes in sizes:
        cells = []
        for name in groups:
            v = results[(nbytes, name)]
            cells.append(f"{name} {statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]")
        print(f"{nbytes:>7} B  " + "  ".join(cells))
dist.destroy_process_group()
