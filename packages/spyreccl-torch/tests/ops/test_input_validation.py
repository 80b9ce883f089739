"""Argument validation: every invalid call must raise on the calling rank - before anything is
communicated - with a message that names the problem, and the group must stay usable
afterwards (each rejection is followed by a checked all_reduce). Every rank makes the same
invalid call, so no rank is left waiting in a collective.

Also: what must *work* although it is unusual - non-contiguous tensors (staged by the backend),
views with a storage offset (a slice of a larger tensor; the rest must stay untouched) and a
tensor on a spyre index other than the rank's current device.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from _ops_support import (
    SHARED_POOL_OPTIONS,
    check_exact,
    check_result,
    check_untouched,
    device,
    expect_rejection,
    rank_inputs,
    run_batch,
)

from spyreccl_testing.accuracy import reference_reduce
from spyreccl_testing.inputs import poison_

pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)

CPU_MESSAGE = (
    "spyreccl handles spyre tensors only; for CPU tensors use "
    "init_process_group('cpu:gloo,spyre:spyreccl')"
)


def _backend():
    return dist.group.WORLD._get_backend(torch.device("spyre"))


def _group_usable(ctx, what):
    tensor = torch.full((7,), float(ctx.rank + 1), device=device(ctx))
    dist.all_reduce(tensor)
    expected = float(sum(range(1, ctx.world_size + 1)))
    assert tensor.cpu().tolist() == [expected] * 7, f"after {what}: the group no longer works"


def _rejects(ctx, what, pattern, call, literal=False):
    """`call` raises with `pattern` (a regex, or a literal substring); the group still works."""
    expect_rejection(call, re.escape(pattern) if literal else pattern, what)
    _group_usable(ctx, what)


# -- rejections -----------------------------------------------------------------------------


def check_cpu_tensors(ctx):
    dev, world = device(ctx), ctx.world_size
    backend = _backend()
    cpu = torch.ones(4)
    spyre = torch.ones(4, device=dev)
    cases = {
        "allreduce": lambda: backend.allreduce([cpu]),
        "broadcast": lambda: backend.broadcast([cpu]),
        "send": lambda: backend.send([cpu], (ctx.rank + 1) % world, 0),
        "_allgather_base (CPU input)": lambda: backend._allgather_base(
            torch.empty(4 * world, device=dev), cpu
        ),
        "alltoall_base (CPU output)": lambda: backend.alltoall_base(
            torch.empty(world, 4), torch.ones(world, 4, device=dev), [], []
        ),
        "allgather (CPU output in the list)": lambda: backend.allgather(
            [[torch.empty(4)] + [torch.empty(4, device=dev)] * (world - 1)], [spyre]
        ),
    }
    for name, call in cases.items():
        _rejects(ctx, f"CPU tensor to {name}", CPU_MESSAGE, call, literal=True)


def check_dtype_mismatch(ctx):
    dev, world = device(ctx), ctx.world_size
    f32 = torch.ones(6, device=dev)
    f64 = torch.ones(6 * world, dtype=torch.float64, device=dev)
    _rejects(
        ctx,
        "all_gather_single with float64 output and float32 input",
        r"has dtype torch\.float64 but '\w+' has dtype torch\.float32",
        lambda: dist.all_gather_single(f64, f32),
    )
    _rejects(
        ctx,
        "reduce_scatter_single with float32 output and float64 input",
        r"dtype torch\.float(32|64) but '\w+' has dtype torch\.float(32|64)",
        lambda: dist.reduce_scatter_single(f32, f64),
    )
    outputs = [torch.empty(6, device=dev) for _ in range(world)]
    outputs[-1] = torch.empty(6, dtype=torch.int32, device=dev)
    # torch's front end already refuses this one; the backend's own check is called directly.
    _rejects(
        ctx,
        "all_gather with an int32 block among float32 blocks",
        r"different dtypes",
        lambda: dist.all_gather(outputs, f32),
    )
    _rejects(
        ctx,
        "backend allgather with an int32 block among float32 blocks",
        r"has dtype torch\.int32 but 'inputTensors\[0\]' has dtype torch\.float32",
        lambda: _backend().allgather([outputs], [f32]),
    )
    _rejects(
        ctx,
        "all_to_all_single with mismatched dtypes",
        r"different dtypes",
        lambda: dist.all_to_all_single(
            torch.empty(world, dtype=torch.int64, device=dev), torch.ones(world, device=dev)
        ),
    )
    _rejects(
        ctx,
        "backend alltoall_base with mismatched dtypes",
        r"'outputBuffer' has dtype torch\.int64 but 'inputBuffer' has dtype torch\.float32",
        lambda: _backend().alltoall_base(
            torch.empty(world, dtype=torch.int64, device=dev), torch.ones(world, device=dev), [], []
        ),
    )


def check_unsupported_reduction_dtype(ctx):
    dev = device(ctx)
    tensor = torch.zeros(5, dtype=torch.uint16, device=dev)
    _rejects(
        ctx,
        "all_reduce on uint16",
        r"torch\.uint16, which spyreccl cannot reduce",
        lambda: dist.all_reduce(tensor),
    )
    # Data movement of such a dtype is fine (moved as bytes).
    dist.broadcast(tensor, src=0)


def check_wrong_sizes(ctx):
    dev, world = device(ctx), ctx.world_size
    tensor = torch.ones(6, device=dev)
    _rejects(
        ctx,
        "all_gather_single into an output one element too large",
        r"has \d+ elements \(shape \[\d+\]\), expected \d+",
        lambda: dist.all_gather_single(torch.empty(6 * world + 1, device=dev), tensor),
    )
    _rejects(
        ctx,
        "reduce_scatter_single from an input one element too small",
        r"has \d+ elements \(shape \[\d+\]\), expected \d+",
        lambda: dist.reduce_scatter_single(tensor, torch.ones(6 * world - 1, device=dev)),
    )
    _rejects(
        ctx,
        "all_gather into a list one tensor short",
        r"must hold \d+ tensors \(one per rank\), got \d+",
        lambda: dist.all_gather([torch.empty(6, device=dev)] * (world - 1), tensor),
    )
    own_block = [torch.empty(6, device=dev) for _ in range(world)]
    own_block[ctx.rank] = torch.empty(5, device=dev)
    _rejects(
        ctx,
        "all_gather whose own block has the wrong size",
        r"receives this rank's own 'inputTensors\[0\]'",
        lambda: dist.all_gather(own_block, tensor),
    )
    _rejects(
        ctx,
        "all_to_all_single without splits on rows the group size does not divide",
        r"which the group size \d+ does not divide",
        lambda: dist.all_to_all_single(
            torch.empty(world + 1, device=dev), torch.ones(world + 1, device=dev)
        ),
    )


def check_invalid_roots_and_peers(ctx):
    dev, world, rank = device(ctx), ctx.world_size, ctx.rank
    backend = _backend()
    tensor = torch.ones(3, device=dev)
    options = dist.BroadcastOptions()
    options.rootRank = world
    _rejects(
        ctx,
        "backend broadcast with rootRank == world size",
        rf"'rootRank' is {world}, expected a rank of the group in \[0, {world}\)",
        lambda: backend.broadcast([tensor], options),
    )
    options = dist.ReduceOptions()
    options.rootRank = -1
    _rejects(
        ctx,
        "backend reduce with rootRank -1",
        r"'rootRank' is -1, expected a rank of the group",
        lambda: backend.reduce([tensor], options),
    )
    _rejects(
        ctx,
        "dist.broadcast from a rank outside the group",
        r".",
        lambda: dist.broadcast(tensor, src=world),
    )
    _rejects(
        ctx,
        "backend send to a rank outside the group",
        rf"'dstRank' is {world + 6}, expected a rank of the group",
        lambda: backend.send([tensor], world + 6, 0),
    )
    _rejects(
        ctx,
        "backend recv from -1",
        r"'srcRank' is -1, expected a rank of the group",
        lambda: backend.recv([tensor], -1, 0),
    )
    _rejects(
        ctx,
        "backend send to itself",
        r"sending to oneself is not supported",
        lambda: backend.send([tensor], rank, 0),
    )
    _rejects(ctx, "dist.send to itself", r".", lambda: dist.send(tensor, dst=rank))


def check_invalid_split_sizes(ctx):
    dev, world = device(ctx), ctx.world_size
    rows = 2 * world
    send = torch.ones(rows, 3, device=dev)
    recv = torch.empty(rows, 3, device=dev)
    even = [2] * world
    _rejects(
        ctx,
        "input_split_sizes summing to more rows than the input has",
        r"'inputSplitSizes' sums to \d+ rows but 'inputBuffer' has \d+ rows",
        lambda: dist.all_to_all_single(recv, send, even, [3] + [2] * (world - 1)),
    )
    _rejects(
        ctx,
        "a negative output split size",
        r"'outputSplitSizes\[0\]' is -1, expected a non-negative number of rows",
        lambda: dist.all_to_all_single(recv, send, [-1, 3] + [2] * (world - 2), even),
    )
    _rejects(
        ctx,
        "split sizes with one entry per rank missing",
        r"must hold \d+ split sizes \(one per rank\)",
        lambda: dist.all_to_all_single(recv, send, even, [2 * world]),
    )


def check_devices_of_one_call(ctx):
    dev = device(ctx)
    count = torch.spyre.device_count()
    other = torch.device("spyre", (dev.index + 1) % count)
    _rejects(
        ctx,
        "all_gather_single with input and output on different spyre devices",
        r"all tensors of one call must be on the same spyre device",
        lambda: dist.all_gather_single(
            torch.empty(4 * ctx.world_size, device=dev), torch.ones(4, device=other)
        ),
    )


# -- unusual but valid ----------------------------------------------------------------------


def check_other_spyre_index(ctx, seed):
    """A collective on tensors of a spyre device that is not the rank's current one."""
    world, rank = ctx.world_size, ctx.rank
    other = torch.device("spyre", (device(ctx).index + 1) % torch.spyre.device_count())
    inputs = rank_inputs(seed, (1001,), torch.float32, world)
    tensor = inputs[rank].to(other)
    dist.all_reduce(tensor)
    assert tensor.device == other, f"result moved to {tensor.device}"
    expected = reference_reduce(inputs, "sum", torch.float32)
    check_result(tensor, expected, torch.float32, world, seed, "all_reduce on another spyre index")


def check_non_contiguous(ctx, seed):
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    # all_reduce of a transposed (non-contiguous) tensor.
    inputs = rank_inputs(seed, (37, 29), torch.float64, world)
    tensor = inputs[rank].to(dev).t()
    assert not tensor.is_contiguous()
    dist.all_reduce(tensor)
    expected = reference_reduce(inputs, "sum", torch.float64).t()
    check_result(tensor, expected, torch.float64, world, seed, "all_reduce of a transposed tensor")
    # broadcast into every other element of a larger tensor: the gaps stay poisoned.
    blocks = rank_inputs(seed, (501,), torch.int32, world, salt=1)
    host = poison_(torch.empty(1002, dtype=torch.int32, device=dev))
    target = host[::2] if rank != 0 else blocks[0].to(dev)
    dist.broadcast(target, src=0)
    check_exact(target, blocks[0], seed, world, "broadcast into a strided view")
    if rank != 0:
        check_untouched(host[1::2], poison_(torch.empty(501, dtype=torch.int32)), "the gaps")
    # all_gather from a non-contiguous input into non-contiguous outputs.
    sources = rank_inputs(seed, (6, 5), torch.bfloat16, world, salt=2)
    outputs = [
        poison_(torch.empty(5, 6, dtype=torch.bfloat16, device=dev)).t() for _ in range(world)
    ]
    dist.all_gather(outputs, sources[rank].to(dev).t().contiguous().t())
    for r in range(world):
        check_exact(outputs[r], sources[r], seed, world, f"all_gather non-contiguous block {r}")
    # reduce_scatter_single into a column of a matrix.
    full = rank_inputs(seed, (world * 9,), torch.float32, world, salt=3)
    matrix = poison_(torch.empty(9, 2, device=dev))
    dist.reduce_scatter_single(matrix[:, 1], full[rank].to(dev))
    expected = reference_reduce([x[rank * 9 : (rank + 1) * 9] for x in full], "sum", torch.float32)
    check_result(matrix[:, 1], expected, torch.float32, world, seed, "reduce_scatter into a column")


def check_storage_offset_views(ctx, seed):
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    # all_reduce of a slice: the elements around it keep their values.
    inputs = rank_inputs(seed, (50,), torch.float32, world)
    whole = inputs[rank].to(dev)
    view = whole[10:30]
    assert view.storage_offset() == 10
    dist.all_reduce(view)
    expected = reference_reduce([x[10:30] for x in inputs], "sum", torch.float32)
    check_result(view, expected, torch.float32, world, seed, "all_reduce of a slice")
    check_untouched(whole[:10], inputs[rank][:10], "elements before the slice")
    check_untouched(whole[30:], inputs[rank][30:], "elements after the slice")
    # all_gather_single from a slice into a slice of a poisoned buffer.
    src = rank_inputs(seed, (40,), torch.int16, world, salt=1)
    buffer = poison_(torch.empty(3 + world * 17 + 5, dtype=torch.int16, device=dev))
    out = buffer[3 : 3 + world * 17]
    dist.all_gather_single(out, src[rank].to(dev)[7:24])
    check_exact(out, torch.cat([x[7:24] for x in src]), seed, world, "all_gather_single slices")
    check_untouched(buffer[:3], poison_(torch.empty(3, dtype=torch.int16)), "buffer head")
    # send/recv between slices.
    if world >= 2 and rank < 2:
        message = rank_inputs(seed, (64,), torch.uint8, world, salt=2)[0]
        if rank == 0:
            dist.send(message.to(dev)[16:48], dst=1)
        else:
            box = poison_(torch.empty(64, dtype=torch.uint8, device=dev))
            dist.recv(box[8:40], src=0)
            check_exact(box[8:40], message[16:48], seed, world, "recv into a slice")


_REJECTIONS = {
    "cpu tensors": check_cpu_tensors,
    "dtype mismatch": check_dtype_mismatch,
    "unsupported reduction dtype": check_unsupported_reduction_dtype,
    "wrong sizes": check_wrong_sizes,
    "invalid roots and peers": check_invalid_roots_and_peers,
    "invalid split sizes": check_invalid_split_sizes,
    "devices of one call": check_devices_of_one_call,
}
_VALID = {
    "other spyre index": check_other_spyre_index,
    "non-contiguous": check_non_contiguous,
    "storage offset views": check_storage_offset_views,
}


def _check(case, seed, ctx):
    (name,) = case
    if name in _REJECTIONS:
        _REJECTIONS[name](ctx)
    else:
        _VALID[name](ctx, seed)
        _group_usable(ctx, name)


@pytest.mark.parametrize("name", list(_REJECTIONS) + list(_VALID))
def test_input_validation(rank_pool, name):
    run_batch(rank_pool, _check, [(name,)], name)
