"""Coalescing: torch.distributed._coalescing_manager around several all_reduces (one
allreduce_coalesced), around broadcasts (the backend's own startCoalescing/endCoalescing
batch: one Work for everything), and batched point-to-point (batch_isend_irecv with
messages to and from every peer at once, mixed dtypes and sizes beyond the staging area)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ops_support import (
    LARGE,
    POOL_OPTIONS,
    RUN_TIMEOUT,
    assert_ranks_passed,
    check_exact,
    check_result,
    device,
    dtype_id,
    rank_inputs,
    run_cases,
)

from spyreccl_testing.accuracy import reference_reduce
from spyreccl_testing.inputs import fresh_seed, poison_, random_tensor, rank_seed

pytestmark = pytest.mark.rank_pool_options(**POOL_OPTIONS)

# (dtype, shape) of the tensors reduced in one coalesced all_reduce: mixed sizes, an empty one.
_ALL_REDUCE_SET = [
    (torch.float32, (1001,)),
    (torch.float32, (0,)),
    (torch.float32, (LARGE,)),
    (torch.float32, (3, 5)),
]


def _check_all_reduce_coalesced(case, seed, ctx):
    _, op, async_op = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    inputs = [rank_inputs(seed, s, d, world, salt=i) for i, (d, s) in enumerate(_ALL_REDUCE_SET)]
    tensors = [per_rank[rank].to(dev) for per_rank in inputs]
    with dist._coalescing_manager(device=dev, async_ops=async_op) as manager:
        for tensor in tensors:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    if async_op:
        manager.wait()
    for i, (tensor, per_rank) in enumerate(zip(tensors, inputs)):
        what = f"coalesced all_reduce {op} async={async_op} tensor {i}"
        expected = reference_reduce(per_rank, op.lower(), tensor.dtype)
        check_result(tensor, expected, tensor.dtype, world, seed, what, op)


# Broadcasts batched by the backend itself (torch coalesces only same-type all_reduce /
# all_gather / reduce_scatter calls; anything else inside the manager goes to the backend's
# startCoalescing/endCoalescing batch): (dtype, numel, root).
_BROADCASTS = ((torch.bfloat16, 777, 0), (torch.int32, LARGE, -1), (torch.float64, 129, 1))


def _check_mixed(case, seed, ctx):
    """Broadcasts of different dtypes, sizes and roots in one backend batch, completed by one
    Work. `inner_async`: how the operations inside the block are called (torch waits on the
    Work of synchronous ones right away)."""
    _, inner_async, async_op = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    sources, tensors = [], []
    for i, (dtype, numel, root) in enumerate(_BROADCASTS):
        root %= world
        source = rank_inputs(seed, (numel,), dtype, world, salt=i)[root]
        sources.append(source)
        if rank == root:
            tensors.append(source.to(dev))
        else:
            tensors.append(poison_(torch.empty(numel, dtype=dtype, device=dev)))
    with dist._coalescing_manager(device=dev, async_ops=async_op) as manager:
        for tensor, (_, _, root) in zip(tensors, _BROADCASTS):
            dist.broadcast(tensor, src=root % world, async_op=inner_async)
    if async_op:
        manager.wait()
    for tensor, source, (dtype, numel, root) in zip(tensors, sources, _BROADCASTS):
        what = f"batched broadcast {dtype} numel={numel} root={root % world} async={async_op}"
        check_exact(tensor, source, seed, world, what)


# (dtype, numel) of the message to each peer in the all-pairs batch; sizes depend on the pair.
_P2P_DTYPES = (torch.float16, torch.int64, torch.bool, torch.float8_e4m3fn)


def _pair_message(seed, sender, receiver, world):
    dtype = _P2P_DTYPES[(sender + receiver) % len(_P2P_DTYPES)]
    numel = (LARGE if (sender + 2 * receiver) % 3 == 0 else 1001) + sender
    return random_tensor(numel, dtype, "cpu", rank_seed(seed + receiver, sender), nranks=world)


def _check_all_pairs(case, seed, ctx):
    """One batch_isend_irecv with a send to and a receive from every other rank, posted in
    an order that deadlocks if the batch were not progressed as a whole (receives first on
    odd ranks, sends first on even ones)."""
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    sends, recvs, received = [], [], []
    for peer in range(world):
        if peer == rank:
            continue
        sends.append(dist.P2POp(dist.isend, _pair_message(seed, rank, peer, world).to(dev), peer))
        like = _pair_message(seed, peer, rank, world)
        out = poison_(torch.empty_like(like, device=dev))
        recvs.append(dist.P2POp(dist.irecv, out, peer))
        received.append((peer, out, like))
    ops = recvs + sends if rank % 2 else sends + recvs
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for peer, out, like in received:
        what = f"all-pairs batch {dtype_id(like.dtype)} numel={like.numel()} from {peer}"
        check_exact(out, like, seed, world, what)


_CHECKS = {
    "all_reduce": _check_all_reduce_coalesced,
    "mixed": _check_mixed,
    "p2p": _check_all_pairs,
}


def _check(case, seed, ctx):
    _CHECKS[case[0]](case, seed, ctx)


def run_coalescing(cases, base_seed, ctx):
    return run_cases(_check, cases, base_seed, ctx)


def test_coalescing_manager_all_reduce(rank_pool):
    seed = fresh_seed()
    cases = [("all_reduce", op, a) for op in ("SUM", "AVG", "MAX") for a in (False, True)]
    assert_ranks_passed(rank_pool.run(run_coalescing, cases, seed, timeout=RUN_TIMEOUT), seed, "")


def test_coalescing_manager_mixed_operations(rank_pool):
    seed = fresh_seed()
    cases = [("mixed", True, a) for a in (False, True, False)]
    assert_ranks_passed(rank_pool.run(run_coalescing, cases, seed, timeout=RUN_TIMEOUT), seed, "")


def test_batched_point_to_point_all_pairs(rank_pool):
    seed = fresh_seed()
    cases = [("p2p", None, None)] * 3
    assert_ranks_passed(rank_pool.run(run_coalescing, cases, seed, timeout=RUN_TIMEOUT), seed, "")


# Synchronous collectives inside _coalescing_manager: torch waits on the Work of each right
# away, before the batch is submitted; like NCCL's, that wait returns at once and the results
# are there once the manager's block ends. Last test of the module: when it fails, torch's
# coalescing state of the group stays open, and the pool (torn down by the failure) is not
# reused.
def test_coalescing_manager_synchronous_operations(rank_pool):
    seed = fresh_seed()
    cases = [("mixed", False, a) for a in (False, True)]
    assert_ranks_passed(rank_pool.run(run_coalescing, cases, seed, timeout=RUN_TIMEOUT), seed, "")
