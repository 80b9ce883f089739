"""Failure behaviour seen through the bindings: mismatch, timeout, abort, peer death, shm.

Cases that break a communicator do it on a sub-communicator split off the pool's, so the
pool stays usable; the peer-death test runs its own processes.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import threading
import time

import numpy as np
import pytest
from core_support import own_processes

import spyreccl_core
from spyreccl_core import DataType, ReduceOp
from spyreccl_testing import RankError
from spyreccl_testing.shm import assert_no_leftovers, mapped_segments, spyreccl_segments


def _catch(fn, *args, **kwargs):
    """Runs fn; returns (exception or None, seconds it took)."""
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except spyreccl_core.SpyrecclError as e:
        return e, time.monotonic() - start
    return None, time.monotonic() - start


# ---------------------------------------------------------------------------------------
# Mismatch
# ---------------------------------------------------------------------------------------


# Broadcasts above the largest one-way broadcast (256 bytes) take the step protocol, in
# which every rank sees every descriptor: a mismatch fails every rank in the call itself.
STEP_ELEMENTS = 128


def rank_mismatch(comm, kind):
    sub = comm.split(0)
    with sub:
        x = np.ones(STEP_ELEMENTS + (comm.rank if kind == "count" else 0), dtype=np.float32)
        if kind == "count":
            error, _ = _catch(sub.all_reduce, x)
        elif kind == "op":
            op = ReduceOp.SUM if comm.rank == 0 else ReduceOp.MAX
            error, _ = _catch(sub.all_reduce, x, None, op)
        elif kind == "collective":
            if comm.rank == 0:
                error, _ = _catch(sub.broadcast, x, 0)
            else:
                error, _ = _catch(sub.all_reduce, x)
        elif kind == "root":
            error, _ = _catch(sub.broadcast, x, comm.rank)
        else:
            raise AssertionError(kind)
        broken = sub.async_error()
    comm.barrier()  # the parent communicator is unaffected
    return error, broken


@pytest.mark.parametrize("kind", ["count", "op", "collective", "root"])
def test_mismatch_detected_on_every_rank(rank_pool, kind):
    for rank, (error, broken) in enumerate(rank_pool.run(rank_mismatch, kind)):
        assert isinstance(error, spyreccl_core.MismatchError), (rank, error)
        assert error.code == spyreccl_core.Result.MISMATCH
        # The library's detailed message (naming both sides), not the generic code text.
        assert str(error) != spyreccl_core.error_string(spyreccl_core.Result.MISMATCH)
        assert "rank" in str(error), str(error)
        assert broken == spyreccl_core.Result.MISMATCH


def rank_one_way_mismatch(comm, kind, seed):
    """A small (one-way) broadcast that does not match: returns what the call raised and,
    when it succeeded, what the next barrier raised, with the receiver's output."""
    sub = comm.split(0)
    with sub:
        odd = comm.rank == comm.size - 1
        rng = np.random.default_rng([seed, comm.rank])
        x = rng.standard_normal(15 if odd and kind == "count" else 16).astype(np.float32)
        before = x.copy()
        root = 1 if odd and kind == "root" else 0
        if kind == "collective" and odd:
            error, _ = _catch(sub.all_reduce, x)
        else:
            error, _ = _catch(sub.broadcast, x, root)
        in_call = error is not None
        if error is None:
            error, _ = _catch(sub.barrier)
        untouched = bool(np.array_equal(x, before))
    comm.barrier()
    return in_call, error, untouched, comm.rank == root


@pytest.mark.parametrize("kind", ["count", "collective", "root"])
def test_one_way_broadcast_mismatch_fails_by_the_next_synchronising_call(rank_pool, kind, seeded):
    in_calls = []
    for rank, (in_call, error, untouched, is_root) in enumerate(
        rank_pool.run(rank_one_way_mismatch, kind, seeded.seed)
    ):
        in_calls.append(in_call)
        # In the call (a receiver that sees the root's slot or history) or at the barrier
        # after it (the root returned before anyone read its slot), naming both calls.
        assert isinstance(error, (spyreccl_core.MismatchError, spyreccl_core.RemoteError)), (
            rank,
            error,
        )
        assert "called" in str(error) and "but rank" in str(error), str(error)
        if isinstance(error, spyreccl_core.RemoteError):
            assert "failed with spyrecclMismatch" in str(error), str(error)
        if in_call and not is_root:
            assert untouched, f"rank {rank}: a failed receiver's output was written"
    if kind == "count":
        # The receiver with the other count sees the root's slot: it fails in the call.
        assert in_calls[-1], in_calls


# ---------------------------------------------------------------------------------------
# Timeout and abort
# ---------------------------------------------------------------------------------------


def _stay_away(comm, sub):
    """The other ranks keep `sub` alive but never call it (a destroyed communicator would be
    reported as a departed peer instead), until rank 0 is done with it."""
    comm.barrier()
    sub.destroy()


def rank_timeout(comm, timeout_s):
    sub = comm.split(0)
    sub.set_timeout(timeout_s)
    if comm.rank != 0:
        return _stay_away(comm, sub)
    error, elapsed = _catch(sub.barrier)
    sub.destroy()
    comm.barrier()
    return error, elapsed


def test_timeout_on_absent_peer(rank_pool):
    timeout_s = 0.5
    error, elapsed = rank_pool.run(rank_timeout, timeout_s)[0]
    assert isinstance(error, spyreccl_core.TimeoutError), error
    assert isinstance(error, TimeoutError)  # also the builtin
    assert timeout_s <= elapsed < timeout_s + 1.5, elapsed


def rank_abort_from_thread(comm, how):
    sub = comm.split(0)
    if comm.rank != 0:
        return _stay_away(comm, sub)
    timer = threading.Timer(0.3, sub.abort if how == "abort" else sub.destroy)
    timer.start()
    error, elapsed = _catch(sub.all_reduce, np.ones(10))
    timer.join()
    closed_after = sub.closed
    sub.destroy()
    comm.barrier()
    return error, elapsed, closed_after


@pytest.mark.parametrize("how", ["abort", "destroy"])
def test_abort_from_another_thread_unblocks(rank_pool, how):
    error, elapsed, closed = rank_pool.run(rank_abort_from_thread, how)[0]
    assert isinstance(error, spyreccl_core.AbortedError), error
    assert error.code == spyreccl_core.Result.ABORTED
    assert 0.25 < elapsed < 2.0, elapsed
    if how == "destroy":  # destroy() aborted the running call, waited for it, then freed
        assert closed


def rank_concurrent_use(comm):
    sub = comm.split(0)
    if comm.rank != 0:
        return _stay_away(comm, sub)
    outcome = {}

    def blocked():
        outcome["blocked"], _ = _catch(sub.barrier)  # the peers never join

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.2)
    outcome["second"], _ = _catch(sub.all_reduce, np.ones(4))
    sub.abort()
    thread.join()
    sub.destroy()
    comm.barrier()
    return outcome


def test_second_thread_gets_invalid_usage(rank_pool):
    outcome = rank_pool.run(rank_concurrent_use)[0]
    assert isinstance(outcome["second"], spyreccl_core.InvalidUsageError)
    assert "another thread" in str(outcome["second"])
    assert isinstance(outcome["blocked"], spyreccl_core.AbortedError)


def rank_small_collective_waits_without_gil(comm, op):
    """Rank 0 enters a small collective long before rank 1; a second Python thread of rank
    0 must keep running meanwhile (the binding keeps the GIL only while the call spins)."""
    rng = np.random.default_rng(100 + comm.rank)
    send = rng.standard_normal(16)
    recv = np.full(16 * comm.size if op == "all_gather" else 16, np.nan)
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    comm.barrier()
    if comm.rank != 0:
        time.sleep(0.5)
    thread = threading.Thread(target=count)
    thread.start()
    time.sleep(0.01)
    before = ticks
    start = time.monotonic()
    if op == "all_reduce":
        comm.all_reduce(send, recv)
    elif op == "all_gather":
        comm.all_gather(send, recv)
    else:
        comm.barrier()
    elapsed = time.monotonic() - start
    during = ticks - before
    stop.set()
    thread.join()
    return comm.rank, send, recv, during, elapsed


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "barrier"])
def test_small_collective_releases_gil_while_blocked(rank_pool, op):
    results = rank_pool.run(rank_small_collective_waits_without_gil, op)
    sends = [r[1] for r in results]
    for rank, _, recv, during, elapsed in results:
        if op == "all_reduce":
            expected = np.sum(np.stack(sends).astype(np.float64), axis=0)
            np.testing.assert_allclose(recv, expected, rtol=1e-12)
        elif op == "all_gather":
            np.testing.assert_array_equal(recv, np.concatenate(sends))
        if rank == 0:
            assert elapsed > 0.3, elapsed  # it did block for rank 1
            # The counting thread ran through the wait (it gets no GIL if the wait holds it).
            assert during > 1000, during


def test_racing_threads_on_one_communicator_never_corrupt_it():
    """Two threads hammering one (single-rank) communicator: the lock-free busy flag lets
    every call either run alone, with the right result, or fail with the clear
    InvalidUsageError; the communicator stays healthy and destroy() still works while a
    thread may be inside a call."""
    comm = spyreccl_core.Communicator(0, 1, spyreccl_core.UniqueId(), name="race")
    rng = np.random.default_rng(15)
    outcomes = {"ok": 0, "busy": 0, "other": []}
    lock = threading.Lock()
    start = threading.Barrier(2)

    def hammer(seed):
        send = rng.standard_normal(64) if seed else np.arange(64, dtype=np.float64)
        expected = send.astype(np.float64)
        start.wait()
        for _ in range(3000):
            recv = np.full(64, np.nan)
            try:
                comm.all_reduce(send, recv)
            except spyreccl_core.InvalidUsageError as e:
                key = "busy" if "another thread" in str(e) else None
            except Exception as e:  # reported below
                with lock:
                    outcomes["other"].append(repr(e))
                continue
            else:
                np.testing.assert_array_equal(recv, expected)
                key = "ok"
            with lock:
                if key is None:
                    outcomes["other"].append("unexpected InvalidUsageError")
                else:
                    outcomes[key] += 1

    threads = [threading.Thread(target=hammer, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not outcomes["other"], outcomes["other"][:3]
    assert outcomes["ok"] + outcomes["busy"] == 6000
    assert outcomes["ok"] >= 1
    assert comm.async_error() == spyreccl_core.Result.SUCCESS
    comm.barrier()
    comm.destroy()
    error, _ = _catch(comm.barrier)
    assert isinstance(error, spyreccl_core.InvalidUsageError)
    assert "destroyed" in str(error)


def rank_after_destroy(comm):
    sub = comm.split(0)
    sub.destroy()
    sub.destroy()  # idempotent
    error, _ = _catch(sub.all_reduce, np.ones(3))
    sub.abort()  # harmless after destroy
    return error


def test_use_after_destroy(rank_pool):
    for error in rank_pool.run(rank_after_destroy):
        assert isinstance(error, spyreccl_core.InvalidUsageError)
        assert "destroyed" in str(error)


# ---------------------------------------------------------------------------------------
# Peer death and shared-memory hygiene (own processes: a killed rank ruins a pool)
# ---------------------------------------------------------------------------------------


def _doomed_rank(rank, size, uid, conn):
    with spyreccl_core.Communicator(
        rank, size, spyreccl_core.UniqueId.from_bytes(uid), timeout=30.0
    ) as comm:
        comm.barrier()
        conn.send(("mapped", sorted(mapped_segments())))
        if rank == 1:
            time.sleep(60)  # killed by the parent while the others wait for it
        error, _ = _catch(comm.all_reduce, np.ones(1000, dtype=np.float32))
        conn.send(("result", error, time.monotonic()))
    conn.close()
    os._exit(0)


def test_sigkilled_rank_raises_remote_error_and_leaves_no_segments():
    before = spyreccl_segments()
    size = 3
    uid = spyreccl_core.UniqueId().to_bytes()
    args = [(rank, size, uid) for rank in range(size)]
    with own_processes(_doomed_rank, args) as (pipes, procs):
        ours = set()
        for conn in pipes:
            assert conn.poll(30), "rank did not form the communicator"
            ours.update(conn.recv()[1])
        assert ours, "no spyreccl segment mapped: is the shm path different?"
        time.sleep(0.3)  # ranks 0 and 2 are now blocked in all_reduce waiting for rank 1
        killed_at = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL)
        for rank in (0, 2):
            assert pipes[rank].poll(10), f"rank {rank} still blocked after its peer died"
            _, error, at = pipes[rank].recv()
            assert isinstance(error, spyreccl_core.RemoteError), (rank, error)
            assert at - killed_at < 2.0, f"rank {rank} noticed the death after {at - killed_at}s"
    assert procs[1].exitcode == -signal.SIGKILL
    assert_no_leftovers(before, ours)


def _bystander_chain(rank, size, uid, conn):
    """Rank 1 dies silently; rank 2 fails waiting for it; rank 0 waits only for rank 2."""
    with spyreccl_core.Communicator(
        rank, size, spyreccl_core.UniqueId.from_bytes(uid), timeout=30.0
    ) as comm:
        comm.barrier()
        conn.send(("ready",))
        if rank == 1:
            time.sleep(60)  # killed by the parent
        buf = np.full(64, np.nan, dtype=np.float32)
        error, _ = _catch(comm.recv, buf, 1 if rank == 2 else 2, tag=5)
        conn.send(("result", error, str(error)))
        if rank == 2:
            conn.recv()  # stays alive (and failed) until rank 0 has reported
    conn.close()
    os._exit(0)


def test_a_bystander_failure_names_the_dead_rank_first():
    """The rank a wait is missing failed only because another rank died: the death leads.

    Rank 0 never waits for rank 1, so without the root-cause search it could only say that
    rank 2 failed. That happens for real when a rank is killed just after it passed the step
    the others wait on (a survivor then fails first and becomes the awaited peer).
    """
    size = 3
    uid = spyreccl_core.UniqueId().to_bytes()
    args = [(rank, size, uid) for rank in range(size)]
    with own_processes(_bystander_chain, args) as (pipes, procs):
        for conn in pipes:
            assert conn.poll(30), "rank did not form the communicator"
            conn.recv()
        os.kill(procs[1].pid, signal.SIGKILL)
        assert pipes[2].poll(10), "rank 2 still blocked after rank 1 died"
        _, error2, text2 = pipes[2].recv()
        assert isinstance(error2, spyreccl_core.RemoteError), text2
        assert re.search(r"^rank 1 \(pid \d+\) died during point-to-point", text2, re.M), text2
        assert pipes[0].poll(10), "rank 0 still blocked after rank 2 failed"
        _, error0, text0 = pipes[0].recv()
        assert isinstance(error0, spyreccl_core.RemoteError), text0
        first = text0.splitlines()[0]
        assert re.match(r"rank 1 \(pid \d+\) died during point-to-point", first), text0
        assert re.search(r"rank 2 \(pid \d+\) failed with spyrecclRemoteError", first), text0
        assert "waiting for" in first and "rank 2" in first.split("waiting for")[1], text0
        pipes[2].send("done")
    assert procs[1].exitcode == -signal.SIGKILL


def _solo_init(rank, size, uid, conn):
    error, elapsed = _catch(
        spyreccl_core.Communicator,
        rank,
        size,
        spyreccl_core.UniqueId.from_bytes(uid),
        timeout=0.5,
    )
    conn.send((error, elapsed))
    os._exit(0)


def test_init_timeout_without_peers_leaves_no_segments():
    """Rank 0 creates the segment but nobody joins: TimeoutError and nothing left behind."""
    before = spyreccl_segments()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_solo_init, args=(0, 2, spyreccl_core.UniqueId().to_bytes(), child))
    proc.start()
    assert parent.poll(10)
    error, elapsed = parent.recv()
    proc.join()
    assert isinstance(error, spyreccl_core.TimeoutError), error
    assert elapsed < 2.5
    assert_no_leftovers(before, set())


def rank_segments(comm):
    return sorted(mapped_segments())


def test_pool_segments_are_unlinked_while_in_use(rank_pool):
    """Segments are unlinked once every rank attached: even a live pool leaves nothing."""
    for paths in rank_pool.run(rank_segments):
        assert paths
        assert not [p for p in paths if os.path.exists(p)]


def rank_bf16_dump(comm):
    comm.all_reduce(np.zeros(4, dtype=np.uint16), dtype=DataType.BFLOAT16)
    return comm.dump_state()


def test_dump_state_mentions_recent_collective(rank_pool):
    for rank, text in enumerate(rank_pool.run(rank_bf16_dump)):
        assert f"rank {rank}" in text
        assert "bfloat16" in text


def rank_raise_on_zero(comm):
    if comm.rank == 0:
        raise KeyError("raised on purpose")
    comm.barrier()  # fails once rank 0's wrapper destroyed its communicator


def test_pool_recovers_from_a_failing_case(rank_pool):
    """The test harness itself: one rank raising must not hang the others or the pool."""
    start = time.monotonic()
    with pytest.raises(RankError, match="raised on purpose") as info:
        rank_pool.run(rank_raise_on_zero)
    failures = info.value.failures
    assert failures[0].kind == "raised" and "KeyError" in failures[0].exc_type
    # The blocked ranks were released by rank 0's communicator going away (RemoteError), not
    # killed as stalled after the pool's grace period.
    for rank in range(1, rank_pool.world_size):
        assert failures[rank].kind == "raised", failures[rank].render()
        assert "RemoteError" in failures[rank].exc_type, failures[rank].render()
    assert time.monotonic() - start < rank_pool.failure_grace
    assert len(rank_pool.run(rank_segments)) == rank_pool.world_size
