"""spyreccl_core.empty / SharedBuffer, and collectives on arena memory.

Arrays from spyreccl_core.empty live in the process's memory arena; collectives of at least
SPYRECCL_DIRECT_MIN_BYTES (256 KiB) whose buffers are arena memory on every rank read the
peers' data in place ("direct transfers"). "mixed" runs the same collectives with arena
memory on rank 0 only, which must fall back to the staged path with identical results.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import spyreccl_core

N = 100_003  # float32 elements: 400 KB, above the direct threshold, odd length


def _array(arena: bool, shape, dtype=np.float32) -> np.ndarray:
    return spyreccl_core.empty(shape, dtype) if arena else np.empty(shape, dtype)


def _filled(arena: bool, values: np.ndarray) -> np.ndarray:
    a = _array(arena, values.shape, values.dtype)
    a[...] = values
    return a


def _poisoned(arena: bool, shape) -> np.ndarray:
    a = _array(arena, shape)
    a[...] = np.nan
    return a


def rank_inputs(seed: int, rank: int, size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, rank])
    return {
        "x": rng.standard_normal(N).astype(np.float32),
        "blocks": rng.standard_normal(size * N).astype(np.float32),
    }


def rank_collectives(comm, seed: int, mode: str) -> dict[str, np.ndarray]:
    arena = mode == "arena" or comm.rank == 0
    size, rank = comm.size, comm.rank
    inp = rank_inputs(seed, rank, size)
    out: dict[str, np.ndarray] = {}

    x = _filled(arena, inp["x"])
    y = _poisoned(arena, N)
    comm.all_reduce(x, y)
    out["all_reduce"] = y.copy()
    assert np.array_equal(x, inp["x"]), "all_reduce wrote its input"
    comm.all_reduce(x)  # in place
    out["all_reduce_in_place"] = x.copy()

    buf = _filled(arena, inp["x"]) if rank == size - 1 else _poisoned(arena, N)
    comm.broadcast(buf, size - 1)
    out["broadcast"] = buf.copy()

    g = _poisoned(arena, size * N)
    comm.all_gather(_filled(arena, inp["x"]), g)
    out["all_gather"] = g.copy()

    rs = _poisoned(arena, N)
    comm.reduce_scatter(_filled(arena, inp["blocks"]), rs)
    out["reduce_scatter"] = rs.copy()

    a2a = _poisoned(arena, size * N)
    comm.all_to_all(_filled(arena, inp["blocks"]), a2a)
    out["all_to_all"] = a2a.copy()
    return out


@pytest.mark.parametrize("mode", ["arena", "mixed"])
def test_collectives_on_arena_memory(rank_pool, seeded, mode):
    size = rank_pool.world_size
    outputs = rank_pool.run(rank_collectives, seeded.seed, mode)
    inputs = [rank_inputs(seeded.seed, r, size) for r in range(size)]
    xs = np.stack([i["x"].astype(np.float64) for i in inputs])
    blocks = np.stack([i["blocks"].astype(np.float64) for i in inputs]).reshape(size, size, N)
    total = xs.sum(axis=0)
    tol = dict(rtol=1e-5, atol=1e-5 * size)
    for rank, out in enumerate(outputs):
        where = f"{mode} rank {rank}"
        np.testing.assert_allclose(out["all_reduce"], total, **tol, err_msg=where)
        np.testing.assert_allclose(out["all_reduce_in_place"], total, **tol, err_msg=where)
        assert np.array_equal(out["broadcast"], inputs[size - 1]["x"]), where
        assert np.array_equal(out["all_gather"], np.concatenate([i["x"] for i in inputs])), where
        np.testing.assert_allclose(
            out["reduce_scatter"], blocks[:, rank, :].sum(axis=0), **tol, err_msg=where
        )
        expected_a2a = np.concatenate(
            [inputs[q]["blocks"][rank * N : (rank + 1) * N] for q in range(size)]
        )
        assert np.array_equal(out["all_to_all"], expected_a2a), where
        # One rank reduces each element and the others copy it: identical bits everywhere.
        assert np.array_equal(out["all_reduce"], outputs[0]["all_reduce"]), where


def test_empty_gives_writable_arrays_in_the_arena():
    a = spyreccl_core.empty((3, 5), np.int64)
    assert a.shape == (3, 5) and a.dtype == np.int64 and a.flags.writeable
    assert a.flags.c_contiguous and a.ctypes.data % 4096 == 0
    a[...] = np.arange(15).reshape(3, 5)
    assert a.sum() == 105
    owner = a
    while isinstance(owner, np.ndarray):  # view -> array -> memoryview -> SharedBuffer
        owner = owner.base
    owner = owner.obj if isinstance(owner, memoryview) else owner
    assert isinstance(owner, spyreccl_core.SharedBuffer) and owner.nbytes == 120
    assert spyreccl_core.empty(0).size == 0
    with pytest.raises(ValueError, match="negative dimension"):
        spyreccl_core.empty((2, -1))


def _address(block: spyreccl_core.SharedBuffer) -> int:
    return np.frombuffer(block, np.uint8).ctypes.data


def test_shared_buffer_memory_is_reused_after_release():
    first = spyreccl_core.SharedBuffer(1 << 20)
    fence = spyreccl_core.SharedBuffer(1 << 20)  # keeps first's hole from merging onward
    address = _address(first)
    del first
    gc.collect()
    # Best fit hands the exact-size hole out again: the release returned it.
    again = spyreccl_core.SharedBuffer(1 << 20)
    assert _address(again) == address
    assert _address(fence) != address
