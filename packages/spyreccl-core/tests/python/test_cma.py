"""Single-copy transfers of ordinary numpy memory (cross-memory attach) on 2 and 3 ranks.

Each case forks its own ranks, because the path is chosen when a communicator is created:
with SPYRECCL_CMA_MIN_BYTES=1 every non-empty collective and every message larger than the
two p2p staging slots reads peers' buffers with process_vm_readv; with SPYRECCL_CMA=0 the
same calls are staged (the forced fallback). Results are compared with float64 references
computed here, and the two ways must agree bit for bit. Buffers sit at odd byte offsets of
larger allocations (no alignment) and have odd lengths. Also: a rank killed while its peers
read its buffer fails them cleanly, leaving no segment or descriptor behind.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from core_support import assert_matches_reference_and_staged, collect_reports, own_processes

import spyreccl_core
from spyreccl_testing.shm import assert_no_leftovers, spyreccl_segments

SIZES = [1, 7, 1023, 40_001]
P2P_CHUNK = 16384  # small p2p slots: 40_001 float32 (160 KB) are well above two of them


def _unaligned(n: int, offset: int = 3) -> np.ndarray:
    """n float32 starting `offset` bytes into a fresh allocation (not even 4-byte aligned)."""
    raw = np.empty(n * 4 + offset, dtype=np.uint8)
    return np.frombuffer(raw.data, dtype=np.float32, count=n, offset=offset)


def _inputs(seed: int, rank: int, n: int) -> np.ndarray:
    # Random float32: sums round, so equal bits on both paths mean equal summation order.
    rng = np.random.default_rng([seed, rank, n])
    return rng.standard_normal(n).astype(np.float32)


def _filled(values: np.ndarray) -> np.ndarray:
    a = _unaligned(values.size)
    a[...] = values
    return a


def _poisoned(n: int) -> np.ndarray:
    a = _unaligned(n)
    a[...] = np.nan
    return a


def _run_case(comm, seed: int) -> dict:
    """Every operation at every size on this rank; returns the outputs by (op, size)."""
    r, size = comm.rank, comm.size
    out: dict = {}
    for n in SIZES:
        x = _filled(_inputs(seed, r, n))
        y = _poisoned(n)
        comm.all_reduce(x, y)
        out["all_reduce", n] = y.copy()
        x = _filled(_inputs(seed, r, n * size))
        y = _poisoned(n)
        comm.reduce_scatter(x, y)
        out["reduce_scatter", n] = y.copy()
        # In place: the output aliases our block of the input.
        x = _filled(_inputs(seed, r, n))
        comm.all_reduce(x)
        out["all_reduce_in_place", n] = x.copy()
        x = _filled(_inputs(seed, r, n * size))
        comm.reduce_scatter(x, x[r * n : (r + 1) * n])
        out["reduce_scatter_in_place", n] = x[r * n : (r + 1) * n].copy()
        b = _filled(_inputs(seed, 0, n)) if r == 0 else _poisoned(n)
        comm.broadcast(b, 0)
        out["broadcast", n] = b.copy()
        x = _filled(_inputs(seed, r, n))
        y = _poisoned(n * size)
        comm.all_gather(x, y)
        out["all_gather", n] = y.copy()
        y = _poisoned(n * size) if r == size - 1 else None
        comm.gather(x, y, size - 1)
        if y is not None:
            out["gather", n] = y.copy()
        s = _filled(_inputs(seed, 1, n * size)) if r == 1 else None
        y = _poisoned(n)
        comm.scatter(s, y, 1)
        out["scatter", n] = y.copy()
        x = _filled(_inputs(seed, r, n * size))
        y = _poisoned(n * size)
        comm.all_to_all(x, y)
        out["all_to_all", n] = y.copy()
        if r == 0:
            comm.send(_filled(_inputs(seed, 0, n)), size - 1, tag=3)
        elif r == size - 1:
            y = _poisoned(n)
            comm.recv(y, 0, tag=3)
            out["send_recv", n] = y.copy()
    out["dump"] = comm.dump_state()
    return out


def _expected(seed: int, size: int, rank: int) -> dict:
    """float64 references of what `rank` must hold after _run_case."""
    ex: dict = {}
    for n in SIZES:
        total = sum(_inputs(seed, q, n).astype(np.float64) for q in range(size))
        ex["all_reduce", n] = ex["all_reduce_in_place", n] = total
        blocks = sum(_inputs(seed, q, n * size).astype(np.float64) for q in range(size))
        ex["reduce_scatter", n] = ex["reduce_scatter_in_place", n] = blocks[
            rank * n : (rank + 1) * n
        ]
        ex["broadcast", n] = _inputs(seed, 0, n)
        gathered = np.concatenate([_inputs(seed, q, n) for q in range(size)])
        ex["all_gather", n] = gathered
        if rank == size - 1:
            ex["gather", n] = gathered
        ex["scatter", n] = _inputs(seed, 1, n * size)[rank * n : (rank + 1) * n]
        ex["all_to_all", n] = np.concatenate(
            [_inputs(seed, q, n * size)[rank * n : (rank + 1) * n] for q in range(size)]
        )
        if rank == size - 1:
            ex["send_recv", n] = _inputs(seed, 0, n)
    return ex


def _rank_main(rank, size, uid, env, seed, conn):
    os.environ.update(env)
    try:
        with spyreccl_core.Communicator(
            rank,
            size,
            spyreccl_core.UniqueId.from_bytes(uid),
            timeout=30.0,
            chunk_bytes=16384,
            p2p_chunk_bytes=P2P_CHUNK,
        ) as comm:
            conn.send(("ok", _run_case(comm, seed)))
    except BaseException as e:  # reported to the test, which fails with it
        conn.send(("error", repr(e)))
    conn.close()
    os._exit(0)


def _run_ranks(size: int, env: dict, seed: int) -> list[dict]:
    uid = spyreccl_core.UniqueId().to_bytes()
    args = [(rank, size, uid, env, seed) for rank in range(size)]
    with own_processes(_rank_main, args) as (pipes, _):
        return collect_reports(pipes, timeout=60)


@pytest.mark.parametrize("size", [2, 3])
def test_single_copy_and_forced_fallback_match_the_reference(size, seeded):
    seed = seeded.seed
    cma = _run_ranks(size, {"SPYRECCL_CMA_MIN_BYTES": "1"}, seed)
    staged = _run_ranks(size, {"SPYRECCL_CMA_MIN_BYTES": "1", "SPYRECCL_CMA": "0"}, seed)
    for rank in range(size):
        assert "(CMA) on" in cma[rank]["dump"], cma[rank]["dump"]
        assert "(CMA) off (SPYRECCL_CMA=0" in staged[rank]["dump"], staged[rank]["dump"]
        reads = int(cma[rank]["dump"].split("(CMA) on, ")[1].split(" reads")[0])
        assert reads > 0, "ordinary buffers should have been read with process_vm_readv"
        assert ", 0 reads" in staged[rank]["dump"]
        assert_matches_reference_and_staged(
            cma[rank], staged[rank], _expected(seed, size, rank), size, rank, "the single copy"
        )


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _victim_or_survivor(rank, uid, conn):
    os.environ["SPYRECCL_CMA_MIN_BYTES"] = "1"
    fds_before = _open_fds()
    buf = np.full((64 << 20) // 4, 1.5, dtype=np.float32)  # ordinary memory: read with CMA
    comm = spyreccl_core.Communicator(rank, 2, spyreccl_core.UniqueId.from_bytes(uid), timeout=30)
    comm.barrier()
    conn.send(("ready",))
    error, at = None, None
    try:
        for _ in range(100_000):  # rank 0 is killed by the parent during one of these
            comm.broadcast(buf, 0)
    except spyreccl_core.SpyrecclError as e:
        error, at = e, time.monotonic()
    comm.destroy()
    conn.send(("result", type(error).__name__, str(error), at, _open_fds() - fds_before))
    conn.close()
    os._exit(0)


def test_peer_killed_during_large_single_copy_broadcast_fails_cleanly():
    before = spyreccl_segments()
    uid = spyreccl_core.UniqueId().to_bytes()
    with own_processes(_victim_or_survivor, [(rank, uid) for rank in range(2)]) as (pipes, procs):
        for conn in pipes:
            assert conn.poll(30) and conn.recv() == ("ready",)
        time.sleep(0.2)  # broadcasts of 64 MiB are under way, each a few milliseconds
        killed_at = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        assert pipes[1].poll(10), "rank 1 still blocked after the root died"
        _, kind, message, at, leaked_fds = pipes[1].recv()
        assert kind == "RemoteError", (kind, message)
        assert "rank 0" in message
        assert at - killed_at < 2.0, f"the death was noticed after {at - killed_at:.2f} s"
        assert leaked_fds == 0, f"{leaked_fds} descriptor(s) left open after destroy"
    assert procs[0].exitcode == -signal.SIGKILL
    assert_no_leftovers(before, set())
