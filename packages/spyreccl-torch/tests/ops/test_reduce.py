"""dist.reduce: every dtype x reduce op x size x sync/async, with the root rotating over all
ranks. The root's tensor holds the reduction; every other rank's tensor must keep its
contents (the backend reduces from it without writing it)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _ops_support import (
    SHAPES,
    SHARED_POOL_OPTIONS,
    check_gloo,
    check_result,
    check_untouched,
    device,
    dist_op,
    dtype_id,
    dtype_params,
    expect_rejection,
    gloo_reduces,
    issue,
    premul_factor,
    rank_inputs,
    reduce_cases,
    reduction_valid,
    reference_op,
    rejection_pattern,
    run_batch,
)

from spyreccl_testing.accuracy import reference_reduce

pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)


def _check_reduce(case, seed, ctx):
    dtype, op, shape, async_op, root = case
    world, rank = ctx.world_size, ctx.rank
    factor = premul_factor(seed) if op == "PREMUL_SUM" else None
    inputs = rank_inputs(seed, shape, dtype, world)
    tensor = inputs[rank].to(device(ctx))
    what = f"reduce {op} {dtype_id(dtype)} shape={shape} root={root} async_op={async_op}"
    if not reduction_valid(dtype, op):
        expect_rejection(
            lambda: dist.reduce(tensor, dst=root, op=dist_op(op, factor), async_op=async_op),
            rejection_pattern(dtype, op),
            what,
        )
        return
    issue(dist.reduce, tensor, dst=root, op=dist_op(op, factor), async_op=async_op)
    # gloo runs before any check: a rank whose check fails must not skip a collective.
    on_cpu = None
    if gloo_reduces(dtype, op):
        on_cpu = inputs[rank].clone()
        dist.reduce(on_cpu, dst=root, op=dist_op(op))
    if rank != root:
        check_untouched(tensor, inputs[rank], f"{what}: non-root tensor")
        return
    expected = reference_reduce(inputs, reference_op(op, factor), dtype)
    check_result(tensor, expected, dtype, world, seed, what, op)
    if on_cpu is not None:
        check_gloo(tensor, on_cpu, dtype, world, seed, what, op)


@pytest.mark.parametrize("dtype", dtype_params())
def test_reduce(rank_pool, dtype):
    world = rank_pool.world_size
    # The root rotates with the case index, so every rank is root for every size.
    cases = [(*c, i % world) for i, c in enumerate(reduce_cases(dtype, sizes=SHAPES))]
    run_batch(rank_pool, _check_reduce, cases, f"reduce {dtype_id(dtype)}")
