"""send/recv between arrays of the memory arena (spyreccl_core.empty) on 2 and 3 ranks.

Once a collective of at least SPYRECCL_DIRECT_MIN_BYTES (256 KiB) on arena arrays has mapped
every peer's arena, a message of that size whose send buffer is arena memory is copied by
the receiver straight out of the sender's arena; smaller ones, and those sent from ordinary
memory, stay staged through the communicator's mailboxes. Every task starts with such an
all_reduce, so the direct path is on whatever ran before in the shared pool.
"""

from __future__ import annotations

import numpy as np
import pytest

import spyreccl_core

WARMUP_N = 100_003  # float32 elements: 400 KB, above the direct threshold

# Below the direct threshold (staged), just above it, and several MiB (both direct when the
# sender's array is in the arena); odd lengths.
SIZES_BYTES = [1, 4_001, 262_147, 3 * 2**20 + 5]
DTYPES = [np.uint8, np.float32, np.int64]


def _arena(values: np.ndarray) -> np.ndarray:
    a = spyreccl_core.empty(values.shape, values.dtype)
    a[...] = values
    return a


def _message(seed: int, src: int, dst: int, dtype, nbytes: int) -> np.ndarray:
    """The message src sends to dst: random bits (NaN patterns included), as `dtype`."""
    itemsize = np.dtype(dtype).itemsize
    n = max(1, nbytes // itemsize)
    raw = np.random.default_rng([seed, src, dst, nbytes, itemsize]).integers(
        0, 256, n * itemsize, dtype=np.uint8
    )
    return raw.view(dtype)


def _poisoned(like: np.ndarray, arena: bool) -> np.ndarray:
    """A buffer shaped like `like` whose every byte differs from it."""
    poison = ~like.view(np.uint8)
    out = spyreccl_core.empty(like.shape, like.dtype) if arena else np.empty_like(like)
    out.view(np.uint8)[...] = poison
    return out


def _warm_up(comm) -> None:
    """An all_reduce on arena arrays: maps the peers' arenas (turns direct transfers on)."""
    x = _arena(np.full(WARMUP_N, comm.rank + 1, dtype=np.float32))
    y = _arena(np.full(WARMUP_N, np.nan, dtype=np.float32))
    comm.all_reduce(x, y)
    expected = comm.size * (comm.size + 1) / 2
    assert np.array_equal(y, np.full(WARMUP_N, expected, dtype=np.float32)), "warm-up all_reduce"


def rank_echo(comm, seed: int, dtype_name: str, recv_in_arena: bool):
    """Rank 0 sends each size to every peer from the arena; each peer answers with its own
    message, also from the arena. Receive buffers are arena or host memory."""
    _warm_up(comm)
    dtype = np.dtype(dtype_name)
    received = []
    for nbytes in SIZES_BYTES:
        if comm.rank == 0:
            for peer in range(1, comm.size):
                comm.send(_arena(_message(seed, 0, peer, dtype, nbytes)), peer, tag=11)
            answers = []
            for peer in range(1, comm.size):
                buf = _poisoned(_message(seed, peer, 0, dtype, nbytes), recv_in_arena)
                comm.recv(buf, peer, tag=12)
                answers.append(buf.copy())
            received.append(answers)
        else:
            buf = _poisoned(_message(seed, 0, comm.rank, dtype, nbytes), recv_in_arena)
            comm.recv(buf, 0, tag=11)
            comm.send(_arena(_message(seed, comm.rank, 0, dtype, nbytes)), 0, tag=12)
            received.append([buf.copy()])
    return received


@pytest.mark.parametrize("recv_in_arena", [False, True], ids=["recv_host", "recv_arena"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_send_recv_from_arena(rank_pool, seeded, dtype, recv_in_arena):
    name = np.dtype(dtype).name
    results = rank_pool.run(rank_echo, seeded.seed, name, recv_in_arena)
    for i, nbytes in enumerate(SIZES_BYTES):
        for peer in range(1, rank_pool.world_size):
            sent = _message(seeded.seed, 0, peer, dtype, nbytes)
            got = results[peer][i][0]
            assert got.dtype == sent.dtype and got.shape == sent.shape
            assert got.tobytes() == sent.tobytes(), f"{name} {nbytes} B at rank {peer}"
            answer = _message(seeded.seed, peer, 0, dtype, nbytes)
            got = results[0][i][peer - 1]
            assert got.tobytes() == answer.tobytes(), f"{name} {nbytes} B answer of {peer}"


def rank_group_all_pairs(comm, seed: int):
    """One group exchanging several-MiB arena arrays with every peer in both directions."""
    _warm_up(comm)
    nbytes = 3 * 2**20 + 8
    sends = {
        p: _arena(_message(seed, comm.rank, p, np.float64, nbytes))
        for p in range(comm.size)
        if p != comm.rank
    }
    recvs = {
        p: _poisoned(_message(seed, p, comm.rank, np.float64, nbytes), p % 2 == 0) for p in sends
    }
    with comm.group():
        for p in sends:
            comm.send(sends[p], p, tag=13)
            comm.recv(recvs[p], p, tag=13)
    return {p: buf.copy() for p, buf in recvs.items()}


def test_group_all_pairs_from_arena(rank_pool, seeded):
    results = rank_pool.run(rank_group_all_pairs, seeded.seed)
    nbytes = 3 * 2**20 + 8
    for rank, got in enumerate(results):
        assert sorted(got) == [p for p in range(rank_pool.world_size) if p != rank]
        for peer, buf in got.items():
            expected = _message(seeded.seed, peer, rank, np.float64, nbytes)
            assert buf.tobytes() == expected.tobytes(), f"rank {rank} from {peer}"
