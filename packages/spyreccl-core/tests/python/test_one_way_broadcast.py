"""One-way small broadcasts: every size and root exact, a deep run-ahead, the limit the
ranks agree on, and what a mismatch does with the one-way path on and off.

A broadcast of at most 256 bytes goes one-way (the root posts it into its ring and
returns); SPYRECCL_EAGER_BROADCAST_MAX_BYTES on any rank lowers that limit for the whole
communicator, and 0 turns the path off. The agreed limit is in the state dump.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from core_support import collect_reports, own_processes

import spyreccl_core

ONE_WAY_LINE = re.compile(r"one-way broadcasts: up to (\d+) bytes, ring of (\d+) slots")


def rank_many_small_broadcasts(comm, seed):
    """1500 broadcasts of 0-300 bytes from every root in turn (runs of 500 from one root: more
    than its ring's 256 slots), each output poisoned first, an allreduce every 37 calls."""
    size, rank = comm.size, comm.rank
    got = []
    for call in range(1500):
        root = (call // 500) % size
        count = (call * 7) % 76  # 0..75 float32: 0..300 bytes, both sides of the limit
        rng = np.random.default_rng([seed, call])
        data = rng.standard_normal(count).astype(np.float32)
        buf = data.copy() if rank == root else np.full(count, np.nan, dtype=np.float32)
        comm.broadcast(buf, root)
        got.append((call, root, bool(np.array_equal(buf, data))))
        if call % 37 == 36:
            x = np.array([rank + 0.25], dtype=np.float64)
            comm.all_reduce(x)
            assert x[0] == sum(r + 0.25 for r in range(size)), x
    return got, comm.dump_state()


def test_many_small_broadcasts_are_exact_from_every_root(rank_pool, seeded):
    for rank, (got, dump) in enumerate(rank_pool.run(rank_many_small_broadcasts, seeded.seed)):
        wrong = [(call, root) for call, root, ok in got if not ok]
        assert not wrong, f"rank {rank}: wrong payloads at (call, root) {wrong[:10]}"
        m = ONE_WAY_LINE.search(dump)
        assert m and m.group(1) == "256", dump


def _rank_main(rank, size, uid, env, seed, mismatch, conn):
    import os

    os.environ.update(env)
    try:
        with spyreccl_core.Communicator(
            rank, size, spyreccl_core.UniqueId.from_bytes(uid), timeout=60.0
        ) as comm:
            rng = np.random.default_rng([seed, rank])
            if mismatch:
                # The last rank names another root: with the path off, every rank must fail
                # in this very call.
                x = rng.standard_normal(8).astype(np.float32)
                root = 1 if rank == size - 1 else 0
                try:
                    comm.broadcast(x, root)
                    error = None
                except spyreccl_core.SpyrecclError as e:
                    error = e
                conn.send(("ok", (type(error).__name__, str(error))))
                return
            out = []
            for count in (1, 7, 64, 65, 100):
                data = np.random.default_rng([seed, count]).standard_normal(count)
                data = data.astype(np.float32)
                buf = data.copy() if rank == 0 else np.full(count, np.nan, dtype=np.float32)
                comm.broadcast(buf, 0)
                out.append(bool(np.array_equal(buf, data)))
            conn.send(("ok", (out, comm.dump_state())))
    except BaseException as e:  # reported to the test, which fails with it
        conn.send(("error", repr(e)))
    conn.close()


def _run(envs: list[dict], seed: int, mismatch: bool = False) -> list:
    uid = spyreccl_core.UniqueId().to_bytes()
    args = [(rank, len(envs), uid, env, seed, mismatch) for rank, env in enumerate(envs)]
    # spawn: each rank's environment must be in place before the library is loaded.
    with own_processes(_rank_main, args, method="spawn") as (pipes, _):
        return collect_reports(pipes, timeout=120)


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_agree_on_the_smallest_limit(size, seeded):
    # Only the last rank lowers the limit: every rank must use 64 bytes, so that a root
    # and its receivers always take the same path (100 bytes: the step protocol).
    envs = [{} for _ in range(size)]
    envs[-1] = {"SPYRECCL_EAGER_BROADCAST_MAX_BYTES": "64"}
    for rank, (out, dump) in enumerate(_run(envs, seeded.seed)):
        assert all(out), (rank, out)
        m = ONE_WAY_LINE.search(dump)
        assert m and m.group(1) == "64", dump


@pytest.mark.parametrize("size", [2, 3])
def test_mismatch_fails_every_rank_in_the_call_with_the_path_off(size, seeded):
    envs = [{} for _ in range(size)]
    envs[0] = {"SPYRECCL_EAGER_BROADCAST_MAX_BYTES": "0"}
    for rank, (kind, text) in enumerate(_run(envs, seeded.seed, mismatch=True)):
        assert kind == "MismatchError", (rank, kind, text)
        assert re.search(r"rank \d+ called .* but rank \d+ called ", text), text
    ok = _run(envs, seeded.seed)
    for rank, (out, dump) in enumerate(ok):
        assert all(out), (rank, out)
        assert "one-way broadcasts: off (SPYRECCL_EAGER_BROADCAST_MAX_BYTES=0" in dump, dump


def test_a_limit_above_the_ring_slot_is_refused(seeded):
    # The setting is checked before the rank looks for its peers: rank 0 alone fails at once.
    uid = spyreccl_core.UniqueId().to_bytes()
    args = [(0, 2, uid, {"SPYRECCL_EAGER_BROADCAST_MAX_BYTES": "257"}, seeded.seed, False)]
    with own_processes(_rank_main, args, method="spawn") as (pipes, _):
        assert pipes[0].poll(60), "rank 0 did not report"
        kind, text = pipes[0].recv()
        assert kind == "error", text
        assert "SPYRECCL_EAGER_BROADCAST_MAX_BYTES = 257" in text and "256" in text, text
