"""dist.gather: every dtype x size x sync/async x root. The root's list is poisoned before the
call and must hold bit-exact copies of every rank's input; inputs are only read; non-root
ranks pass no list."""

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


def _check_gather(case, seed, ctx):
    dtype, shape, async_op, root = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    inputs = rank_inputs(seed, shape, dtype, world)
    tensor = inputs[rank].to(dev)
    outputs = None
    if rank == root:
        outputs = [poison_(torch.empty(shape, dtype=dtype, device=dev)) for _ in range(world)]
    what = f"gather {dtype_id(dtype)} shape={shape} root={root} async_op={async_op}"
    issue(dist.gather, tensor, outputs, dst=root, async_op=async_op)
    # gloo runs before any check: a rank whose check fails must not skip a collective.
    gloo = gloo_moves(dtype)
    on_cpu = None
    if gloo:
        if rank == root:
            on_cpu = [poison_(torch.empty(shape, dtype=dtype)) for _ in range(world)]
        dist.gather(inputs[rank].clone(), on_cpu, dst=root)
    check_untouched(tensor, inputs[rank], f"{what}: input")
    if rank == root:
        for r in range(world):
            check_exact(outputs[r], inputs[r], seed, world, f"{what}: block of rank {r}")
            if on_cpu is not None:
                check_exact(outputs[r], on_cpu[r], seed, world, f"{what}: block {r} vs gloo")


def test_gather(rank_pool):
    world = rank_pool.world_size
    cases = [
        (dtype, shape, async_op, root)
        for dtype in DTYPES
        for shape in SHAPES
        for async_op in (False, True)
        for root in range(world)
    ]
    run_batch(rank_pool, _check_gather, cases, "gather")
