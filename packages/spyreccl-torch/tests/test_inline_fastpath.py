"""The inline fast path: small synchronous collectives run on the calling thread, and small
sends and receives are posted (and, when the core can, completed) there.

A synchronous collective (async_op=False) whose payload is at most SPYRECCL_INLINE_MAX_BYTES
runs on the thread that calls it when nothing is queued on the group's progress thread;
everything else is queued. These tests check that the two paths cannot be told apart except
by latency: same results (float64 references, and bit-identical between the paths), issue
order kept when an asynchronous operation is still queued, errors raised on the calling rank
from Work.wait() as before, and SPYRECCL_INLINE_MAX_BYTES=0 disabling the path.

Which path ran is observed through the Work of a ProcessGroup call with
``opts.asyncOp = False``: an inline operation has completed when the call returns; a queued
one whose peer is still asleep has not.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from spyreccl_testing.accuracy import assert_close_dtype, reference_reduce
from spyreccl_testing.inputs import fresh_seed, poison_, random_tensor, rank_seed

# A small threshold keeps the "too large for the inline path" cases cheap.
INLINE_MAX_BYTES = 4096
ENV = "SPYRECCL_INLINE_MAX_BYTES"

pytestmark = pytest.mark.rank_pool_options(
    backend="cpu:gloo,spyre:spyreccl", set_device=True, env={ENV: str(INLINE_MAX_BYTES)}
)

RUN_TIMEOUT = 300.0
# Long enough that a queued operation cannot complete while its peer sleeps, even on a loaded
# 2-core machine; short enough to keep the tests quick.
PEER_DELAY_S = 0.5


def _group_with_inline_max(value: str | None):
    """A new group (gloo for CPU, spyreccl for spyre) whose spyreccl backend read `value`
    from SPYRECCL_INLINE_MAX_BYTES (None: the variable unset, i.e. the built-in default)."""
    saved = os.environ.get(ENV)
    try:
        if value is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = value
        return dist.new_group()
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def _sync_all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM):
    """all_reduce through the ProcessGroup API exactly as dist.all_reduce(async_op=False)
    issues it, but returning the Work (dist.all_reduce waits on it and drops it)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.asyncOp = False
    return group.allreduce([tensor], opts)


# --------------------------------------------------------------------------------------------
# identical results on both paths
# --------------------------------------------------------------------------------------------

# (operation, dtype, numel): numels of 0, 1, odd, and just above INLINE_MAX_BYTES for float32
# (which takes the queued path in both groups).
_CASES = [
    ("all_reduce_sum", torch.float32, 0),
    ("all_reduce_sum", torch.float32, 1),
    ("all_reduce_sum", torch.float32, 1001),
    ("all_reduce_sum", torch.float32, INLINE_MAX_BYTES // 4 + 1),
    ("all_reduce_avg", torch.bfloat16, 333),
    ("all_reduce_max", torch.int32, 77),
    ("all_reduce_sum", torch.float64, 129),
    ("broadcast", torch.float16, 555),
    ("all_gather", torch.float32, 101),
    ("reduce_scatter", torch.float32, 97),
    ("all_to_all", torch.int64, 13),
]


def _inputs(seed: int, case_index: int, dtype: torch.dtype, shape, world: int):
    return [
        random_tensor(shape, dtype, "cpu", rank_seed(seed + case_index, r), nranks=world)
        for r in range(world)
    ]


def _run_case(case, index, seed, group, ctx) -> torch.Tensor:
    """Runs one case on `group` with the public API (synchronous) and checks it against the
    float64 / exact reference. Returns this rank's output."""
    name, dtype, numel = case
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    what = f"{name} {dtype} numel={numel} seed={seed}"
    if name.startswith("all_reduce"):
        op = name.split("_")[-1]
        inputs = _inputs(seed, index, dtype, (numel,), world)
        tensor = inputs[rank].to(dev)
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=group)
        expected = reference_reduce(inputs, op, dtype)
        assert_close_dtype(tensor, expected, dtype, world, seed=seed, what=what)
        return tensor.cpu()
    if name == "broadcast":
        root = world - 1
        source = _inputs(seed, index, dtype, (numel,), world)[root]
        tensor = (
            source.to(dev) if rank == root else poison_(torch.empty(numel, dtype=dtype, device=dev))
        )
        dist.broadcast(tensor, src=root, group=group)
        assert torch.equal(tensor.cpu(), source), what
        return tensor.cpu()
    if name == "all_gather":
        inputs = _inputs(seed, index, dtype, (numel,), world)
        out = poison_(torch.empty(numel * world, dtype=dtype, device=dev))
        dist.all_gather_single(out, inputs[rank].to(dev), group=group)
        assert torch.equal(out.cpu(), torch.cat(inputs)), what
        return out.cpu()
    if name == "reduce_scatter":
        inputs = _inputs(seed, index, dtype, (numel * world,), world)
        out = poison_(torch.empty(numel, dtype=dtype, device=dev))
        dist.reduce_scatter_single(out, inputs[rank].to(dev), group=group)
        expected = reference_reduce(inputs, "sum", dtype)[rank * numel : (rank + 1) * numel]
        assert_close_dtype(out, expected, dtype, world, seed=seed, what=what)
        return out.cpu()
    if name == "all_to_all":
        inputs = _inputs(seed, index, dtype, (numel * world,), world)
        out = poison_(torch.empty(numel * world, dtype=dtype, device=dev))
        dist.all_to_all_single(out, inputs[rank].to(dev), group=group)
        expected = torch.cat([inputs[r][rank * numel : (rank + 1) * numel] for r in range(world)])
        assert torch.equal(out.cpu(), expected), what
        return out.cpu()
    raise AssertionError(name)


def run_both_paths(seed, ctx):
    queued = _group_with_inline_max("0")
    for index, case in enumerate(_CASES):
        inline_out = _run_case(case, index, seed, None, ctx)
        queued_out = _run_case(case, index, seed, queued, ctx)
        assert torch.equal(inline_out, queued_out), (
            f"{case}: the inline and the queued path disagree (seed {seed})"
        )
    dist.barrier(group=queued)
    dist.barrier()

    # The small synchronous all_reduces above did run inline: completed when the call returns.
    tensor = torch.full((7,), float(ctx.rank + 1), device=ctx.device)
    work = _sync_all_reduce(tensor, dist.group.WORLD)
    completed_on_return = work.is_completed()
    work.wait()
    expected = float(sum(range(1, ctx.world_size + 1)))
    assert tensor.cpu().tolist() == [expected] * 7
    assert completed_on_return, "a small synchronous all_reduce did not run inline"
    dist.destroy_process_group(queued)


def test_inline_and_queued_paths_give_identical_results(rank_pool):
    rank_pool.run(run_both_paths, fresh_seed(), timeout=RUN_TIMEOUT)


# --------------------------------------------------------------------------------------------
# issue order with operations already queued
# --------------------------------------------------------------------------------------------


def run_order_after_async(seed, async_numel, ctx):
    """An asynchronous all_reduce (queued) followed by a small synchronous one. One rank
    arrives late, so the asynchronous one is still queued or running when the others issue
    the synchronous one: that one must queue behind it (running it inline would run two
    collectives at once on one communicator, in a different order than the late rank)."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    first_inputs = _inputs(seed, 0, torch.float32, (async_numel,), world)
    second_inputs = _inputs(seed, 1, torch.float32, (5,), world)
    first = first_inputs[rank].to(dev)
    second = second_inputs[rank].to(dev)
    dist.barrier()
    if rank == world - 1:
        time.sleep(PEER_DELAY_S)
    first_work = dist.all_reduce(first, async_op=True)
    second_work = _sync_all_reduce(second, dist.group.WORLD)
    second_work.wait()
    # Issue order: the first operation completed no later than the second.
    assert first_work.is_completed(), "the synchronous all_reduce overtook the queued one"
    first_work.wait()
    assert_close_dtype(
        first, reference_reduce(first_inputs, "sum"), torch.float32, world, seed=seed
    )
    assert_close_dtype(
        second, reference_reduce(second_inputs, "sum"), torch.float32, world, seed=seed
    )


@pytest.mark.parametrize("async_numel", [3, 65_537], ids=["small-async", "large-async"])
def test_synchronous_collective_queues_behind_an_async_one(rank_pool, async_numel):
    rank_pool.run(run_order_after_async, fresh_seed(), async_numel, timeout=RUN_TIMEOUT)


# --------------------------------------------------------------------------------------------
# errors on the inline path
# --------------------------------------------------------------------------------------------


def run_mismatch_inline(ctx):
    group = _group_with_inline_max(None)
    numel = 5 if ctx.rank == 0 else 7  # both far below the threshold
    tensor = torch.ones(numel, device=ctx.device)
    work = _sync_all_reduce(tensor, group)
    inline = work.is_completed()
    try:
        work.wait()
    except dist.DistBackendError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"rank {ctx.rank}: a count mismatch did not raise")
    return inline, message


def test_mismatch_on_the_inline_path_raises_on_every_rank(rank_pool):
    for rank, (inline, message) in enumerate(rank_pool.run(run_mismatch_inline, timeout=120)):
        assert inline, f"rank {rank}: the mismatched all_reduce was not run inline"
        assert "spyrecclMismatch" in message and "allreduce" in message, f"rank {rank}: {message}"


GROUP_TIMEOUT_S = 2.0


def run_timeout_inline(ctx):
    group = dist.new_group(timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    result = None
    if ctx.rank == 0:  # the others never join
        tensor = torch.ones(3, device=ctx.device)
        start = time.monotonic()
        work = _sync_all_reduce(tensor, group)
        returned = time.monotonic() - start
        try:
            work.wait()
        except dist.DistBackendError as exc:
            result = (returned, time.monotonic() - start, str(exc))
        else:
            raise AssertionError("an all_reduce without peers did not time out")
    dist.barrier()
    return result


def test_timeout_on_the_inline_path_raises_on_the_calling_rank(rank_pool):
    returned, elapsed, message = rank_pool.run(run_timeout_inline, timeout=120)[0]
    # Inline: the core's timeout bounded the call itself.
    assert GROUP_TIMEOUT_S * 0.9 <= returned <= GROUP_TIMEOUT_S + 20.0, (returned, message)
    assert elapsed - returned < 1.0, (returned, elapsed)
    assert "imeout" in message and "allreduce" in message, message


# --------------------------------------------------------------------------------------------
# SPYRECCL_INLINE_MAX_BYTES
# --------------------------------------------------------------------------------------------


def run_probe_path(value, numel, ctx):
    """Whether a synchronous all_reduce of `numel` float32 on a group created with
    SPYRECCL_INLINE_MAX_BYTES=`value` ran inline (completed on return although the last rank
    joins PEER_DELAY_S later)."""
    group = _group_with_inline_max(value)
    dist.barrier(group=group)
    tensor = torch.full((numel,), float(ctx.rank + 1), device=ctx.device)
    if ctx.rank == ctx.world_size - 1:
        time.sleep(PEER_DELAY_S)
    work = _sync_all_reduce(tensor, group)
    completed_on_return = work.is_completed()
    work.wait()
    expected = float(sum(range(1, ctx.world_size + 1)))
    assert torch.equal(tensor.cpu(), torch.full((numel,), expected)), "wrong all_reduce result"
    dist.destroy_process_group(group)
    return completed_on_return


@pytest.mark.parametrize(
    ("value", "numel", "inline"),
    [
        ("0", 1, False),  # disabled
        ("4096", 1024, True),  # exactly at the threshold
        ("4096", 1025, False),  # one element above
        (None, 1 << 20, True),  # default threshold: 4 MiB
        (None, (1 << 20) + 1, False),
    ],
    ids=["disabled", "at-threshold", "above-threshold", "default-at", "default-above"],
)
def test_inline_max_bytes_selects_the_path(rank_pool, value, numel, inline):
    results = rank_pool.run(run_probe_path, value, numel, timeout=RUN_TIMEOUT)
    # The last rank's call starts after the others arrived; only the early ranks can tell.
    for rank, completed_on_return in enumerate(results[:-1]):
        assert completed_on_return == inline, (
            f"rank {rank}: {ENV}={value}, {numel} float32: expected the "
            f"{'inline' if inline else 'queued'} path"
        )


# --------------------------------------------------------------------------------------------
# small sends and receives are posted on the calling thread
# --------------------------------------------------------------------------------------------


def run_p2p_posted_inline(seed, numel, ctx):
    """Rank 0 isends to rank 1, which posts its receive only PEER_DELAY_S later; then rank 0
    sends again and rank 1 irecvs after the message had time to arrive. Returns, for rank 0
    whether its isend, and for rank 1 whether its irecv, had completed when the call
    returned; every received tensor is checked against what was sent."""
    group = _group_with_inline_max(str(INLINE_MAX_BYTES))
    dist.barrier(group=group)
    first = random_tensor(numel, torch.float32, "cpu", rank_seed(seed, 0))
    second = random_tensor(numel, torch.float32, "cpu", rank_seed(seed, 1))
    completed_on_return = None
    if ctx.rank == 0:
        work = dist.isend(first.to(ctx.device), 1, group=group)
        completed_on_return = work.is_completed()
        work.wait()
        dist.send(second.to(ctx.device), 1, group=group)
    elif ctx.rank == 1:
        time.sleep(PEER_DELAY_S)
        got = poison_(torch.empty(numel, device=ctx.device))
        dist.recv(got, 0, group=group)
        assert torch.equal(got.cpu(), first), "first message received wrong"
        time.sleep(PEER_DELAY_S)  # rank 0's send is in our staging slot by now
        got = poison_(torch.empty(numel, device=ctx.device))
        work = dist.irecv(got, 0, group=group)
        completed_on_return = work.is_completed()
        work.wait()
        assert torch.equal(got.cpu(), second), "second message received wrong"
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return completed_on_return


@pytest.mark.parametrize("numel", [1, 1001, INLINE_MAX_BYTES // 4])
def test_small_send_and_receive_complete_on_the_calling_thread(rank_pool, numel):
    """A send that fits the staging slot, and a receive whose message is there, complete
    inside the call (no round trip through the progress thread); the data is unchanged."""
    results = rank_pool.run(run_p2p_posted_inline, fresh_seed(), numel, timeout=RUN_TIMEOUT)
    assert results[0] is True, f"rank 0: isend of {numel} float32 was not complete on return"
    assert results[1] is True, f"rank 1: irecv of {numel} float32 was not complete on return"


# --------------------------------------------------------------------------------------------
# one group used from several threads
# --------------------------------------------------------------------------------------------

THREADS = 3
CALLS_PER_THREAD = 150


def run_threads_share_a_group(ctx):
    """Several threads issue small synchronous all_reduces on one group at the same time.
    Which thread's call pairs with which on the peers is undefined (as with every backend),
    so every call reduces the same values; what must hold is that the communicator is never
    used by two threads at once: every result is right, nothing raises or hangs. Mixing in
    asynchronous calls makes the inline and queued paths alternate under contention."""
    import threading

    group = _group_with_inline_max(None)
    errors: list[BaseException] = []
    wrong: list[str] = []

    def worker(index: int) -> None:
        try:
            for call in range(CALLS_PER_THREAD):
                tensor = torch.full((7,), 1.5, device=ctx.device)
                if (call + index) % 5 == 0:
                    dist.all_reduce(tensor, group=group, async_op=True).wait()
                else:
                    dist.all_reduce(tensor, group=group)
                if not torch.equal(tensor.cpu(), torch.full((7,), 1.5 * ctx.world_size)):
                    wrong.append(f"thread {index} call {call}: {tensor.cpu().tolist()}")
        except BaseException as exc:  # reported below, with the thread
            errors.append(exc)

    _run_threads(
        [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)], errors, wrong
    )
    dist.destroy_process_group(group)


def _run_threads(threads, errors: list, wrong: list) -> None:
    """Starts and joins `threads`, then fails on a stuck thread, a call that raised (collected in
    `errors` by the threads) or a wrong result (described in `wrong`)."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=RUN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread is stuck in a call"
    assert not errors, f"{len(errors)} call(s) raised; first: {errors[0]!r}"
    assert not wrong, f"{len(wrong)} wrong result(s); first: {wrong[0]}"


def test_threads_sharing_a_group_never_use_the_communicator_together(rank_pool):
    rank_pool.run(run_threads_share_a_group, timeout=RUN_TIMEOUT)


# --------------------------------------------------------------------------------------------
# sends and receives that must wait: driven by the thread that waits for them
# --------------------------------------------------------------------------------------------

WAITER_REPS = 12


def run_p2p_completed_by_the_waiter(seed, numel, ctx):
    """Rank 1 irecvs (the message is not there yet: rank 0 sends PEER_DELAY_S / 10 later) and
    waits at once; rank 0 then sends with a blocking send. Each completion is observed through
    a callback on the Work's future, which runs on the thread that completes the operation.
    Returns how many of the receives (rank 1) or sends (rank 0) completed on the calling
    thread; every message is checked against what was sent."""
    import threading

    group = _group_with_inline_max(None)  # the default bound: both sizes are posted inline
    on_caller = 0
    for rep in range(WAITER_REPS):
        message = random_tensor(numel, torch.float32, "cpu", rank_seed(seed + rep, 0))
        dist.barrier(group=group)
        completed_on: list[int] = []

        def record(fut, where=completed_on):
            where.append(threading.get_ident())
            return fut.value()

        if ctx.rank == 1:
            got = poison_(torch.empty(numel, device=ctx.device))
            work = dist.irecv(got, 0, group=group)
            work.get_future().then(record)
            work.wait()
            assert torch.equal(got.cpu(), message), f"rep {rep}: message received wrong"
        elif ctx.rank == 0:
            time.sleep(PEER_DELAY_S / 10)
            tensor = message.to(ctx.device)
            work = dist.isend(tensor, 1, group=group)
            work.get_future().then(record)
            work.wait()
        else:
            continue
        # The callback may run just after wait() returns on another thread: give it time.
        deadline = time.monotonic() + 5.0
        while not completed_on and time.monotonic() < deadline:
            time.sleep(0.001)
        assert completed_on, f"rank {ctx.rank} rep {rep}: the future's callback never ran"
        on_caller += completed_on[0] == threading.get_ident()
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return on_caller


@pytest.mark.parametrize("numel", [1001, 256 * 1024])
def test_send_and_receive_that_wait_are_driven_by_their_waiter(rank_pool, numel):
    """A send or receive posted on the calling thread that cannot complete at once (the
    receive's message has not come; a 1 MiB send exceeds the staging slots) is progressed by
    the thread that waits for it, not handed to the progress thread and back. Scheduling may
    let the progress thread take one over now and then (it adopts a send or receive nobody
    claimed after a grace period), so the test asks for most, not all."""
    results = rank_pool.run(
        run_p2p_completed_by_the_waiter, fresh_seed(), numel, timeout=RUN_TIMEOUT
    )
    for rank in (0, 1):
        if rank == 0 and numel * 4 <= 512 * 1024:
            continue  # a send that fits the staging slots completes inside isend itself
        assert results[rank] >= WAITER_REPS // 2, (
            f"rank {rank}: only {results[rank]} of {WAITER_REPS} operations of {numel} float32 "
            "completed on the thread that waited for them"
        )


def run_unclaimed_receive_progresses(seed, numel, ctx):
    """Rank 1 posts an irecv and computes (sleeps) for PEER_DELAY_S before waiting; rank 0's
    blocking send of a message larger than the staging slots can only complete when rank 1's
    receive drains them. Returns, on rank 0, how long its send took."""
    group = _group_with_inline_max(None)
    message = random_tensor(numel, torch.float32, "cpu", rank_seed(seed, 0))
    dist.barrier(group=group)
    took = None
    if ctx.rank == 1:
        got = poison_(torch.empty(numel, device=ctx.device))
        work = dist.irecv(got, 0, group=group)
        time.sleep(PEER_DELAY_S)
        work.wait()
        assert torch.equal(got.cpu(), message), "message received wrong"
    elif ctx.rank == 0:
        tensor = message.to(ctx.device)
        time.sleep(PEER_DELAY_S / 10)  # rank 1's irecv is posted and left alone by now
        start = time.monotonic()
        dist.send(tensor, 1, group=group)
        took = time.monotonic() - start
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return took


def test_receive_left_unwaited_still_progresses(rank_pool):
    """An irecv whose caller does not wait for it is adopted by the progress thread (after
    ProgressThread::kParkGrace), so its sender is not held until the receiver waits."""
    numel = 3 * 256 * 1024 + 5  # 3 MiB: several staging chunks
    results = rank_pool.run(
        run_unclaimed_receive_progresses, fresh_seed(), numel, timeout=RUN_TIMEOUT
    )
    assert results[0] is not None
    assert results[0] < PEER_DELAY_S * 0.6, (
        f"rank 0's send took {results[0]:.3f} s: it waited for rank 1's wait() "
        f"({PEER_DELAY_S} s later) instead of being received by rank 1's progress thread"
    )


def run_threads_mix_p2p_and_collectives(seed, ctx):
    """One thread exchanges messages with a peer (send/recv on its own tag, sizes from a few
    bytes to beyond the staging slots) while another issues all_reduces on the same group:
    sends and receives driven by their waiter must hand the communicator over to the queued
    collectives and back, and nothing may be used by two threads at once. Every message and
    every sum is checked."""
    import threading

    group = _group_with_inline_max(None)
    errors: list[BaseException] = []
    wrong: list[str] = []
    peer = ctx.rank ^ 1

    def p2p_worker() -> None:
        try:
            for i, numel in enumerate([3, 1001, 70_000, 300_001] * 6):
                mine = random_tensor(numel, torch.float32, "cpu", rank_seed(seed + i, ctx.rank))
                theirs = random_tensor(numel, torch.float32, "cpu", rank_seed(seed + i, peer))
                got = poison_(torch.empty(numel, device=ctx.device))
                if ctx.rank % 2 == 0:
                    dist.send(mine.to(ctx.device), peer, group=group, tag=1)
                    dist.recv(got, peer, group=group, tag=1)
                else:
                    dist.recv(got, peer, group=group, tag=1)
                    dist.send(mine.to(ctx.device), peer, group=group, tag=1)
                if not torch.equal(got.cpu(), theirs):
                    wrong.append(f"message {i} ({numel} float32) received wrong")
        except BaseException as exc:  # reported below
            errors.append(exc)

    def collective_worker() -> None:
        try:
            for call in range(60):
                tensor = torch.full((5,), 0.5 + call, device=ctx.device)
                if call % 3 == 0:
                    dist.all_reduce(tensor, group=group, async_op=True).wait()
                else:
                    dist.all_reduce(tensor, group=group)
                expected = torch.full((5,), (0.5 + call) * ctx.world_size)
                if not torch.equal(tensor.cpu(), expected):
                    wrong.append(f"all_reduce {call}: {tensor.cpu().tolist()}")
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=collective_worker)]
    if peer < ctx.world_size:
        workers.append(threading.Thread(target=p2p_worker))
    _run_threads(workers, errors, wrong)
    dist.destroy_process_group(group)


def test_threads_mixing_sends_receives_and_collectives(rank_pool):
    rank_pool.run(run_threads_mix_p2p_and_collectives, fresh_seed(), timeout=RUN_TIMEOUT)
