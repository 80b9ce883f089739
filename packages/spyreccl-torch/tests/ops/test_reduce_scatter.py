"""dist.reduce_scatter (list form): every dtype x reduce op x size x sync/async, with equal
blocks and with blocks of different sizes per destination rank (the backend turns those into
one reduce per rank). The output is poisoned before the call; the input list is only read."""

from __future__ import annotations

import pytest
import torch
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
from spyreccl_testing.inputs import poison_

pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)


def _block_shapes(kind, shape, world):
    if kind == "uneven":
        return [(shape[0] + 3 * r,) for r in range(world)]
    return [shape] * world


def _check_reduce_scatter(case, seed, ctx):
    kind, dtype, op, shape, async_op = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    factor = premul_factor(seed) if op == "PREMUL_SUM" else None
    shapes = _block_shapes(kind, shape, world)
    # blocks[r][p]: the block rank p contributes to destination r.
    blocks = [rank_inputs(seed, s, dtype, world, salt=r) for r, s in enumerate(shapes)]
    inputs = [blocks[r][rank].to(dev) for r in range(world)]
    output = poison_(torch.empty(shapes[rank], dtype=dtype, device=dev))
    what = f"reduce_scatter ({kind}) {op} {dtype_id(dtype)} shape={shape} async_op={async_op}"
    if not reduction_valid(dtype, op):
        expect_rejection(
            lambda: dist.reduce_scatter(output, inputs, op=dist_op(op, factor), async_op=async_op),
            rejection_pattern(dtype, op),
            what,
        )
        return
    issue(dist.reduce_scatter, output, inputs, op=dist_op(op, factor), async_op=async_op)
    # gloo runs before any check: a rank whose check fails must not skip a collective.
    on_cpu = None
    if kind == "even" and gloo_reduces(dtype, op):
        on_cpu = poison_(torch.empty(shapes[rank], dtype=dtype))
        dist.reduce_scatter(on_cpu, [blocks[r][rank].clone() for r in range(world)], op=dist_op(op))
    for r in range(world):
        check_untouched(inputs[r], blocks[r][rank], f"{what}: input block {r}")
    expected = reference_reduce(blocks[rank], reference_op(op, factor), dtype)
    check_result(output, expected, dtype, world, seed, what, op)
    if on_cpu is not None:
        check_gloo(output, on_cpu, dtype, world, seed, what, op)


@pytest.mark.parametrize("dtype", dtype_params())
def test_reduce_scatter(rank_pool, dtype):
    cases = [("even", *c) for c in reduce_cases(dtype, sizes=SHAPES)]
    cases += [("uneven", *c) for c in reduce_cases(dtype, sizes=((0,), (1001,)))]
    run_batch(rank_pool, _check_reduce_scatter, cases, f"reduce_scatter {dtype_id(dtype)}")
