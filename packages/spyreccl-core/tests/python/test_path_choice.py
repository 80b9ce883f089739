"""The choice between staged and single copy (cross-memory attach) on 2 and 3 ranks.

A communicator's init probe times both paths on this machine and the ranks agree on the size
from which they vote between them (the vote floor, 8-64 KiB); from there each collective's
path is chosen by the ranks' combined votes. These tests make the ranks disagree on purpose,
in their proposals of the floor (SPYRECCL_CMA_VOTE_MIN_BYTES on one rank only) and in their
estimates (SPYRECCL_CMA_ADAPTIVE=cma on one rank, =staged on another), and check that every
rank reports the same floor in its state dump and that every collective stays exact at odd
sizes on both sides of every threshold: against float64 references computed here, and bit for
bit against a run with the single copy off.

Each case starts its own ranks with `spawn`: the advisor's mode is read once per process, so a
forked rank would inherit the test process's.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from core_support import assert_matches_reference_and_staged, collect_reports, own_processes

import spyreccl_core

# float32 elements: odd counts just below and above 4, 8, 16, 32, 64 and 128 KiB.
SIZES = [1023, 1025, 2047, 2049, 4095, 4097, 8191, 8193, 16383, 16385, 32767, 32769]
REPEAT = 20001  # float32: 80004 bytes, the advisor's 64-128 KiB class
FLOOR_LINE = re.compile(r"copy paths: the ranks vote staged/single copy from (\d+) bytes")


def _inputs(seed: int, rank: int, n: int, tag: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, n, tag])
    return rng.standard_normal(n).astype(np.float32)


def _poisoned(n: int) -> np.ndarray:
    return np.full(n, np.nan, dtype=np.float32)


def _run_case(comm, seed: int) -> dict:
    r, size = comm.rank, comm.size
    out: dict = {}
    for n in SIZES:
        y = _poisoned(n)
        comm.all_reduce(_inputs(seed, r, n, 0), y)
        out["all_reduce", n] = y
        y = _poisoned(n)
        comm.reduce_scatter(_inputs(seed, r, n * size, 1), y)
        out["reduce_scatter", n] = y
        b = _inputs(seed, 0, n * size, 2) if r == 0 else _poisoned(n * size)
        comm.broadcast(b, 0)
        out["broadcast", n] = b
        y = _poisoned(n * size)
        comm.all_gather(_inputs(seed, r, n, 3), y)
        out["all_gather", n] = y
        y = _poisoned(n * size)
        comm.all_to_all(_inputs(seed, r, n * size, 4), y)
        out["all_to_all", n] = y
        # Send/recv around the ring, every rank at once.
        y = _poisoned(n)
        with comm.group():
            comm.send(_inputs(seed, r, n, 5), (r + 1) % size, tag=7)
            comm.recv(y, (r - 1) % size, tag=7)
        out["send_recv", n] = y
    # Eight broadcasts of one size from 64 KiB: enough calls on one path for the advisor's
    # estimates (a sample is the faster of two consecutive calls after one that primes).
    for k in range(8):
        b = _inputs(seed, 0, REPEAT, 6 + k) if r == 0 else _poisoned(REPEAT)
        comm.broadcast(b, 0)
        out["broadcast_repeat", k] = b
    out["dump"] = comm.dump_state()
    return out


def _expected(seed: int, size: int, rank: int) -> dict:
    ex: dict = {}
    for n in SIZES:
        ex["all_reduce", n] = sum(_inputs(seed, q, n, 0).astype(np.float64) for q in range(size))
        full = sum(_inputs(seed, q, n * size, 1).astype(np.float64) for q in range(size))
        ex["reduce_scatter", n] = full[rank * n : (rank + 1) * n]
        ex["broadcast", n] = _inputs(seed, 0, n * size, 2)
        ex["all_gather", n] = np.concatenate([_inputs(seed, q, n, 3) for q in range(size)])
        ex["all_to_all", n] = np.concatenate(
            [_inputs(seed, q, n * size, 4)[rank * n : (rank + 1) * n] for q in range(size)]
        )
        ex["send_recv", n] = _inputs(seed, (rank - 1) % size, n, 5)
    for k in range(8):
        ex["broadcast_repeat", k] = _inputs(seed, 0, REPEAT, 6 + k)
    return ex


def _rank_main(rank, size, uid, env, seed, conn):
    import os

    os.environ.update(env)
    try:
        with spyreccl_core.Communicator(
            rank, size, spyreccl_core.UniqueId.from_bytes(uid), timeout=60.0
        ) as comm:
            conn.send(("ok", _run_case(comm, seed)))
    except BaseException as e:  # reported to the test, which fails with it
        conn.send(("error", repr(e)))
    conn.close()


def _run_ranks(envs: list[dict], seed: int) -> list[dict]:
    uid = spyreccl_core.UniqueId().to_bytes()
    args = [(rank, len(envs), uid, env, seed) for rank, env in enumerate(envs)]
    # spawn: each rank's environment must be in place before the library is loaded.
    with own_processes(_rank_main, args, method="spawn") as (pipes, _):
        return collect_reports(pipes, timeout=120)


def _floor(dump: str) -> int:
    m = FLOOR_LINE.search(dump)
    assert m, dump
    return int(m.group(1))


def _cma_reads(dump: str) -> int:
    return int(dump.split("(CMA) on, ")[1].split(" reads")[0])


def _check_exact(results: list[dict], staged: list[dict], seed: int) -> None:
    size = len(results)
    for rank in range(size):
        assert_matches_reference_and_staged(
            results[rank], staged[rank], _expected(seed, size, rank), size, rank, "the chosen path"
        )


# Contention is fixed (not read from the load average), so that the votes are the advisors'.
QUIET = {"SPYRECCL_CMA_CONTENDED": "0"}


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_that_disagree_agree_on_the_floor_and_stay_exact(size, seeded):
    seed = seeded.seed
    # Rank 0 proposes a 4 KiB floor and prefers the single copy; rank 1 proposes nothing
    # (its probe's) and prefers the staged copies; rank 2 (3 ranks) measures.
    envs = [
        {**QUIET, "SPYRECCL_CMA_VOTE_MIN_BYTES": "4096", "SPYRECCL_CMA_ADAPTIVE": "cma"},
        {**QUIET, "SPYRECCL_CMA_ADAPTIVE": "staged"},
        {**QUIET},
    ][:size]
    results = _run_ranks(envs, seed)
    staged = _run_ranks([{**QUIET, "SPYRECCL_CMA": "0"}] * size, seed)
    for rank in range(size):
        dump = results[rank]["dump"]
        # The smallest proposal wins, on every rank; the dump names whose it is.
        assert _floor(dump) == 4096, dump
        assert "(rank 0's proposal" in dump, dump
        # Rank 0's vote for the single copy decides from the floor up on every rank.
        assert _cma_reads(dump) > 0, dump
        assert "copy paths: staged at every size" in staged[rank]["dump"], staged[rank]["dump"]
    assert "from SPYRECCL_CMA_VOTE_MIN_BYTES" in results[0]["dump"]
    _check_exact(results, staged, seed)


@pytest.mark.parametrize("size", [2, 3])
def test_the_probed_floor_is_agreed_and_the_advisor_decides_above_it(size, seeded):
    seed = seeded.seed
    results = _run_ranks([dict(QUIET)] * size, seed)
    staged = _run_ranks([{**QUIET, "SPYRECCL_CMA": "0"}] * size, seed)
    floors = {_floor(r["dump"]) for r in results}
    # One floor for all ranks, one of the probe's sizes or the default.
    assert len(floors) == 1, [r["dump"] for r in results]
    assert floors <= {8192, 16384, 32768, 65536}
    for r in results:
        # This rank's own probe, with both paths timed at every probe size.
        assert re.search(r"32 KiB \d+\.\d+/\d+\.\d+ us", r["dump"]), r["dump"]
        # The estimates the votes came from: the broadcast was voted at 64-128 KiB (above
        # any floor), so its estimates are in the dump.
        assert re.search(r"broadcast\s+from 64 KiB\s+staged\s+[\d.]+ ns/KiB", r["dump"]), r["dump"]
    _check_exact(results, staged, seed)


def test_a_malformed_floor_proposal_fails_communicator_creation(monkeypatch):
    monkeypatch.setenv("SPYRECCL_CMA_VOTE_MIN_BYTES", "lots")
    with pytest.raises(spyreccl_core.SpyrecclError, match="SPYRECCL_CMA_VOTE_MIN_BYTES"):
        spyreccl_core.Communicator(0, 1, spyreccl_core.UniqueId(), timeout=10.0)
