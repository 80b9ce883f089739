"""dist.broadcast: every dtype x size x sync/async x root. Non-root tensors are poisoned before
the call and must be bit-exact copies of the root's afterwards; the root's tensor is only
read."""

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


def _check_broadcast(case, seed, ctx):
    dtype, shape, async_op, root = case
    world, rank = ctx.world_size, ctx.rank
    inputs = rank_inputs(seed, shape, dtype, world)
    if rank == root:
        tensor = inputs[rank].to(device(ctx))
    else:
        tensor = poison_(torch.empty(shape, dtype=dtype, device=device(ctx)))
    what = f"broadcast {dtype_id(dtype)} shape={shape} root={root} async_op={async_op}"
    issue(dist.broadcast, tensor, src=root, async_op=async_op)
    # gloo runs before any check: a rank whose check fails must not skip a collective.
    on_cpu = None
    if gloo_moves(dtype):
        on_cpu = inputs[rank].clone() if rank == root else poison_(torch.empty(shape, dtype=dtype))
        dist.broadcast(on_cpu, src=root)
    if rank == root:
        check_untouched(tensor, inputs[root], f"{what}: root tensor")
    else:
        check_exact(tensor, inputs[root], seed, world, what)
    if on_cpu is not None:
        check_exact(tensor, on_cpu, seed, world, f"{what} vs gloo")


def test_broadcast(rank_pool):
    world = rank_pool.world_size
    cases = [
        (dtype, shape, async_op, root)
        for dtype in DTYPES
        for shape in SHAPES
        for async_op in (False, True)
        for root in range(world)
    ]
    run_batch(rank_pool, _check_broadcast, cases, "broadcast")
