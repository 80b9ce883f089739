"""dist.all_reduce on spyre tensors: every dtype x every reduce op x sizes x sync/async.

Invalid (dtype, op) pairs (bitwise ops on floats, AVG of bools, PREMUL_SUM on integers) must be
rejected on the calling rank with a message naming the op and the dtype, and leave the group
usable; the matrix runs them in line with the valid cases, so every later case proves it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ops_support import (
    RUN_TIMEOUT,
    SHAPES,
    SHARED_POOL_OPTIONS,
    assert_ranks_passed,
    case_seed,
    check_gloo,
    check_result,
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
from spyreccl_testing.inputs import fresh_seed

pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)


def _check_all_reduce(case, seed, ctx):
    dtype, op, shape, async_op = case
    world, rank = ctx.world_size, ctx.rank
    factor = premul_factor(seed) if op == "PREMUL_SUM" else None
    inputs = rank_inputs(seed, shape, dtype, world)
    tensor = inputs[rank].to(device(ctx))
    what = f"all_reduce {op} {dtype_id(dtype)} shape={shape} async_op={async_op}"
    if not reduction_valid(dtype, op):
        expect_rejection(
            lambda: dist.all_reduce(tensor, op=dist_op(op, factor), async_op=async_op),
            rejection_pattern(dtype, op),
            what,
        )
        return
    issue(dist.all_reduce, tensor, op=dist_op(op, factor), async_op=async_op)
    # gloo runs before any check: a rank whose check fails must not skip a collective.
    on_cpu = None
    if gloo_reduces(dtype, op):
        on_cpu = inputs[rank].clone()
        dist.all_reduce(on_cpu, op=dist_op(op))
    expected = reference_reduce(inputs, reference_op(op, factor), dtype)
    check_result(tensor, expected, dtype, world, seed, what, op)
    if on_cpu is not None:
        check_gloo(tensor, on_cpu, dtype, world, seed, what, op)


@pytest.mark.parametrize("dtype", dtype_params())
def test_all_reduce(rank_pool, dtype):
    run_batch(
        rank_pool,
        _check_all_reduce,
        reduce_cases(dtype, sizes=SHAPES),
        f"all_reduce {dtype_id(dtype)}",
    )


# Operations kept in flight together: (dtype, op, numel). Mixed sizes make later operations
# finish quickly behind a long one, which must not let their Works complete out of order.
_IN_FLIGHT = [
    (torch.float32, "SUM", 200_003),
    (torch.bfloat16, "MAX", 17),
    (torch.int64, "AVG", 1001),
    (torch.float16, "PREMUL_SUM", 4096),
    (torch.uint8, "BXOR", 0),
    (torch.bool, "MIN", 333),
    (torch.float8_e5m2, "SUM", 2049),
    (torch.int32, "PRODUCT", 65_537),
]


def run_in_flight(base_seed, ctx):
    """Issues every all_reduce of _IN_FLIGHT with async_op=True before waiting on any (in
    reverse order); the last PREMUL_SUM takes its factor as a spyre tensor."""
    world, rank = ctx.world_size, ctx.rank
    pending = []
    for index, (dtype, op, numel) in enumerate(_IN_FLIGHT):
        seed = case_seed(base_seed, index)
        inputs = rank_inputs(seed, (numel,), dtype, world)
        factor = premul_factor(seed) if op == "PREMUL_SUM" else None
        reduce_op = dist_op(op, factor)
        if op == "PREMUL_SUM":
            reduce_op = dist._make_nccl_premul_sum(
                torch.tensor(factor, dtype=torch.float64, device=device(ctx))
            )
        tensor = inputs[rank].to(device(ctx))
        work = dist.all_reduce(tensor, op=reduce_op, async_op=True)
        pending.append((work, tensor, inputs, dtype, op, factor, seed))
    failures = []
    for work, tensor, inputs, dtype, op, factor, seed in reversed(pending):
        what = f"in-flight all_reduce {op} {dtype_id(dtype)} numel={tensor.numel()}"
        try:
            work.wait()
            (value,) = work.get_future().value()
            assert value.data_ptr() == tensor.data_ptr(), f"{what}: future holds another tensor"
            expected = reference_reduce(inputs, reference_op(op, factor), dtype)
            check_result(tensor, expected, dtype, world, seed, what, op)
        except Exception as exc:
            failures.append(f"rank {rank} {what} seed={seed}: {exc}")
    return failures


def test_all_reduce_many_in_flight(rank_pool):
    seed = fresh_seed()
    results = rank_pool.run(run_in_flight, seed, timeout=RUN_TIMEOUT)
    assert_ranks_passed(results, seed, "all_reduce with several operations in flight")
