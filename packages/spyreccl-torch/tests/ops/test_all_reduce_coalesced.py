"""dist.all_reduce_coalesced: several tensors of one dtype reduced by one call.

Each case reduces a list of tensors of different shapes (empty and 0-d ones included) and
checks every one of them against the float64 reference; invalid (dtype, op) pairs must be
rejected before anything is communicated.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _ops_support import (
    LARGE,
    SHARED_POOL_OPTIONS,
    check_result,
    device,
    dist_op,
    dtype_id,
    dtype_params,
    expect_rejection,
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

# Lists of shapes reduced together: small mixed ones, and one beyond the staging chunk.
_SHAPE_LISTS = (
    ((1001,), (0,), (), (3, 5, 7)),
    ((LARGE,), (1,)),
)


def _check_coalesced(case, seed, ctx):
    dtype, op, shapes, async_op = case
    world, rank = ctx.world_size, ctx.rank
    factor = premul_factor(seed) if op == "PREMUL_SUM" else None
    inputs = [rank_inputs(seed, shape, dtype, world, salt=i) for i, shape in enumerate(shapes)]
    tensors = [per_rank[rank].to(device(ctx)) for per_rank in inputs]
    what = f"all_reduce_coalesced {op} {dtype_id(dtype)} shapes={shapes} async_op={async_op}"
    if not reduction_valid(dtype, op):
        expect_rejection(
            lambda: dist.all_reduce_coalesced(tensors, op=dist_op(op, factor), async_op=async_op),
            rejection_pattern(dtype, op),
            what,
        )
        return
    issue(dist.all_reduce_coalesced, tensors, op=dist_op(op, factor), async_op=async_op)
    for i, (tensor, per_rank) in enumerate(zip(tensors, inputs)):
        expected = reference_reduce(per_rank, reference_op(op, factor), dtype)
        check_result(tensor, expected, dtype, world, seed, f"{what} tensor {i}", op)


@pytest.mark.parametrize("dtype", dtype_params())
def test_all_reduce_coalesced(rank_pool, dtype):
    cases = reduce_cases(dtype, sizes=_SHAPE_LISTS)
    run_batch(rank_pool, _check_coalesced, cases, f"all_reduce_coalesced {dtype_id(dtype)}")
