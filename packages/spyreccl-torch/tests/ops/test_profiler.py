"""torch.profiler sees every spyreccl operation: a "spyreccl:<op>" range per operation (with
the tensors' shapes when record_shapes=True), and a "record_param_comms" event carrying the
collective's name, element counts in and out, dtype and group size (what the profiler's trace
and HTA-style analyses read)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from _ops_support import POOL_OPTIONS, RUN_TIMEOUT, device

pytestmark = pytest.mark.rank_pool_options(**POOL_OPTIONS)

N = 1001


def _expected(world, rank):
    """(collective name in record_param_comms, range name, in nelems, out nelems) per call of
    _run_all, in order."""
    root = 0
    return [
        ("allreduce", "spyreccl:all_reduce", N, N),
        ("broadcast", "spyreccl:broadcast", N, N),
        ("reduce", "spyreccl:reduce", N, N),
        ("allgather", "spyreccl:all_gather", N, world * N),
        ("_allgather_base", "spyreccl:_allgather_base", N, world * N),
        ("reduce_scatter", "spyreccl:reduce_scatter", world * N, N),
        ("_reduce_scatter_base", "spyreccl:_reduce_scatter_base", world * N, N),
        ("alltoall_base", "spyreccl:all_to_all", world * N, world * N),
        ("alltoall", "spyreccl:all_to_all", world * N, world * N),
        ("gather", "spyreccl:gather", N, world * N if rank == root else 0),
        ("scatter", "spyreccl:scatter", world * N if rank == root else 0, N),
        ("allreduce_coalesced", "spyreccl:all_reduce_coalesced", 2 * N, 2 * N),
        (
            "send" if rank == 0 else "recv",
            "spyreccl:send" if rank == 0 else "spyreccl:recv",
            N if rank == 0 else 0,
            0 if rank == 0 else N,
        ),
        ("barrier", "spyreccl:barrier", 0, 0),
    ]


def _run_all(ctx, spyreccl_group):
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)

    def t(n=N):
        return torch.ones(n, device=dev)

    dist.all_reduce(t())
    dist.broadcast(t(), src=0)
    dist.reduce(t(), dst=0)
    dist.all_gather([t() for _ in range(world)], t())
    dist.all_gather_single(t(world * N), t())
    dist.reduce_scatter(t(), [t() for _ in range(world)])
    dist.reduce_scatter_single(t(), t(world * N))
    dist.all_to_all_single(t(world * N), t(world * N))
    dist.all_to_all([t() for _ in range(world)], [t() for _ in range(world)])
    dist.gather(t(), [t() for _ in range(world)] if rank == 0 else None, dst=0)
    dist.scatter(t(), [t() for _ in range(world)] if rank == 0 else None, src=0)
    dist.all_reduce_coalesced([t(), t()])
    if rank == 0:
        dist.send(t(), dst=1)
    elif rank == 1:
        dist.recv(t(), src=0)
    # The mixed group's barrier is gloo's: the spyreccl-only group's is spyreccl's.
    dist.barrier(group=spyreccl_group)


def run_profiled(ctx):
    world, rank = ctx.world_size, ctx.rank
    spyreccl_group = dist.new_group(backend="spyreccl")
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        _run_all(ctx, spyreccl_group)
    path = os.path.join(ctx.shared_dir, f"trace-rank{rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = sorted(json.load(f)["traceEvents"], key=lambda e: e.get("ts", 0))
    comms = [e["args"] for e in events if e.get("name") == "record_param_comms"]
    ranges = {
        e["name"]: e.get("args", {}) for e in events if e.get("name", "").startswith("spyreccl:")
    }
    expected = [e for e in _expected(world, rank) if rank < 2 or e[0] not in ("send", "recv")]
    failures = []
    got = [
        (c.get("Collective name"), c.get("In msg nelems"), c.get("Out msg nelems")) for c in comms
    ]
    want = [(name, n_in, n_out) for name, _, n_in, n_out in expected]
    if got != want:
        failures.append(f"rank {rank}: record_param_comms (name, in, out) = {got}, expected {want}")
    for c in comms:
        # A barrier moves no tensor: its dtype field is a placeholder.
        dtype_ok = c.get("dtype") == "Float" or c.get("Collective name") == "barrier"
        if not dtype_ok or c.get("Group size") != world:
            failures.append(
                f"rank {rank}: {c.get('Collective name')}: dtype {c.get('dtype')}, "
                f"group size {c.get('Group size')}"
            )
    for name, title, _, _ in expected:
        if title not in ranges:
            failures.append(f"rank {rank}: no '{title}' range for {name}; got {sorted(ranges)}")
    dims = ranges.get("spyreccl:all_reduce", {}).get("Input Dims")
    if dims != [[N]]:
        failures.append(f"rank {rank}: spyreccl:all_reduce Input Dims = {dims}, expected [[{N}]]")
    return failures


def test_profiler_shows_every_operation_with_sizes(rank_pool):
    results = rank_pool.run(run_profiled, timeout=RUN_TIMEOUT)
    lines = [line for per_rank in results for line in per_rank]
    assert not lines, "\n".join(lines)
