"""dist.scatter: every dtype x size x sync/async x root. Each rank's output is poisoned before
the call and must be a bit-exact copy of its block of the root's list; the root's list is
only read; non-root ranks pass no list."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ops_support import (
    DTYPES,
    SHAPES,
    SHARED_POOL_OPTIONS,
    check_exact,
    check_untouched,
    device,
    dtype_id,
    gloo_moves,
    issue,
    rank_inputs,
    run_batch,
)

from spyreccl_testing.inputs import poison_

pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)


def _check_scatter(case, seed, ctx):
    dtype, shape, async_op, root = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    blocks = rank_inputs(seed, shape, dtype, world)  # blocks[r]: what the root sends to r
    sources = [b.to(dev) for b in blocks] if rank == root else None
    output = poison_(torch.empty(shape, dtype=dtype, device=dev))
    what = f"scatter {dtype_id(dtype)} shape={shape} root={root} async_op={async_op}"
    issue(dist.scatter, output, sources, src=root, async_op=async_op)
    # gloo runs before any check: a rank whose check fails must not skip a collective.
    on_cpu = None
    if gloo_moves(dtype):
        on_cpu = poison_(torch.empty(shape, dtype=dtype))
        cpu_sources = [b.clone() for b in blocks] if rank == root else None
        dist.scatter(on_cpu, cpu_sources, src=root)
    check_exact(output, blocks[rank], seed, world, what)
    if rank == root:
        for r in range(world):
            check_untouched(sources[r], blocks[r], f"{what}: root's block {r}")
    if on_cpu is not None:
        check_exact(output, on_cpu, seed, world, f"{what} vs gloo")


def test_scatter(rank_pool):
    world = rank_pool.world_size
    cases = [
        (dtype, shape, async_op, root)
        for dtype in DTYPES
        for shape in SHAPES
        for async_op in (False, True)
        for root in range(world)
    ]
    run_batch(rank_pool, _check_scatter, cases, "scatter")
