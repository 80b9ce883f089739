"""dist.all_to_all (list form): rank p sends its q-th input tensor to rank q, which receives it
as its p-th output. Block sizes differ per (sender, receiver) pair, empty blocks included;
outputs are poisoned before the call and must be bit-exact, inputs are only read."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ops_support import (
    DTYPES,
    LARGE,
    SHARED_POOL_OPTIONS,
    check_exact,
    check_untouched,
    device,
    dtype_id,
    issue,
    run_batch,
)

from spyreccl_testing.inputs import poison_, random_tensor, rank_seed

pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)


def _block_shape(base, tail, sender, receiver, world, uneven):
    rows = base + ((sender * world + receiver) % 3 if uneven else 0)
    return (rows, *tail)


def _block(seed, shape, dtype, sender, receiver, world):
    """The tensor `sender` sends to `receiver` (any rank can rebuild it)."""
    return random_tensor(shape, dtype, "cpu", rank_seed(seed + receiver, sender), nranks=world)


def _check_all_to_all(case, seed, ctx):
    dtype, base, tail, uneven, async_op = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)

    def shape(sender, receiver):
        return _block_shape(base, tail, sender, receiver, world, uneven)

    sent = [_block(seed, shape(rank, q), dtype, rank, q, world) for q in range(world)]
    inputs = [t.to(dev) for t in sent]
    outputs = [poison_(torch.empty(shape(p, rank), dtype=dtype, device=dev)) for p in range(world)]
    what = (
        f"all_to_all {dtype_id(dtype)} rows={base}{'+uneven' if uneven else ''} tail={tail} "
        f"async_op={async_op}"
    )
    issue(dist.all_to_all, outputs, inputs, async_op=async_op)
    for q in range(world):
        check_untouched(inputs[q], sent[q], f"{what}: input {q}")
    for p in range(world):
        expected = _block(seed, shape(p, rank), dtype, p, rank, world)
        check_exact(outputs[p], expected, seed, world, f"{what}: block from rank {p}")


# (rows per block, trailing shape, uneven): empty, single, odd 2-d rows, beyond the chunk.
_LAYOUTS = ((0, (), True), (1, (), False), (143, (7,), True), (LARGE // 3, (3,), True))


def test_all_to_all(rank_pool):
    cases = [
        (dtype, base, tail, uneven, async_op)
        for dtype in DTYPES
        for base, tail, uneven in _LAYOUTS
        for async_op in (False, True)
    ]
    run_batch(rank_pool, _check_all_to_all, cases, "all_to_all")
