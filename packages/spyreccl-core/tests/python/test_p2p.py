"""send/recv, FIFO order, group ring exchange and recv_any_source on 2 and 3 ranks."""

from __future__ import annotations

import numpy as np
import pytest
from core_support import ALL_TYPES, STAGING_BYTES, TYPES_BY_NAME, assert_bytes_equal, inputs_for

import spyreccl_core


def message_sizes(itemsize: int) -> list[int]:
    return [0, 1, 1001, 3 * STAGING_BYTES // itemsize + 5]  # last: beyond the p2p staging


def rank_pairwise(comm, name, seed):
    """Rank 0 sends every size to each peer; each peer echoes it back with tag 7."""
    tt = TYPES_BY_NAME[name]
    received = []
    for n in message_sizes(tt.storage.itemsize):
        if comm.rank == 0:
            for peer in range(1, comm.size):
                comm.send(inputs_for(tt, seed, peer, 0, n), peer, tag=3, **tt.kwargs)
            echoes = []
            for peer in range(1, comm.size):
                buf = tt.poison(n)
                comm.recv(buf, peer, tag=7, **tt.kwargs)
                echoes.append(buf)
            received.append(echoes)
        else:
            buf = tt.poison(n)
            comm.recv(buf, 0, tag=3, **tt.kwargs)
            comm.send(buf, 0, tag=7, **tt.kwargs)
            received.append(buf)
    return received


@pytest.mark.parametrize("tt", ALL_TYPES, ids=lambda t: t.name)
def test_send_recv(rank_pool, seeded, tt):
    results = rank_pool.run(rank_pairwise, tt.name, seeded.seed)
    for i, n in enumerate(message_sizes(tt.storage.itemsize)):
        for peer in range(1, rank_pool.world_size):
            sent = inputs_for(tt, seeded.seed, peer, 0, n)
            assert_bytes_equal(results[peer][i], sent, f"n={n} at rank {peer}")
            assert_bytes_equal(results[0][i][peer - 1], sent, f"n={n} echo from {peer}")


def rank_fifo(comm, seed):
    """Several messages of one pair and tag arrive in the order they were sent."""
    count = 8
    if comm.rank == 0:
        for k in range(count):
            comm.send(np.full(100 + k, k, dtype=np.int32), 1, tag=1)
        return None
    if comm.rank == 1:
        got = []
        for k in range(count):
            buf = np.full(100 + k, -1, dtype=np.int32)
            comm.recv(buf, 0, tag=1)
            got.append(buf)
        return got
    return None


def test_fifo_order(rank_pool, seeded):
    got = rank_pool.run(rank_fifo, seeded.seed)[1]
    for k, buf in enumerate(got):
        np.testing.assert_array_equal(buf, np.full(100 + k, k, dtype=np.int32))


def rank_ring(comm, seed, n):
    """Every rank sends to its right and receives from its left at the same time: messages
    beyond the staging area deadlock without a group."""
    right = (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    x = np.random.default_rng([seed, comm.rank]).standard_normal(n)
    out = np.full(n, np.nan)
    with comm.group():
        # A temporary whose only reference is the binding's export: the group must keep it
        # alive until the exchange ran at the end of the block.
        comm.send(x.copy(), right, tag=5)
        comm.recv(out, left, tag=5)
    return x, out


@pytest.mark.parametrize("n", [0, 1001, 5 * STAGING_BYTES // 8 + 3])
def test_group_ring_exchange(rank_pool, seeded, n):
    results = rank_pool.run(rank_ring, seeded.seed, n)
    for rank in range(rank_pool.world_size):
        left = (rank - 1) % rank_pool.world_size
        assert_bytes_equal(results[rank][1], results[left][0], f"rank {rank} from {left}")


def rank_group_all_pairs(comm, seed):
    """A group exchanging with every peer in both directions (a manual all-to-all)."""
    n = 700
    sends = {
        p: np.random.default_rng([seed, comm.rank, p]).integers(0, 1 << 30, n)
        for p in range(comm.size)
        if p != comm.rank
    }
    recvs = {p: np.full(n, -1, dtype=np.int64) for p in sends}
    with comm.group():
        for p in sends:
            comm.send(sends[p], p)
            comm.recv(recvs[p], p)
    return sends, recvs


def test_group_all_pairs(rank_pool, seeded):
    results = rank_pool.run(rank_group_all_pairs, seeded.seed)
    for rank in range(rank_pool.world_size):
        for peer, got in results[rank][1].items():
            np.testing.assert_array_equal(got, results[peer][0][rank])


def rank_any_source(comm, seed):
    """Every rank but 0 sends its rank number; rank 0 receives them from any source."""
    if comm.rank != 0:
        comm.send(np.full(33, comm.rank, dtype=np.int16), 0, tag=9)
        return None
    seen = []
    for _ in range(comm.size - 1):
        buf = np.full(33, -1, dtype=np.int16)
        source = comm.recv_any_source(buf, tag=9)
        seen.append((source, buf))
    return seen


def test_recv_any_source(rank_pool, seeded):
    seen = rank_pool.run(rank_any_source, seeded.seed)[0]
    assert sorted(source for source, _ in seen) == list(range(1, rank_pool.world_size))
    for source, buf in seen:
        np.testing.assert_array_equal(buf, np.full(33, source, dtype=np.int16))


def rank_destroy_inside_group(comm):
    sub = comm.split(0)
    peer = (comm.rank + 1) % comm.size
    source = (comm.rank - 1) % comm.size
    x = np.full(10, comm.rank, dtype=np.int64)
    y = np.full(10, -1, dtype=np.int64)
    error = None
    with sub.group():
        sub.send(x, peer)
        sub.recv(y, source)
        try:
            sub.destroy()  # would free the handle the pending operations use
        except spyreccl_core.InvalidUsageError as e:
            error = e
    sub.destroy()
    return str(error), y


def test_destroy_refused_while_group_pending(rank_pool):
    for rank, (error, y) in enumerate(rank_pool.run(rank_destroy_inside_group)):
        assert "pending in an open group" in error
        np.testing.assert_array_equal(y, np.full(10, (rank - 1) % rank_pool.world_size))


def rank_unbatched_ring(comm, name, seed, n, how):
    """isend right, irecv left, outside any group, completed by wait() or a test() loop:
    messages beyond the staging area only complete if both stay pending together."""
    tt = TYPES_BY_NAME[name]
    right = (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    out = tt.poison(n)
    # A temporary whose only reference is the request's export: it must stay alive until
    # the request is done.
    send_req = comm.isend(inputs_for(tt, seed, comm.rank, 0, n).copy(), right, tag=4, **tt.kwargs)
    recv_req = comm.irecv(out, left, tag=4, **tt.kwargs)
    assert isinstance(send_req, spyreccl_core.Request) and not recv_req.done
    if how == "wait":
        recv_req.wait()
        send_req.wait()
    else:
        while not (send_req.test() & recv_req.test()):
            pass
    assert send_req.done and recv_req.done
    assert send_req.test() and recv_req.test()  # done stays done
    recv_req.wait()  # no-op once done
    return out


@pytest.mark.parametrize("how", ["wait", "test"])
@pytest.mark.parametrize("tt", ALL_TYPES, ids=lambda t: t.name)
def test_unbatched_isend_irecv_ring(rank_pool, seeded, tt, how):
    for n in message_sizes(tt.storage.itemsize):
        results = rank_pool.run(rank_unbatched_ring, tt.name, seeded.seed, n, how)
        for rank in range(rank_pool.world_size):
            left = (rank - 1) % rank_pool.world_size
            expected = inputs_for(tt, seeded.seed, left, 0, n)
            assert_bytes_equal(results[rank], expected, f"n={n} at rank {rank} from {left}")


def rank_requests_misuse(comm):
    """Requests inside a group are refused; a dropped pending request keeps its buffer alive
    (the communicator adopts it) and a later receive on the same stream still gets the next
    message; destroy() with a pending request leaves the request unusable, not dangling."""
    peer = 1 - comm.rank if comm.size == 2 else (comm.rank + 1) % comm.size
    source = (comm.rank - 1) % comm.size
    errors = []
    with comm.group():
        try:
            comm.isend(np.zeros(3), peer)
        except spyreccl_core.InvalidUsageError as e:
            errors.append(str(e))
    # Dropped while pending: nothing has been sent to us on tag 11 yet.
    comm.irecv(np.empty(5000), source, tag=11)
    comm.barrier()
    comm.send(np.arange(5000, dtype=np.float64), peer, tag=11)  # fills the dropped receive
    comm.barrier()
    sub = comm.split(0)
    req = sub.irecv(np.empty(4), source, tag=12)
    sub.destroy()
    try:
        req.wait()
    except spyreccl_core.InvalidUsageError as e:
        errors.append(str(e))
    return errors


def test_request_misuse(rank_pool):
    for errors in rank_pool.run(rank_requests_misuse):
        assert len(errors) == 2, errors
        assert "isend" in errors[0] and "group" in errors[0], errors
        assert "destroyed" in errors[1], errors
