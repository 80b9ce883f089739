"""dist.barrier (synchronous and asynchronous) and the backend's monitored_barrier.

The barrier must not let any rank through before the slowest one arrived: a straggler (a
different rank each round) sleeps, then leaves a marker file in the pool's shared directory
and enters the barrier; every rank must see the marker as soon as its barrier returns.

On a "cpu:gloo,spyre:spyreccl" group, torch 2.13 sends dist.barrier() to gloo, so the
barrier is tested on a spyreccl-only group (new_group(backend="spyreccl")), and the profiler
confirms that spyreccl served it.

torch's dist.monitored_barrier accepts gloo groups only, so the backend's own
monitored_barrier (what c10d reaches through the group's spyre backend) is called directly;
a monitored barrier that times out breaks the communicator, so that case lives in
test_timeout.py with its own pool.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from _ops_support import POOL_OPTIONS, RUN_TIMEOUT

pytestmark = pytest.mark.rank_pool_options(**POOL_OPTIONS)

_STRAGGLER_DELAY_S = 0.3


_group = None


def _spyreccl_group():
    global _group
    if _group is None:
        _group = dist.new_group(backend="spyreccl")
    return _group


def _spyre_backend():
    return dist.group.WORLD._get_backend(torch.device("spyre"))


def run_barrier_rounds(token, rounds, async_op, ctx):
    world, rank = ctx.world_size, ctx.rank
    group = _spyreccl_group()
    for i in range(rounds):
        marker = os.path.join(ctx.shared_dir, f"barrier-{token}-{async_op}-{i}")
        if rank == i % world:
            time.sleep(_STRAGGLER_DELAY_S)
            with open(marker, "w"):
                pass
        start = time.monotonic()
        work = dist.barrier(group=group, async_op=async_op)
        if async_op:
            assert work is not None, "barrier(async_op=True) returned no Work"
            work.wait()
            assert work.is_completed()
        waited = time.monotonic() - start
        assert os.path.exists(marker), (
            f"round {i}: rank {rank} left the barrier after {waited:.3f}s, before the straggler "
            f"(rank {i % world}) entered it"
        )
    return []


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_barrier_waits_for_the_straggler(rank_pool, async_op):
    token = os.urandom(4).hex()
    rank_pool.run(run_barrier_rounds, token, 2 * rank_pool.world_size, async_op)


def run_barrier_is_spyreccl(ctx):
    """The barrier of the spyreccl-only group is spyreccl's (the profiler shows its range)."""
    group = _spyreccl_group()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.barrier(group=group)
    names = {event.name for event in prof.events()}
    assert "spyreccl:barrier" in names, f"no spyreccl:barrier event; events: {sorted(names)}"


def test_barrier_reaches_spyreccl(rank_pool):
    rank_pool.run(run_barrier_is_spyreccl)


def run_monitored_barrier(token, wait_all_ranks, ctx):
    world, rank = ctx.world_size, ctx.rank
    backend = _spyre_backend()
    marker = os.path.join(ctx.shared_dir, f"monitored-{token}-{wait_all_ranks}")
    if rank == world - 1:
        time.sleep(_STRAGGLER_DELAY_S)
        with open(marker, "w"):
            pass
    backend.monitored_barrier(datetime.timedelta(seconds=30), wait_all_ranks)
    assert os.path.exists(marker), f"rank {rank} left the monitored barrier before the straggler"
    # dist.monitored_barrier itself refuses anything but gloo groups (torch's rule).
    with pytest.raises(ValueError, match="GLOO"):
        dist.monitored_barrier()
    # The group still works after the monitored barrier.
    tensor = torch.ones(3, device=ctx.device)
    dist.all_reduce(tensor)
    assert tensor.cpu().tolist() == [float(world)] * 3


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_monitored_barrier(rank_pool, wait_all_ranks):
    rank_pool.run(run_monitored_barrier, os.urandom(4).hex(), wait_all_ranks, timeout=RUN_TIMEOUT)
