"""All-gathers into one tensor: dist.all_gather_into_tensor (concatenated and stacked output
layouts), dist.all_gather_single (new in torch 2.13), the in-place form (the input is this
rank's slice of the output) and the coalesced form (several all_gather_into_tensor calls in
a _coalescing_manager become one allgather_into_tensor_coalesced)."""

from __future__ import annotations

import warnings

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
    rank_inputs,
    run_batch,
)

from spyreccl_testing.inputs import poison_

pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)

KINDS = ("concat", "stacked", "single", "in_place", "coalesced")
# Leading dimension first: the concatenated output stacks the ranks' blocks along dim 0.
_SHAPES = ((0,), (1,), (7, 11, 13), (LARGE,))


def _all_gather_into_tensor(output, tensor, **kwargs):
    # Deprecated in torch 2.13 in favour of all_gather_single, but still the API most code
    # calls: it must keep working.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dist.all_gather_into_tensor(output, tensor, **kwargs)


def _output_shape(kind, shape, world):
    if kind == "stacked":
        return (world, *shape)
    return (world * shape[0], *shape[1:])


def _expected(kind, inputs):
    return torch.stack(inputs) if kind == "stacked" else torch.cat(inputs)


def _check_gather_into(case, seed, ctx):
    kind, dtype, shape, async_op = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    what = f"all_gather into tensor ({kind}) {dtype_id(dtype)} shape={shape} async_op={async_op}"
    if kind == "coalesced":
        _check_coalesced(dtype, shape, async_op, seed, ctx, what)
        return
    inputs = rank_inputs(seed, shape, dtype, world)
    output = poison_(torch.empty(_output_shape(kind, shape, world), dtype=dtype, device=dev))
    if kind == "in_place":
        tensor = output.narrow(0, rank * shape[0], shape[0])
        tensor.copy_(inputs[rank])
    else:
        tensor = inputs[rank].to(dev)
    gather = dist.all_gather_single if kind == "single" else _all_gather_into_tensor
    issue(gather, output, tensor, async_op=async_op)
    # gloo (concatenated layout only) runs before any check: a rank whose check fails must not
    # skip a collective.
    on_cpu = None
    if gloo_moves(dtype) and kind != "stacked":
        on_cpu = poison_(torch.empty(output.shape, dtype=dtype))
        _all_gather_into_tensor(on_cpu, inputs[rank].clone())
    check_untouched(tensor, inputs[rank], f"{what}: input")
    check_exact(output, _expected(kind, inputs), seed, world, what)
    if on_cpu is not None:
        check_exact(output, on_cpu, seed, world, f"{what} vs gloo")


def _check_coalesced(dtype, shape, async_op, seed, ctx, what):
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    shapes = [shape, (3, 5), (0,)]
    inputs = [rank_inputs(seed, s, dtype, world, salt=i) for i, s in enumerate(shapes)]
    tensors = [per_rank[rank].to(dev) for per_rank in inputs]
    outputs = [
        poison_(torch.empty(_output_shape("concat", s, world), dtype=dtype, device=dev))
        for s in shapes
    ]
    with dist._coalescing_manager(device=dev, async_ops=async_op) as manager:
        for output, tensor in zip(outputs, tensors):
            _all_gather_into_tensor(output, tensor)
    if async_op:
        manager.wait()
    for i, (output, tensor) in enumerate(zip(outputs, tensors)):
        check_untouched(tensor, inputs[i][rank], f"{what}: input {i}")
        check_exact(output, torch.cat(inputs[i]), seed, world, f"{what}: output {i}")


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            kind,
            marks=pytest.mark.skipif(
                kind == "single" and not hasattr(dist, "all_gather_single"),
                reason=f"dist.all_gather_single is new in torch 2.13 (this is {torch.__version__})",
            ),
        )
        for kind in KINDS
    ],
)
def test_all_gather_into_tensor(rank_pool, kind):
    cases = [
        (kind, dtype, shape, async_op)
        for dtype in DTYPES
        for shape in _SHAPES
        for async_op in (False, True)
    ]
    run_batch(rank_pool, _check_gather_into, cases, f"all_gather into tensor ({kind})")
