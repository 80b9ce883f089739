"""Bounded soak: thousands of mixed collectives, and process-group churn, without leaks.

One forked 3-rank group runs 2000 collectives of random kinds, sizes (0, odd, up to ~100k
elements, across the one-shot/pipelined thresholds) and dtypes over the world group, two
2-rank sub-groups and two further world-sized groups driven concurrently from two threads.
Every result is checked against a float64 (or exact integer) reference of all ranks'
inputs, which each rank rebuilds from the shared seed. Open fds, threads, RSS and /dev/shm
mappings are measured before and after (after a warm-up that lets allocator caches and
progress threads settle) and must be steady; /dev/shm must hold nothing of ours afterwards.
A second scenario creates and destroys many process groups in a loop and checks the same
footprint.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.distributed as dist
from process_hygiene import (
    mapped_segments,
    new_segments,
    open_fds,
    rss_bytes,
    shm_segments,
    thread_count,
)

from spyreccl_testing.accuracy import assert_close_dtype, reference_reduce
from spyreccl_testing.forked import ForkedGroup, results
from spyreccl_testing.inputs import fresh_seed, poison_, random_tensor, rank_seed

WORLD_SIZE = 3
MAIN_OPS = 1200
THREAD_OPS = 400  # per thread; 1200 + 2 * 400 = 2000 collectives per rank
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64]
KINDS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier"]
# RSS may grow by what allocators keep for reuse: glibc's per-thread malloc arenas (three
# threads issue collectives here), torch's caches and the spyre device's memory arena, which
# keeps freed blocks resident (up to SPYRECCL_ARENA_RETAIN_BYTES; this test's blocks are
# small and reused, so what it keeps is bounded by its largest working set). Measured over
# repeated runs: 7-76 MiB, with no trend between the warm-up and the measured phase. A leak
# of the tensors of every collective (2000 per rank, up to 2.4 MB each) would exceed this
# many times over.
RSS_GROWTH_LIMIT = 128 << 20


def _size(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.05:
        return 0
    if roll < 0.75:
        return rng.randrange(1, 2048)
    return rng.randrange(2048, 100_000)


def _one_collective(rng: random.Random, group, members: list[int], rank: int, what: str) -> int:
    """Runs one random collective on `group` (every member draws the same from `rng`) and
    checks it; returns 1 when this rank took part. Non-members only advance `rng`."""
    kind = rng.choice(KINDS)
    dtype = rng.choice(DTYPES)
    n = _size(rng)
    seed = rng.getrandbits(62)
    root = rng.randrange(len(members))
    op = rng.choice(["sum", "max", "min", "avg"] if kind == "all_reduce" else ["sum"])
    if rank not in members:
        return 0
    size, me = len(members), members.index(rank)
    label = f"{what}: {kind} of {n} x {dtype} on ranks {members} (seed {seed})"

    def inputs(numel):
        return [
            random_tensor(numel, dtype, seed=rank_seed(seed, r), nranks=size) for r in range(size)
        ]

    if kind == "all_reduce":
        xs = inputs(n)
        x = xs[me].to("spyre")
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op.upper()), group=group)
        expected = reference_reduce(xs, op, dtype)
        assert_close_dtype(x.cpu(), expected, dtype, size, seed=seed, what=label)
    elif kind == "all_gather":
        xs = inputs(n)
        out = poison_(torch.empty(n * size, dtype=dtype, device="spyre"))
        dist.all_gather_single(out, xs[me].to("spyre"), group=group)
        assert torch.equal(out.cpu(), torch.cat(xs)), label
    elif kind == "reduce_scatter":
        xs = inputs(n * size)
        out = poison_(torch.empty(n, dtype=dtype, device="spyre"))
        dist.reduce_scatter_single(out, xs[me].to("spyre"), group=group)
        expected = reference_reduce(xs, "sum", dtype)[me * n : (me + 1) * n]
        assert_close_dtype(out.cpu(), expected, dtype, size, seed=seed, what=label)
    elif kind == "broadcast":
        xs = inputs(n)
        x = (
            xs[me].to("spyre")
            if me == root
            else poison_(torch.empty(n, dtype=dtype, device="spyre"))
        )
        dist.broadcast(x, src=members[root], group=group)
        assert torch.equal(x.cpu(), xs[root]), label
    elif kind == "all_to_all":
        xs = inputs(n * size)
        out = poison_(torch.empty(n * size, dtype=dtype, device="spyre"))
        dist.all_to_all_single(out, xs[me].to("spyre"), group=group)
        expected = torch.cat([xs[src][me * n : (me + 1) * n] for src in range(size)])
        assert torch.equal(out.cpu(), expected), label
    else:
        dist.barrier(group=group)
    return 1


def _footprint() -> dict:
    return {
        "fds": open_fds(),
        "threads": thread_count(),
        "rss": rss_bytes(),
        # Segments this process maps (they are unlinked from /dev/shm while in use; the
        # launcher checks /dev/shm itself, other jobs' segments would blur a global view).
        "mapped": sorted(mapped_segments()),
    }


def _stream(seed: int, count: int, group, members, rank, what, done: list) -> None:
    rng = random.Random(seed)
    for i in range(count):
        done[0] += _one_collective(rng, group, members, rank, f"{what} #{i}")


def rank_soak(ctx, seed: int, main_ops: int, thread_ops: int):
    world, rank = ctx.world_size, ctx.rank
    everyone = list(range(world))
    sub_a = dist.new_group([0, 1])
    sub_b = dist.new_group([1, 2])
    threaded = [dist.new_group(everyone), dist.new_group(everyone)]
    groups = [(None, everyone), (sub_a, [0, 1]), (sub_b, [1, 2])]

    def main_stream(count, stream_seed, done):
        rng = random.Random(stream_seed)
        for i in range(count):
            group, members = groups[rng.randrange(len(groups))]
            done[0] += _one_collective(rng, group, members, rank, f"main #{i}")

    def run(count, seeds):
        counts = [[0], [0], [0]]
        errors = []

        def guarded(fn, *args):
            try:
                fn(*args)
            except BaseException as exc:  # reported to the main thread
                errors.append(exc)

        threads = [
            threading.Thread(
                target=guarded,
                args=(
                    _stream,
                    seeds[i + 1],
                    count[1],
                    threaded[i],
                    everyone,
                    rank,
                    f"thread {i}",
                    counts[i + 1],
                ),
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        guarded(main_stream, count[0], seeds[0], counts[0])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return sum(c[0] for c in counts)

    # Warm-up: every group and code path (one-shot and pipelined) has run, and the
    # allocator caches and progress threads exist, before the footprint is taken.
    run((60, 20), [seed + 1, seed + 2, seed + 3])
    before = _footprint()
    performed = run((main_ops, thread_ops), [seed + 4, seed + 5, seed + 6])
    after = _footprint()
    for group in (sub_a, sub_b, *threaded):
        dist.destroy_process_group(group)
    return {"performed": performed, "before": before, "after": after}


def rank_group_churn(ctx, seed: int, rounds: int):
    everyone = list(range(ctx.world_size))

    def one_round(i):
        members = everyone if i % 2 == 0 else [0, 1]
        group = dist.new_group(members)
        if ctx.rank in members:
            x = torch.full((9,), float(ctx.rank + i), device="spyre")
            dist.all_reduce(x, group=group)
            expected = sum(float(r + i) for r in members)
            assert torch.equal(x.cpu(), torch.full((9,), expected)), f"round {i}: {x}"
        dist.destroy_process_group(group)

    for i in range(3):
        one_round(i)
    before = _footprint()
    for i in range(3, 3 + rounds):
        one_round(i)
    after = _footprint()
    return {"before": before, "after": after}


def _run(body, *args):
    before = shm_segments()
    reports = results(ForkedGroup(WORLD_SIZE, body, *args, pg_timeout=60).finish(300))
    return reports, new_segments(before)


def soak_scenario(seed: int, main_ops: int, thread_ops: int):
    return _run(rank_soak, seed, main_ops, thread_ops)


def churn_scenario(seed: int, rounds: int):
    return _run(rank_group_churn, seed, rounds)


def _assert_steady(rank: int, before: dict, after: dict) -> None:
    assert after["fds"] == before["fds"], (
        f"rank {rank}: open fds changed: before {before['fds']}, after {after['fds']}"
    )
    assert after["threads"] == before["threads"], f"rank {rank}: threads {before} -> {after}"
    assert after["mapped"] == before["mapped"], f"rank {rank}: mapped segments {before} -> {after}"
    growth = after["rss"] - before["rss"]
    assert growth < RSS_GROWTH_LIMIT, f"rank {rank}: RSS grew by {growth >> 20} MiB"


def test_soak_mixed_collectives(launcher):
    seed = fresh_seed()
    reports, leaked = launcher.run(soak_scenario, seed, MAIN_OPS, THREAD_OPS, timeout=400)[0]
    for rank, report in enumerate(reports):
        # Rank 1 belongs to every group; the others skip the sub-group they are not in.
        assert report["performed"] >= 2 * THREAD_OPS + MAIN_OPS // 2, (rank, report["performed"])
        _assert_steady(rank, report["before"], report["after"])
    assert reports[1]["performed"] == MAIN_OPS + 2 * THREAD_OPS
    assert not leaked, leaked


@pytest.mark.parametrize("rounds", [40])
def test_group_create_destroy_churn(launcher, rounds):
    reports, leaked = launcher.run(churn_scenario, fresh_seed(), rounds, timeout=300)[0]
    for rank, report in enumerate(reports):
        _assert_steady(rank, report["before"], report["after"])
    assert not leaked, leaked
