"""Collectives issued from a Future's callback, on the thread that completed the Future.

A Work's Future completes on the group's progress thread (or on a thread that ran the
operation itself), and the callbacks chained with ``then()`` run there. Code such as DDP's
PowerSGD hook issues a collective of the same group inside such a callback and waits for it:
``dist.all_reduce(t, async_op=True).get_future().wait()``. Only the progress thread could run
that collective, and it was the thread waiting: both ranks hung in DDP's finalize_backward.
Such a collective now runs on the spot, after everything issued before it.

Every case makes the callback run on the progress thread of rank 0 for certain: the other
ranks join the first collective only after a delay, so rank 0 chains its callback to a
Future that cannot have completed yet (asserted: the callback ran off the main thread).
Results are compared with float64 references, outputs poisoned first.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from spyreccl_testing.accuracy import assert_close_dtype, reference_reduce
from spyreccl_testing.inputs import fresh_seed, poison_, random_tensor, rank_seed

pytestmark = [
    pytest.mark.world_sizes(2, 3),
    pytest.mark.rank_pool_options(backend="cpu:gloo,spyre:spyreccl", set_device=True),
]

RUN_TIMEOUT = 120.0
# The other ranks' delay before the first collective: rank 0 chains its callback well before.
PEER_DELAY_S = 0.3


def _inputs(seed: int, salt: int, numel: int, world: int, dtype=torch.float32):
    return [
        random_tensor((numel,), dtype, "cpu", rank_seed(seed + salt, r), nranks=world)
        for r in range(world)
    ]


def _assert_summed(got: torch.Tensor, inputs: list[torch.Tensor], seed: int, what: str) -> None:
    """`got` is the float32 sum of every rank's `inputs` (float64 reference)."""
    expected = reference_reduce(inputs, "sum", torch.float32)
    assert_close_dtype(got, expected, torch.float32, len(inputs), seed=seed, what=what)


def _first_collective(seed: int, numel: int, ctx):
    """The all_reduce whose Future the callbacks chain to (rank 0 first, the others later)."""
    inputs = _inputs(seed, 0, numel, ctx.world_size)
    if ctx.rank != 0:
        time.sleep(PEER_DELAY_S)
    tensor = inputs[ctx.rank].to(ctx.device)
    return dist.all_reduce(tensor, async_op=True).get_future(), inputs


def run_collectives_inside_a_callback(seed: int, numel: int, ctx) -> None:
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    main = threading.get_ident()
    fut, first = _first_collective(seed, numel, ctx)
    second = _inputs(seed, 1, numel, world)
    third = _inputs(seed, 2, numel, world, torch.bfloat16)
    root_data = _inputs(seed, 3, numel, world, torch.int64)[world - 1]
    gathered = _inputs(seed, 4, numel, world)

    def callback(done: torch.futures.Future) -> dict:
        got = {"thread": threading.get_ident(), "first": done.value()[0].cpu()}
        # Waited through the Future, as DDP's PowerSGD hook does.
        t = second[rank].to(dev)
        got["future_wait"] = dist.all_reduce(t, async_op=True).get_future().wait()[0].cpu()
        # A synchronous call (Work.wait() inside dist.all_reduce).
        t = third[rank].to(dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got["sync"] = t.cpu()
        # An asynchronous one waited through its Work.
        b = (
            root_data.to(dev)
            if rank == world - 1
            else poison_(torch.empty_like(root_data, device=dev))
        )
        dist.broadcast(b, src=world - 1, async_op=True).wait()
        got["broadcast"] = b.cpu()
        out = poison_(torch.empty(numel * world, device=dev))
        dist.all_gather_into_tensor(out, gathered[rank].to(dev))
        got["all_gather"] = out.cpu()
        return got

    got = fut.then(callback).wait()
    if rank == 0:
        assert got["thread"] != main, "the callback ran on the main thread: the case tests nothing"
    what = f"seed={seed} numel={numel} rank={rank}"
    _assert_summed(got["first"], first, seed, f"first {what}")
    _assert_summed(got["future_wait"], second, seed, f"waited through its Future {what}")
    assert torch.equal(got["sync"], torch.stack(third).max(0).values), f"MAX {what}"
    assert torch.equal(got["broadcast"], root_data), f"broadcast {what}"
    assert torch.equal(got["all_gather"], torch.cat(gathered)), f"all_gather {what}"


@pytest.mark.parametrize("numel", [0, 7, 40_001])
def test_collectives_issued_and_waited_inside_a_callback(rank_pool, numel):
    rank_pool.run(run_collectives_inside_a_callback, fresh_seed(), numel, timeout=RUN_TIMEOUT)


def run_chained_callbacks(seed: int, steps: int, ctx) -> None:
    """A chain of then() callbacks, each all_reducing the previous result divided by the
    world size (PowerSGD's shape: P, then Q, then the decompression), so that the sum stays
    the first all_reduce's."""
    world, rank = ctx.world_size, ctx.rank
    fut, first = _first_collective(seed, 33, ctx)

    def step(done: torch.futures.Future) -> list[torch.Tensor]:
        t = done.value()[0] / world
        return dist.all_reduce(t, async_op=True).get_future().wait()

    for _ in range(steps):
        fut = fut.then(step)
    result = fut.wait()[0].cpu().double()
    expected = torch.stack([x.double() for x in first]).sum(0)
    torch.testing.assert_close(
        result, expected, rtol=1e-5, atol=1e-5 * world, msg=f"seed={seed} rank={rank}"
    )


def test_chained_callbacks_each_issuing_a_collective(rank_pool):
    rank_pool.run(run_chained_callbacks, fresh_seed(), 4, timeout=RUN_TIMEOUT)


def run_callback_on_a_coalesced_batch(seed: int, ctx) -> None:
    """The callback of a coalesced batch's Work (broadcasts: the backend's own
    startCoalescing / endCoalescing batch) issues another batch and waits for it."""
    world, rank, dev = ctx.world_size, ctx.rank, torch.device(ctx.device)
    sources = [_inputs(seed, 5 + i, 11 + i, world)[i % world] for i in range(4)]

    def received(i: int) -> torch.Tensor:
        src = sources[i]
        return src.to(dev) if rank == i % world else poison_(torch.empty_like(src, device=dev))

    if rank != 0:
        time.sleep(PEER_DELAY_S)
    outer = [received(0), received(1)]
    with dist._coalescing_manager(device=dev, async_ops=True) as first:
        for i, t in enumerate(outer):
            dist.broadcast(t, src=i % world)
    inner_tensors = [received(2), received(3)]
    main = threading.get_ident()

    def callback(done: torch.futures.Future) -> int:
        with dist._coalescing_manager(device=dev, async_ops=True) as inner:
            for i, t in enumerate(inner_tensors, start=2):
                dist.broadcast(t, src=i % world)
        inner.wait()
        return threading.get_ident()

    thread = first.works[-1].get_future().then(callback).wait()
    if rank == 0:
        assert thread != main, "the callback ran on the main thread: the case tests nothing"
    for i, t in enumerate(outer + inner_tensors):
        assert torch.equal(t.cpu(), sources[i]), f"broadcast {i} seed={seed} rank={rank}"


def test_coalesced_batch_issued_inside_a_callback(rank_pool):
    rank_pool.run(run_callback_on_a_coalesced_batch, fresh_seed(), timeout=RUN_TIMEOUT)
