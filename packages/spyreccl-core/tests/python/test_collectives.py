"""Collectives x every data type x every reduce op, on 2 and 3 ranks, against numpy.

Each case runs every size of sizes_for(type) — empty, one element, an odd length and a length
beyond the staging area — on fresh random inputs with poisoned outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from core_support import (
    ALL_TYPES,
    STAGING_BYTES,
    TYPES_BY_NAME,
    TType,
    assert_bytes_equal,
    check_reduction,
    inputs_for,
    invalid_ops,
    valid_ops,
)

import spyreccl_core
from spyreccl_core import ReduceOp


def sizes_for(tt: TType) -> list[int]:
    beyond_staging = 2 * STAGING_BYTES // tt.storage.itemsize + 7
    return [0, 1, 1001, beyond_staging]


REDUCTION_CASES = [(tt, op) for tt in ALL_TYPES for op in valid_ops(tt)]
SCALAR = 0.625  # PREMUL_SUM scalar: exact in every format, not a power of two


def _scalar(op: ReduceOp) -> float | None:
    return SCALAR if op == ReduceOp.PREMUL_SUM else None


def _ids(case) -> str:
    tt, op = case
    return f"{tt.name}-{op.name}"


# ---------------------------------------------------------------------------------------
# Cases executed on every rank (module level so that they pickle by reference)
# ---------------------------------------------------------------------------------------


def rank_all_reduce(comm, name, op, seed):
    tt = TYPES_BY_NAME[name]
    results = []
    for n in sizes_for(tt):
        x = inputs_for(tt, seed, 0, comm.rank, n)
        out = tt.poison(n)
        comm.all_reduce(x, out, op, scalar=_scalar(op), **tt.kwargs)
        in_place = x.copy()
        comm.all_reduce(in_place, op=op, scalar=_scalar(op), **tt.kwargs)
        results.append((out, in_place))
    return results


def reduce_plan(tt: TType) -> list[tuple[ReduceOp, int]]:
    """reduce/reduce_scatter: SUM at every size, every other valid op at an odd size (the
    reduction kernels themselves are covered op by op through all_reduce)."""
    plan = [(ReduceOp.SUM, n) for n in sizes_for(tt)]
    return plan + [(op, 1001) for op in valid_ops(tt) if op != ReduceOp.SUM]


def rank_reduce(comm, name, root, seed):
    tt = TYPES_BY_NAME[name]
    results = []
    for op, n in reduce_plan(tt):
        x = inputs_for(tt, seed, 1, comm.rank, n)
        out = tt.poison(n) if comm.rank == root else None
        comm.reduce(x, out, root, op, scalar=_scalar(op), **tt.kwargs)
        in_place = x.copy()
        comm.reduce(in_place, None, root, op, scalar=_scalar(op), **tt.kwargs)
        results.append((out, in_place))
    return results


def rank_reduce_scatter(comm, name, seed):
    tt = TYPES_BY_NAME[name]
    results = []
    for op, n in reduce_plan(tt):
        x = inputs_for(tt, seed, 2, comm.rank, n * comm.size)
        out = tt.poison(n)
        comm.reduce_scatter(x, out, op, scalar=_scalar(op), **tt.kwargs)
        # In place: recv is block `rank` of send.
        whole = x.copy()
        block = whole[comm.rank * n : (comm.rank + 1) * n]
        comm.reduce_scatter(whole, block, op, scalar=_scalar(op), **tt.kwargs)
        results.append((out, block.copy()))
    return results


def rank_movement(comm, name, operation, root, seed):
    """Data-movement collectives; returns what each rank received (None where nothing)."""
    tt = TYPES_BY_NAME[name]
    size, rank = comm.size, comm.rank
    results = []
    for n in sizes_for(tt):
        kw = tt.kwargs
        if operation == "broadcast":
            buf = inputs_for(tt, seed, 3, rank, n) if rank == root else tt.poison(n)
            comm.broadcast(buf, root, **kw)
            results.append(buf)
        elif operation == "all_gather":
            x = inputs_for(tt, seed, 4, rank, n)
            out = tt.poison(n * size)
            comm.all_gather(x, out, **kw)
            in_place = tt.poison(n * size)
            in_place[rank * n : (rank + 1) * n] = x
            comm.all_gather(in_place[rank * n : (rank + 1) * n], in_place, **kw)
            results.append((out, in_place))
        elif operation == "gather":
            x = inputs_for(tt, seed, 5, rank, n)
            out = tt.poison(n * size) if rank == root else None
            comm.gather(x, out, root, **kw)
            # In place on the root: its send is block `root` of recv.
            in_place = tt.poison(n * size) if rank == root else None
            if rank == root:
                in_place[root * n : (root + 1) * n] = x
                comm.gather(in_place[root * n : (root + 1) * n], in_place, root, **kw)
            else:
                comm.gather(x, None, root, **kw)
            results.append((out, in_place))
        elif operation == "scatter":
            whole = inputs_for(tt, seed, 6, rank, n * size) if rank == root else None
            out = tt.poison(n)
            comm.scatter(whole, out, root, **kw)
            # In place on the root: its recv is block `root` of send.
            if rank == root:
                copy = whole.copy()
                comm.scatter(copy, copy[root * n : (root + 1) * n], root, **kw)
                untouched = np.array_equal(copy.view(np.uint8), whole.view(np.uint8))
            else:
                other = tt.poison(n)
                comm.scatter(None, other, root, **kw)
                untouched = np.array_equal(other.view(np.uint8), out.view(np.uint8))
            results.append((out, untouched))
        elif operation == "all_to_all":
            x = inputs_for(tt, seed, 7, rank, n * size)
            out = tt.poison(n * size)
            comm.all_to_all(x, out, **kw)
            results.append(out)
        else:
            raise AssertionError(operation)
    return results


def v_counts(seed: int, n: int, size: int) -> np.ndarray:
    """counts[s, d]: elements rank s sends to rank d (zeros included)."""
    rng = np.random.default_rng([seed, 8, n])
    counts = rng.integers(0, n + 1, (size, size))
    counts[rng.random((size, size)) < 0.2] = 0
    return counts


def rank_all_to_all_v(comm, name, seed, gapped):
    tt = TYPES_BY_NAME[name]
    size, rank = comm.size, comm.rank
    results = []
    for n in sizes_for(tt)[:3] + [sizes_for(tt)[3] // size]:
        counts = v_counts(seed, n, size)
        send_counts = counts[rank]
        recv_counts = counts[:, rank]
        # gapped: blocks separated by one unused element, in reverse rank order.
        send_displs = _displs(send_counts, gapped)
        recv_displs = _displs(recv_counts, gapped)
        x = inputs_for(tt, seed, 9, rank, int(send_counts.sum()) + (size if gapped else 0))
        out = tt.poison(int(recv_counts.sum()) + (size if gapped else 0))
        comm.all_to_all_v(
            x,
            send_counts.tolist(),
            out,
            recv_counts.tolist(),
            send_displs if gapped else None,
            recv_displs if gapped else None,
            **tt.kwargs,
        )
        results.append(out)
    return results


def _displs(counts: np.ndarray, gapped: bool) -> list[int]:
    if not gapped:
        return np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    displs = [0] * len(counts)
    offset = 0
    for p in reversed(range(len(counts))):
        displs[p] = offset
        offset += int(counts[p]) + 1
    return displs


def rank_invalid_op(comm, name, op):
    tt = TYPES_BY_NAME[name]
    x = tt.random(np.random.default_rng(), 5)
    try:
        comm.all_reduce(x, tt.poison(5), op, scalar=_scalar(op), **tt.kwargs)
    except spyreccl_core.InvalidArgumentError as e:
        error = e
    else:
        error = None
    # InvalidArgument leaves the communicator usable.
    y = np.ones(3, dtype=np.int32)
    comm.all_reduce(y)
    return error, int(y[0])


# ---------------------------------------------------------------------------------------
# Tests (parent side: regenerate every rank's inputs and check every rank's outputs)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", REDUCTION_CASES, ids=_ids)
def test_all_reduce(rank_pool, seeded, case):
    tt, op = case
    outputs = rank_pool.run(rank_all_reduce, tt.name, op, seeded.seed)
    for i, n in enumerate(sizes_for(tt)):
        xs = [inputs_for(tt, seeded.seed, 0, r, n) for r in range(rank_pool.world_size)]
        for variant in (0, 1):
            for rank, per_rank in enumerate(outputs):
                what = f"all_reduce {tt.name} {op.name} n={n} rank={rank} in_place={variant}"
                check_reduction(tt, op, per_rank[i][variant], xs, _scalar(op), what)
            first = outputs[0][i][variant]
            for rank, per_rank in enumerate(outputs[1:], 1):
                assert_bytes_equal(per_rank[i][variant], first, f"rank {rank} differs from 0")


@pytest.mark.parametrize("tt", ALL_TYPES, ids=lambda t: t.name)
def test_reduce(rank_pool, seeded, tt):
    root = int(seeded.rng().integers(rank_pool.world_size))
    outputs = rank_pool.run(rank_reduce, tt.name, root, seeded.seed)
    for i, (op, n) in enumerate(reduce_plan(tt)):
        xs = [inputs_for(tt, seeded.seed, 1, r, n) for r in range(rank_pool.world_size)]
        out, in_place = outputs[root][i]
        check_reduction(tt, op, out, xs, _scalar(op), f"reduce {op.name} n={n} root={root}")
        check_reduction(tt, op, in_place, xs, _scalar(op), f"in-place reduce {op.name} n={n}")
        for rank in range(rank_pool.world_size):
            if rank != root:  # sendbuff of non-roots is input only
                assert_bytes_equal(outputs[rank][i][1], xs[rank], f"non-root {rank} touched")


@pytest.mark.parametrize("tt", ALL_TYPES, ids=lambda t: t.name)
def test_reduce_scatter(rank_pool, seeded, tt):
    outputs = rank_pool.run(rank_reduce_scatter, tt.name, seeded.seed)
    for i, (op, n) in enumerate(reduce_plan(tt)):
        xs = [
            inputs_for(tt, seeded.seed, 2, r, n * rank_pool.world_size)
            for r in range(rank_pool.world_size)
        ]
        for rank in range(rank_pool.world_size):
            blocks = [x[rank * n : (rank + 1) * n] for x in xs]
            for variant in (0, 1):
                what = f"reduce_scatter {op.name} n={n} rank={rank} in_place={variant}"
                check_reduction(tt, op, outputs[rank][i][variant], blocks, _scalar(op), what)


@pytest.mark.parametrize("tt", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "operation", ["broadcast", "all_gather", "gather", "scatter", "all_to_all"]
)
def test_data_movement(rank_pool, seeded, operation, tt):
    root = int(seeded.rng().integers(rank_pool.world_size))
    outputs = rank_pool.run(rank_movement, tt.name, operation, root, seeded.seed)
    size = rank_pool.world_size
    for i, n in enumerate(sizes_for(tt)):
        what = f"{operation} {tt.name} n={n} root={root}"
        for rank in range(size):
            got = outputs[rank][i]
            if operation == "broadcast":
                expected = inputs_for(tt, seeded.seed, 3, root, n)
                assert_bytes_equal(got, expected, f"{what} rank={rank}")
            elif operation == "all_gather":
                expected = np.concatenate(
                    [inputs_for(tt, seeded.seed, 4, r, n) for r in range(size)]
                )
                assert_bytes_equal(got[0], expected, f"{what} rank={rank}")
                assert_bytes_equal(got[1], expected, f"{what} rank={rank} in place")
            elif operation == "gather":
                if rank == root:
                    expected = np.concatenate(
                        [inputs_for(tt, seeded.seed, 5, r, n) for r in range(size)]
                    )
                    assert_bytes_equal(got[0], expected, what)
                    assert_bytes_equal(got[1], expected, f"{what} in place")
            elif operation == "scatter":
                whole = inputs_for(tt, seeded.seed, 6, root, n * size)
                assert_bytes_equal(got[0], whole[rank * n : (rank + 1) * n], f"{what} rank={rank}")
                assert got[1], f"{what} rank={rank}: second (in-place on root) scatter differs"
            elif operation == "all_to_all":
                expected = np.concatenate(
                    [
                        inputs_for(tt, seeded.seed, 7, r, n * size)[rank * n : (rank + 1) * n]
                        for r in range(size)
                    ]
                )
                assert_bytes_equal(got, expected, f"{what} rank={rank}")


@pytest.mark.parametrize("gapped", [False, True], ids=["packed", "gapped"])
@pytest.mark.parametrize("tt", ALL_TYPES, ids=lambda t: t.name)
def test_all_to_all_v(rank_pool, seeded, tt, gapped):
    outputs = rank_pool.run(rank_all_to_all_v, tt.name, seeded.seed, gapped)
    size = rank_pool.world_size
    for i, n in enumerate(sizes_for(tt)[:3] + [sizes_for(tt)[3] // size]):
        counts = v_counts(seeded.seed, n, size)
        for rank in range(size):
            got = outputs[rank][i]
            recv_displs = _displs(counts[:, rank], gapped)
            for src in range(size):
                sent = inputs_for(
                    tt, seeded.seed, 9, src, int(counts[src].sum()) + (size if gapped else 0)
                )
                s_off = _displs(counts[src], gapped)[rank]
                c = int(counts[src, rank])
                r_off = recv_displs[src]
                assert_bytes_equal(
                    got[r_off : r_off + c],
                    sent[s_off : s_off + c],
                    f"all_to_all_v n={n} rank={rank} block from {src}",
                )
            if gapped:  # the gaps between blocks must stay untouched
                gaps = [recv_displs[src] + int(counts[src, rank]) for src in range(size)]
                assert_bytes_equal(got[gaps], tt.poison(size), f"gap overwritten on {rank}")


@pytest.mark.parametrize(
    "case",
    [(tt, op) for tt in ALL_TYPES for op in invalid_ops(tt)],
    ids=_ids,
)
def test_invalid_op_for_dtype(rank_pool, case):
    tt, op = case
    for error, after in rank_pool.run(rank_invalid_op, tt.name, op):
        assert isinstance(error, spyreccl_core.InvalidArgumentError), error
        assert error.code == spyreccl_core.Result.INVALID_ARGUMENT
        assert after == rank_pool.world_size


def rank_split(comm, seed):
    rng = np.random.default_rng([seed, comm.rank])
    # Even ranks form one communicator ordered by descending old rank; odd ranks get none.
    color = 0 if comm.rank % 2 == 0 else None
    sub = comm.split(color, key=-comm.rank)
    if sub is None:
        return None
    with sub:
        x = rng.uniform(-1, 1, 257)
        out = np.full_like(x, np.nan)
        sub.all_reduce(x, out)
        gathered = np.full(sub.size, -1, dtype=np.int64)
        sub.all_gather(np.array([comm.rank], dtype=np.int64), gathered)
        return sub.rank, sub.size, x, out, gathered


def test_split(rank_pool, seeded):
    results = rank_pool.run(rank_split, seeded.seed)
    members = [r for r in range(rank_pool.world_size) if r % 2 == 0]
    for rank in range(rank_pool.world_size):
        if rank not in members:
            assert results[rank] is None
            continue
        sub_rank, sub_size, _, out, gathered = results[rank]
        assert sub_size == len(members)
        assert sub_rank == sorted(members, reverse=True).index(rank)
        expected = sum(results[m][2] for m in members)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
        assert gathered.tolist() == sorted(members, reverse=True)


def rank_multidimensional(comm, seed):
    x = np.random.default_rng([seed, comm.rank]).uniform(-1, 1, (3, 5, 7)).astype(np.float32)
    out = np.full_like(x, np.nan)
    comm.all_reduce(x, out, ReduceOp.MAX)
    return x, out


def test_multidimensional_buffers(rank_pool, seeded):
    results = rank_pool.run(rank_multidimensional, seeded.seed)
    expected = np.maximum.reduce([x for x, _ in results])
    for _, out in results:
        assert out.shape == (3, 5, 7)
        np.testing.assert_array_equal(out, expected)
