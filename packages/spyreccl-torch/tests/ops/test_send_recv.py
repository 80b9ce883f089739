"""Point-to-point: dist.send/recv between every ordered pair of ranks, isend/irecv, receives
from any source, batch_isend_irecv rings (one and two directions) and in-order tags, for every
dtype and sizes from empty to many staging chunks. Received tensors are poisoned first and must
be bit-exact; sent tensors are only read."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ops_support import (
    DTYPES,
    LARGE,
    POOL_OPTIONS,
    RUN_TIMEOUT,
    SIZES,
    DeferredChecks,
    assert_ranks_passed,
    check_exact,
    check_untouched,
    device,
    dtype_id,
    run_cases,
)

from spyreccl_testing.inputs import fresh_seed, poison_, random_tensor, rank_seed

pytestmark = pytest.mark.rank_pool_options(**POOL_OPTIONS)


def _message(seed, size, dtype, sender, receiver, world):
    """What `sender` sends to `receiver` in a case (any rank can rebuild it)."""
    return random_tensor(size, dtype, "cpu", rank_seed(seed + receiver, sender), nranks=world)


def _expect(condition, message):
    assert condition, message


def _check_pairs(case, seed, ctx):
    """Blocking send/recv (or isend/irecv) for every ordered pair, one pair at a time."""
    kind, dtype, size = case
    world, rank = ctx.world_size, ctx.rank
    with DeferredChecks() as check:
        for src in range(world):
            for dst in range(world):
                if src != dst and rank in (src, dst):
                    _transfer(kind, dtype, size, src, dst, seed, ctx, check)


def _transfer(kind, dtype, size, src, dst, seed, ctx, check):
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    what = f"{kind} {dtype_id(dtype)} size={size} {src}->{dst}"
    tag = 7 * src + dst
    message = _message(seed, size, dtype, src, dst, world)
    if rank == src:
        tensor = message.to(dev)
        if kind == "send/recv":
            dist.send(tensor, dst=dst, tag=tag)
        else:
            work = dist.isend(tensor, dst=dst, tag=tag)
            work.wait()
            check(_expect, work.is_completed(), f"{what}: isend Work not completed after wait")
        check(check_untouched, tensor, message, f"{what}: sent tensor")
    else:
        tensor = poison_(torch.empty(size, dtype=dtype, device=dev))
        if kind == "send/recv":
            sender = dist.recv(tensor, src=src, tag=tag)
            check(_expect, sender == src, f"{what}: recv returned sender {sender}")
        else:
            work = dist.irecv(tensor, src=src, tag=tag)
            work.wait()
        check(check_exact, tensor, message, seed, world, what)


def _check_any_source(case, seed, ctx):
    """Rank 0 receives one message from every other rank, in whatever order they arrive."""
    _, dtype, size = case
    try:
        _receive_from_all(dtype, size, seed, ctx)
    finally:
        # A sender must not run ahead into the next case: rank 0's next any-source receive
        # would otherwise see that message (another size) while one of this case is pending.
        dist.barrier()


def _receive_from_all(dtype, size, seed, ctx):
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    if rank != 0:
        dist.send(_message(seed, size, dtype, rank, 0, world).to(dev), dst=0, tag=5)
        return
    seen = []
    for _ in range(world - 1):
        tensor = poison_(torch.empty(size, dtype=dtype, device=dev))
        sender = dist.recv(tensor, tag=5)  # src=None: any source
        assert 0 < sender < world, f"recv from any source returned sender {sender}"
        what = f"recv any source {dtype_id(dtype)} size={size} from {sender}"
        check_exact(tensor, _message(seed, size, dtype, sender, 0, world), seed, world, what)
        seen.append(sender)
    assert sorted(seen) == list(range(1, world)), f"senders seen: {seen}"


def _check_ring(case, seed, ctx):
    """batch_isend_irecv: every rank sends to its right neighbour and receives from its left
    one ("ring"), or additionally the other way round in the same batch ("both")."""
    kind, dtype, size = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    right, left = (rank + 1) % world, (rank - 1) % world
    peers = [(right, left)] if kind == "ring" else [(right, left), (left, right)]
    ops, received = [], []
    for direction, (to, frm) in enumerate(peers):
        sent = _message(seed + 1000 * direction, size, dtype, rank, to, world)
        tensor = sent.to(dev)
        out = poison_(torch.empty(size, dtype=dtype, device=dev))
        ops += [dist.P2POp(dist.isend, tensor, to), dist.P2POp(dist.irecv, out, frm)]
        received.append((out, frm, direction, tensor, sent))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for out, frm, direction, tensor, sent in received:
        what = f"batch_isend_irecv ({kind}) {dtype_id(dtype)} size={size} from {frm}"
        check_untouched(tensor, sent, f"{what}: sent tensor")
        expected = _message(seed + 1000 * direction, size, dtype, frm, rank, world)
        check_exact(out, expected, seed, world, what)


def _check_tags(case, seed, ctx):
    """Several messages with different tags between rank 0 and rank 1, received in order."""
    _, dtype, size = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    tags = (0, 3, 1 << 20)
    if rank == 0:
        works = [
            dist.isend(_message(seed + t, size, dtype, 0, 1, world).to(dev), dst=1, tag=t)
            for t in tags
        ]
        for work in works:
            work.wait()
    elif rank == 1:
        with DeferredChecks() as check:
            for t in tags:
                tensor = poison_(torch.empty(size, dtype=dtype, device=dev))
                dist.recv(tensor, src=0, tag=t)
                what = f"tagged recv {dtype_id(dtype)} size={size} tag={t}"
                expected = _message(seed + t, size, dtype, 0, 1, world)
                check(check_exact, tensor, expected, seed, world, what)


_CHECKS = {
    "send/recv": _check_pairs,
    "isend/irecv": _check_pairs,
    "any source": _check_any_source,
    "ring": _check_ring,
    "both": _check_ring,
    "tags": _check_tags,
}


def _check(case, seed, ctx):
    _CHECKS[case[0]](case, seed, ctx)


def run_p2p(cases, base_seed, ctx):
    return run_cases(_check, cases, base_seed, ctx)


@pytest.mark.parametrize("kind", list(_CHECKS))
def test_point_to_point(rank_pool, kind):
    seed = fresh_seed()
    cases = [(kind, dtype, size) for dtype in DTYPES for size in SIZES]
    results = rank_pool.run(run_p2p, cases, seed, timeout=RUN_TIMEOUT)
    assert_ranks_passed(results, seed, kind)


def run_unbatched_ring(size, base_seed, ctx):
    """isend to the right neighbour, then irecv from the left one, outside any batch: the
    usual pipeline-parallel exchange, which gloo completes for any size. A backend that runs
    the isend to completion before starting the irecv deadlocks once the message exceeds the
    point-to-point staging area (every rank waits for its right neighbour to receive)."""
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    right, left = (rank + 1) % world, (rank - 1) % world
    sent = _message(base_seed, size, torch.float32, rank, right, world)
    out = poison_(torch.empty(size, dtype=torch.float32, device=dev))
    send_work = dist.isend(sent.to(dev), dst=right)
    recv_work = dist.irecv(out, src=left)
    send_work.wait()
    recv_work.wait()
    expected = _message(base_seed, size, torch.float32, left, rank, world)
    check_exact(out, expected, base_seed, world, "unbatched isend/irecv ring")
    return []


def test_unbatched_isend_irecv_ring_small(rank_pool):
    seed = fresh_seed()
    # Fits the point-to-point staging area (P2P_CHUNK_BYTES): each isend completes alone.
    results = rank_pool.run(run_unbatched_ring, 1001, seed, timeout=RUN_TIMEOUT)
    assert_ranks_passed(results, seed, "unbatched isend/irecv ring (small)")


def _check_unbatched(case, seed, ctx):
    """Unbatched isend/irecv that only complete if the backend keeps several point-to-point
    operations in flight at once (NCCL and gloo do): "ring" and "ring, recv waited first"
    (isend right, irecv left), "both ways" (isend right and left, then irecv left and right),
    and "across a collective" (rank 0 posts irecv from rank 1 and joins an all_reduce; rank 1
    first completes a blocking send to rank 0, then joins the all_reduce)."""
    kind, dtype, size = case
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    right, left = (rank + 1) % world, (rank - 1) % world
    what = f"unbatched {kind} {dtype_id(dtype)} size={size}"
    if kind == "across a collective":
        _check_across_collective(dtype, size, seed, ctx, what)
        return
    peers = [(right, left)] if kind != "both ways" else [(right, left), (left, right)]
    sends, recvs = [], []
    for direction, (to, _) in enumerate(peers):
        sent = _message(seed + 1000 * direction, size, dtype, rank, to, world)
        tensor = sent.to(dev)
        sends.append((dist.isend(tensor, dst=to, tag=direction), tensor, sent))
    for direction, (_, frm) in enumerate(peers):
        out = poison_(torch.empty(size, dtype=dtype, device=dev))
        recvs.append((dist.irecv(out, src=frm, tag=direction), out, frm, direction))
    works = [w for w, *_ in sends] + [w for w, *_ in recvs]
    for work in reversed(works) if kind == "ring, recv waited first" else works:
        work.wait()
    for _, tensor, sent in sends:
        check_untouched(tensor, sent, f"{what}: sent tensor")
    for _, out, frm, direction in recvs:
        expected = _message(seed + 1000 * direction, size, dtype, frm, rank, world)
        check_exact(out, expected, seed, world, f"{what} from {frm}")


def _check_across_collective(dtype, size, seed, ctx, what):
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    vec = random_tensor(1000, torch.float64, "cpu", rank_seed(seed, rank), nranks=world)
    expected_sum = sum(
        random_tensor(1000, torch.float64, "cpu", rank_seed(seed, r), nranks=world)
        for r in range(world)
    )
    summed = vec.to(dev)
    if rank == 0:
        out = poison_(torch.empty(size, dtype=dtype, device=dev))
        work = dist.irecv(out, src=1)
        dist.all_reduce(summed)
        work.wait()
        check_exact(out, _message(seed, size, dtype, 1, 0, world), seed, world, what)
    else:
        if rank == 1:
            dist.send(_message(seed, size, dtype, 1, 0, world).to(dev), dst=0)
        dist.all_reduce(summed)
    torch.testing.assert_close(
        summed.cpu(), expected_sum, rtol=1e-12, atol=1e-9, msg=lambda m: f"{what}: {m}"
    )


def run_unbatched(cases, base_seed, ctx):
    return run_cases(_check_unbatched, cases, base_seed, ctx)


_UNBATCHED = ("ring", "ring, recv waited first", "both ways", "across a collective")


@pytest.mark.parametrize("kind", _UNBATCHED)
def test_unbatched_isend_irecv_large(rank_pool, kind):
    seed = fresh_seed()
    # Several staging chunks per message, every dtype, and an odd size: before the progress
    # thread kept sends in flight, each of these deadlocked until the group timeout.
    cases = [(kind, dtype, size) for dtype in DTYPES for size in (LARGE, 3 * LARGE + 1)]
    results = rank_pool.run(run_unbatched, cases, seed, timeout=RUN_TIMEOUT)
    assert_ranks_passed(results, seed, f"unbatched isend/irecv ({kind})")
