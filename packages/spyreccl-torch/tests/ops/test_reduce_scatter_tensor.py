"""Reduce-scatters between single tensors: dist.reduce_scatter_tensor (concatenated and
stacked input layouts), dist.reduce_scatter_single (new in torch 2.13), the in-place form
(the output is this rank's slice of the input) and the coalesced form (several
reduce_scatter_tensor calls in a _coalescing_manager become one
reduce_scatter_tensor_coalesced). The concatenated form runs the whole dtype x op matrix;
the other forms run it for SUM, MAX and PREMUL_SUM (rejected on integers, except in the
coalesced form, see below)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from _ops_support import (
    LARGE,
    REDUCE_OPS,
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

_SHAPES = ((0,), (1,), (7, 11, 13), (LARGE,))
_SECONDARY_OPS = ("SUM", "MAX", "PREMUL_SUM")


def _reduce_scatter_tensor(output, tensor, **kwargs):
    # Deprecated in torch 2.13 in favour of reduce_scatter_single; still widely called.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dist.reduce_scatter_tensor(output, tensor, **kwargs)


def _input_shape(kind, shape, world):
    if kind == "stacked":
        return (world, *shape)
    return (world * shape[0], *shape[1:])


def _block(kind, full, rank, shape):
    """Rank `rank`'s block of an input in the layout of `kind`."""
    if kind == "stacked":
        return full[rank]
    return full.narrow(0, rank * shape[0], shape[0])


def _check(case, seed, ctx):
    kind, dtype, op, shape, async_op = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    factor = premul_factor(seed) if op == "PREMUL_SUM" else None
    what = f"reduce_scatter ({kind}) {op} {dtype_id(dtype)} shape={shape} async_op={async_op}"
    if kind == "coalesced":
        _check_coalesced(dtype, op, factor, shape, async_op, seed, ctx, what)
        return
    inputs = rank_inputs(seed, _input_shape(kind, shape, world), dtype, world)
    tensor = inputs[rank].to(dev)
    if kind == "in_place":
        output = _block(kind, tensor, rank, shape)
    else:
        output = poison_(torch.empty(shape, dtype=dtype, device=dev))
    scatter = dist.reduce_scatter_single if kind == "single" else _reduce_scatter_tensor
    if not reduction_valid(dtype, op):
        expect_rejection(
            lambda: scatter(output, tensor, op=dist_op(op, factor), async_op=async_op),
            rejection_pattern(dtype, op),
            what,
        )
        return
    issue(scatter, output, tensor, op=dist_op(op, factor), async_op=async_op)
    # gloo (concatenated layout only) runs before any check: a rank whose check fails must not
    # skip a collective.
    on_cpu = None
    if kind != "stacked" and gloo_reduces(dtype, op):
        on_cpu = poison_(torch.empty(shape, dtype=dtype))
        _reduce_scatter_tensor(on_cpu, inputs[rank].clone(), op=dist_op(op))
    if kind != "in_place":
        check_untouched(tensor, inputs[rank], f"{what}: input")
    expected = reference_reduce(
        [_block(kind, x, rank, shape) for x in inputs], reference_op(op, factor), dtype
    )
    check_result(output, expected, dtype, world, seed, what, op)
    if on_cpu is not None:
        check_gloo(output, on_cpu, dtype, world, seed, what, op)


def _check_coalesced(dtype, op, factor, shape, async_op, seed, ctx, what):
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    shapes = [shape, (3, 5), (0,)]
    inputs = [
        rank_inputs(seed, _input_shape("concat", s, world), dtype, world, salt=i)
        for i, s in enumerate(shapes)
    ]
    tensors = [per_rank[rank].to(dev) for per_rank in inputs]
    outputs = [poison_(torch.empty(s, dtype=dtype, device=dev)) for s in shapes]

    with dist._coalescing_manager(device=dev, async_ops=async_op) as manager:
        for output, tensor in zip(outputs, tensors):
            _reduce_scatter_tensor(output, tensor, op=dist_op(op, factor))
    if async_op:
        manager.wait()
    for i, s in enumerate(shapes):
        check_untouched(tensors[i], inputs[i][rank], f"{what}: input {i}")
        expected = reference_reduce(
            [_block("concat", x, rank, s) for x in inputs[i]], reference_op(op, factor), dtype
        )
        check_result(outputs[i], expected, dtype, world, seed, f"{what}: output {i}", op)


@pytest.mark.parametrize("dtype", dtype_params())
def test_reduce_scatter_tensor(rank_pool, dtype):
    cases = [("concat", *c) for c in reduce_cases(dtype, REDUCE_OPS, _SHAPES)]
    for kind in ("stacked", "in_place"):
        cases += [(kind, *c) for c in reduce_cases(dtype, _SECONDARY_OPS, _SHAPES)]
    # Only valid ops inside the coalescing manager: torch's _coalescing_manager has no
    # try/finally, so an operation rejected inside it leaves the batch open on the group
    # (torch's bookkeeping and the backend's), and every later collective of the group is
    # swallowed into that batch.
    valid = [op for op in _SECONDARY_OPS if reduction_valid(dtype, op)]
    cases += [("coalesced", *c) for c in reduce_cases(dtype, valid, _SHAPES)]
    run_batch(rank_pool, _check, cases, f"reduce_scatter into tensor {dtype_id(dtype)}")


@pytest.mark.skipif(
    not hasattr(dist, "reduce_scatter_single"),
    reason=f"dist.reduce_scatter_single is new in torch 2.13 (this is {torch.__version__})",
)
@pytest.mark.parametrize("dtype", dtype_params())
def test_reduce_scatter_single(rank_pool, dtype):
    cases = [("single", *c) for c in reduce_cases(dtype, _SECONDARY_OPS, _SHAPES)]
    run_batch(rank_pool, _check, cases, f"reduce_scatter_single {dtype_id(dtype)}")
