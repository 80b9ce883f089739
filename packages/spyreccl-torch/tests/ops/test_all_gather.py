"""dist.all_gather (list form, equal and unequal block sizes) and dist.all_gather_coalesced.

Every output block is poisoned before the call and must be a bit-exact copy of its rank's
input afterwards; the input is only read. Unequal blocks are legal in the list form (the
backend broadcasts each rank's block); gloo needs equal blocks, so it is compared only there.
"""

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
    run_batch,
)

from spyreccl_testing.inputs import poison_, random_tensor, rank_seed

pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)


def _block_shapes(kind, shape, world):
    if kind == "uneven":
        # Rank r contributes r more elements than rank 0 (rank 0's block may be empty).
        return [(shape[0] + 2 * r,) for r in range(world)]
    return [shape] * world


def _check_all_gather(case, seed, ctx):
    kind, dtype, shape, async_op = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    shapes = _block_shapes(kind, shape, world)
    inputs = [
        random_tensor(shapes[r], dtype, "cpu", rank_seed(seed, r), nranks=world)
        for r in range(world)
    ]
    tensor = inputs[rank].to(dev)
    outputs = [poison_(torch.empty(s, dtype=dtype, device=dev)) for s in shapes]
    what = f"all_gather ({kind}) {dtype_id(dtype)} shape={shape} async_op={async_op}"
    issue(dist.all_gather, outputs, tensor, async_op=async_op)
    # gloo runs before any check: a rank whose check fails must not skip a collective.
    on_cpu = None
    if kind == "even" and gloo_moves(dtype):
        on_cpu = [poison_(torch.empty(s, dtype=dtype)) for s in shapes]
        dist.all_gather(on_cpu, inputs[rank].clone())
    check_untouched(tensor, inputs[rank], f"{what}: input")
    for r in range(world):
        check_exact(outputs[r], inputs[r], seed, world, f"{what}: block of rank {r}")
        if on_cpu is not None:
            check_exact(outputs[r], on_cpu[r], seed, world, f"{what}: block {r} vs gloo")


# Inputs of one all_gather_coalesced call, per case: the case's shape plus an odd and an
# empty tensor.
def _coalesced_shapes(shape):
    return [shape, (3, 5), (0,)]


def _check_all_gather_coalesced(case, seed, ctx):
    _, dtype, shape, async_op = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    shapes = _coalesced_shapes(shape)
    # inputs[i][r]: tensor i of rank r
    inputs = [
        [random_tensor(s, dtype, "cpu", rank_seed(seed + i, r), nranks=world) for r in range(world)]
        for i, s in enumerate(shapes)
    ]
    tensors = [per_rank[rank].to(dev) for per_rank in inputs]
    outputs = [
        [poison_(torch.empty(s, dtype=dtype, device=dev)) for s in shapes] for _ in range(world)
    ]
    what = f"all_gather_coalesced {dtype_id(dtype)} shapes={shapes} async_op={async_op}"
    issue(dist.all_gather_coalesced, outputs, tensors, async_op=async_op)
    # gloo runs before any check: a rank whose check fails must not skip a collective.
    on_cpu = None
    if gloo_moves(dtype):
        on_cpu = [[poison_(torch.empty(s, dtype=dtype)) for s in shapes] for _ in range(world)]
        dist.all_gather_coalesced(on_cpu, [per_rank[rank].clone() for per_rank in inputs])
    for i in range(len(shapes)):
        check_untouched(tensors[i], inputs[i][rank], f"{what}: input {i}")
        for r in range(world):
            check_exact(outputs[r][i], inputs[i][r], seed, world, f"{what}: rank {r} tensor {i}")
            if on_cpu is not None:
                check_exact(outputs[r][i], on_cpu[r][i], seed, world, f"{what}: [{r}][{i}] gloo")


def _check(case, seed, ctx):
    if case[0] == "coalesced":
        _check_all_gather_coalesced(case, seed, ctx)
    else:
        _check_all_gather(case, seed, ctx)


_KIND_SHAPES = {
    "even": SHAPES,
    "uneven": ((0,), (1001,)),
    "coalesced": ((), (1001,), (SHAPES[-1][0],)),
}


@pytest.mark.parametrize("kind", list(_KIND_SHAPES))
def test_all_gather(rank_pool, kind):
    cases = [
        (kind, dtype, shape, async_op)
        for dtype in DTYPES
        for shape in _KIND_SHAPES[kind]
        for async_op in (False, True)
    ]
    run_batch(rank_pool, _check, cases, f"all_gather ({kind})")
