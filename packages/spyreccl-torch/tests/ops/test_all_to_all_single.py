"""dist.all_to_all_single: equal splits, random split sizes (zeros included) along dim 0 of
tensors with trailing dimensions, and the aliasing form (output and input are the same
tensor, which the backend must snapshot because the core's all-to-all is not in place)."""

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
    gloo_moves,
    issue,
    run_batch,
)

from spyreccl_testing.inputs import poison_, random_tensor, rank_seed

pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)


def _split_matrix(kind, seed, rows, world):
    """rows_sent[p][q]: rows rank p sends to rank q (all ranks derive the same matrix)."""
    if kind != "splits":
        return [[rows] * world for _ in range(world)]
    gen = torch.Generator().manual_seed(seed)
    # 0 .. 2*rows rows per pair: about a third of the pairs are empty for small `rows`.
    drawn = torch.randint(0, 2 * rows + 1, (world, world), generator=gen)
    drawn[torch.rand((world, world), generator=gen) < 0.25] = 0
    return drawn.tolist()


def _check(case, seed, ctx):
    kind, dtype, rows, tail, async_op = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    matrix = _split_matrix(kind, seed, rows, world)
    send_rows = [sum(matrix[p]) for p in range(world)]
    inputs = [
        random_tensor((send_rows[p], *tail), dtype, "cpu", rank_seed(seed, p), nranks=world)
        for p in range(world)
    ]
    # What rank `rank` receives: from every p, rows [start, start + matrix[p][rank]) of p's input.
    pieces = []
    for p in range(world):
        start = sum(matrix[p][:rank])
        pieces.append(inputs[p].narrow(0, start, matrix[p][rank]))
    expected = torch.cat(pieces)
    in_splits = matrix[rank] if kind == "splits" else None
    out_splits = [matrix[p][rank] for p in range(world)] if kind == "splits" else None
    what = f"all_to_all_single ({kind}) {dtype_id(dtype)} rows={rows} tail={tail} async={async_op}"
    if kind == "aliased":
        tensor = inputs[rank].to(dev)
        issue(dist.all_to_all_single, tensor, tensor, async_op=async_op)
        check_exact(tensor, expected, seed, world, what)
        return
    tensor = inputs[rank].to(dev)
    output = poison_(torch.empty(expected.shape, dtype=dtype, device=dev))
    issue(
        dist.all_to_all_single,
        output,
        tensor,
        output_split_sizes=out_splits,
        input_split_sizes=in_splits,
        async_op=async_op,
    )
    # gloo runs before any check: a rank whose check fails must not skip a collective.
    on_cpu = None
    if gloo_moves(dtype):
        on_cpu = poison_(torch.empty(expected.shape, dtype=dtype))
        dist.all_to_all_single(
            on_cpu,
            inputs[rank].clone(),
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
        )
    check_untouched(tensor, inputs[rank], f"{what}: input")
    check_exact(output, expected, seed, world, what)
    if on_cpu is not None:
        check_exact(output, on_cpu, seed, world, f"{what} vs gloo")


# (rows per rank pair, trailing shape); the last one is beyond the staging chunk.
_LAYOUTS = {
    "equal": ((0, ()), (1, ()), (143, (7,)), (LARGE // 3, ())),
    "splits": ((1, ()), (67, (3,)), (LARGE // 4, ())),
    "aliased": ((1, ()), (143, (7,))),
}


@pytest.mark.parametrize("kind", list(_LAYOUTS))
def test_all_to_all_single(rank_pool, kind):
    cases = [
        (kind, dtype, rows, tail, async_op)
        for dtype in DTYPES
        for rows, tail in _LAYOUTS[kind]
        for async_op in (False, True)
    ]
    run_batch(rank_pool, _check, cases, f"all_to_all_single ({kind})")
