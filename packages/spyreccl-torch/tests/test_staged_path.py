"""The staged path: spyre memory the host cannot address moves through host buffers.

With ``SPYRECCL_SPYRE_MEMORY=discrete`` the emulated device declares spyre memory not
host-addressable (``_C._host_addressable("spyre")`` is False) and the backend stages every
spyre tensor through host buffers with the device's own copies: one copy each way up to one
chunk (through a preallocated small slot up to 64 KiB), a chunk pipeline above it
(all_reduce, broadcast, all_gather, reduce_scatter, gather, scatter, all_to_all with equal
or split sizes, reduce). These tests prove from the backend's staging counters that the
staged path ran, how many chunks a pipeline split a message into (a split-size all_to_all:
the count its ranks agreed on), that small slots come back, and that the
default ``host`` mode stays zero-copy (counters stay 0) — always against float64
references computed on the host from every rank's inputs.
The rest of the suite runs in discrete mode through ``nox -s tests_discrete``.
"""

from __future__ import annotations

import datetime
import math
import time

import pytest
import torch
import torch.distributed as dist
from _staging_support import CHUNK_BYTES, DISCRETE, POOL
from _staging_support import counters as _counters
from _staging_support import delta as _delta

pytestmark = pytest.mark.rank_pool_options(**POOL, env=DISCRETE)

# Element counts: one element, one chunk exactly (int64, the widest dtype used), just over
# one chunk, several chunks with an odd remainder.
SMALL = [1, CHUNK_BYTES // 8]
LARGE = [1025, 5001]


def _inputs(seed: int, world: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input, generated identically on each rank (fresh random values)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return [
            torch.randn(numel, generator=g, dtype=torch.float64).to(dtype) for _ in range(world)
        ]
    return [torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype) for _ in range(world)]


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    actual = actual.cpu().to(torch.float64)
    tol = {torch.bfloat16: 5e-2, torch.float32: 1e-5}.get(dtype, 0.0)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=what)


def _poisoned(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.full((numel,), 77, dtype=dtype, device=device)


def staged_collectives(seed: int, numel: int, ctx):
    """all_reduce (SUM, MAX, AVG), broadcast, all_gather_into_tensor, reduce_scatter_tensor,
    all_to_all_single and send/recv on spyre tensors; returns the counter delta."""
    from spyreccl_torch import _C

    assert not _C._host_addressable("spyre"), "discrete mode must declare spyre not addressable"
    assert _C._staging_chunk_bytes() == CHUNK_BYTES
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    before = _counters()
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.int64)):
        inputs = _inputs(seed + i, world, numel, dtype)
        exact = torch.stack([t.to(torch.float64) for t in inputs])
        t = inputs[rank].to(dev)
        dist.all_reduce(t)
        _close(t, exact.sum(0), dtype, f"all_reduce SUM {dtype} n={numel}")
        t = inputs[rank].to(dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        _close(t, exact.max(0).values, dtype, f"all_reduce MAX {dtype} n={numel}")
        if dtype.is_floating_point:
            t = inputs[rank].to(dev)
            work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
            work.wait()
            _close(t, exact.mean(0), dtype, f"all_reduce AVG async {dtype} n={numel}")
        # broadcast from the last rank
        t = inputs[rank].to(dev) if rank == world - 1 else _poisoned(numel, dtype, dev)
        dist.broadcast(t, src=world - 1)
        _close(t, exact[world - 1], dtype, f"broadcast {dtype} n={numel}")
        # all_gather into one tensor
        out = _poisoned(numel * world, dtype, dev)
        dist.all_gather_into_tensor(out, inputs[rank].to(dev))
        _close(out, exact.reshape(-1), dtype, f"all_gather_into_tensor {dtype} n={numel}")
        # reduce_scatter: each rank's input holds `world` blocks of numel
        blocks = _inputs(seed + 100 + i, world, numel * world, dtype)
        exact_blocks = torch.stack([b.to(torch.float64) for b in blocks]).sum(0)
        out = _poisoned(numel, dtype, dev)
        dist.reduce_scatter_tensor(out, blocks[rank].to(dev))
        _close(
            out, exact_blocks[rank * numel : (rank + 1) * numel], dtype, f"reduce_scatter {dtype}"
        )
    # gather to the last rank, scatter from rank 0 (float64: exact)
    parts = _inputs(seed + 400, world, numel, torch.float64)
    gathered = [_poisoned(numel, torch.float64, dev) for _ in range(world)]
    root = world - 1
    dist.gather(parts[rank].to(dev), gathered if rank == root else None, dst=root)
    if rank == root:
        for r in range(world):
            _close(gathered[r], parts[r], torch.float64, f"gather block {r} n={numel}")
    pieces = _inputs(seed + 500, 1, numel * world, torch.float64)[0].view(world, numel)
    out = _poisoned(numel, torch.float64, dev)
    dist.scatter(out, [p.to(dev) for p in pieces] if rank == 0 else None, src=0)
    _close(out, pieces[rank], torch.float64, f"scatter n={numel}")
    # all_to_all_single (equal splits) and a ring send/recv (one copy each way)
    blocks = _inputs(seed + 200, world, numel * world, torch.float32)
    out = _poisoned(numel * world, torch.float32, dev)
    dist.all_to_all_single(out, blocks[rank].to(dev))
    expected = torch.cat([blocks[r][rank * numel : (rank + 1) * numel] for r in range(world)])
    _close(out, expected.to(torch.float64), torch.float32, "all_to_all_single")
    if world > 1:
        msg = _inputs(seed + 300, world, numel, torch.float32)
        recv = _poisoned(numel, torch.float32, dev)
        ops = [
            dist.P2POp(dist.isend, msg[rank].to(dev), (rank + 1) % world),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        _close(recv, msg[(rank - 1) % world].to(torch.float64), torch.float32, "ring send/recv")
    dist.barrier()
    after = _counters()
    delta = _delta(before, after)
    # A state, not a count: every operation above completed, so every slot is back.
    delta["slots_in_use"] = after["slots_in_use"]
    return delta


@pytest.mark.parametrize("numel", SMALL)
def test_small_messages_take_one_copy_each_way(rank_pool, seeded, numel):
    for delta in rank_pool.run(staged_collectives, seeded.seed, numel, timeout=300):
        assert delta["staged_buffers"] > 0, delta
        assert delta["bytes_to_host"] > 0 and delta["bytes_from_host"] > 0, delta
        assert delta["pipelined_ops"] == 0, f"{numel} elements fit one chunk: {delta}"
        # Up to 64 KiB a staged buffer takes a preallocated slot, not a pool block; the
        # largest here (all_gather's output: world x 4096 bytes) fits one.
        assert delta["slot_buffers"] == delta["staged_buffers"], delta
        assert delta["slots_in_use"] == 0, delta


def many_small_buffers_at_once(seed: int, ctx):
    """More small staged buffers in flight at once than there are slots (a batch of 40
    sends and 40 receives): the ones beyond the slots come from the pool; every message
    arrives intact and every slot comes back."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    count, numel = 40, 33
    before = _counters()
    msgs = [_inputs(seed + i, world, numel, torch.float32) for i in range(count)]
    recvs = [_poisoned(numel, torch.float32, dev) for _ in range(count)]
    ops = []
    for i in range(count):
        ops.append(dist.P2POp(dist.isend, msgs[i][rank].to(dev), (rank + 1) % world, tag=i))
        ops.append(dist.P2POp(dist.irecv, recvs[i], (rank - 1) % world, tag=i))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for i in range(count):
        expected = msgs[i][(rank - 1) % world].to(torch.float64)
        _close(recvs[i], expected, torch.float32, f"batched message {i}")
    after = _counters()
    delta = _delta(before, after)
    delta["slots_in_use"] = after["slots_in_use"]
    return delta


def test_more_small_buffers_than_slots(rank_pool, seeded):
    for delta in rank_pool.run(many_small_buffers_at_once, seeded.seed, timeout=300):
        assert delta["staged_buffers"] >= 80, delta
        assert 0 < delta["slot_buffers"] < delta["staged_buffers"], delta
        assert delta["slots_in_use"] == 0, delta


@pytest.mark.parametrize("numel", LARGE)
def test_large_messages_run_as_chunk_pipelines(rank_pool, seeded, numel):
    for delta in rank_pool.run(staged_collectives, seeded.seed, numel, timeout=300):
        assert delta["pipelined_ops"] > 0, delta
        assert delta["pipeline_chunks"] > delta["pipelined_ops"], delta


def pipelines_per_operation(seed: int, numel: int, ctx):
    """gather, scatter, all_to_all_single and reduce of `numel` elements per rank's block (an odd
    count spanning several chunks), on fresh inputs into poisoned outputs, each checked
    against its float64 reference; returns each operation's pipelines and chunks."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    counts = {}

    def measured(name, fn):
        before = _counters()
        fn()
        delta = _delta(before, _counters())
        counts[name] = (delta["pipelined_ops"], delta["pipeline_chunks"])

    parts = _inputs(seed, world, numel, torch.float64)
    gathered = [_poisoned(numel, torch.float64, dev) for _ in range(world)]
    root = world - 1
    measured(
        "gather",
        lambda: dist.gather(parts[rank].to(dev), gathered if rank == root else None, dst=root),
    )
    if rank == root:
        for r in range(world):
            _close(gathered[r], parts[r], torch.float64, f"gather block {r}")
    pieces = _inputs(seed + 1, 1, numel * world, torch.float64)[0].view(world, numel)
    out = _poisoned(numel, torch.float64, dev)
    sources = [p.to(dev) for p in pieces] if rank == 0 else None
    measured("scatter", lambda: dist.scatter(out, sources, src=0))
    _close(out, pieces[rank], torch.float64, "scatter")
    blocks = _inputs(seed + 2, world, numel * world, torch.float64)
    out = _poisoned(numel * world, torch.float64, dev)
    source = blocks[rank].to(dev)
    measured("all_to_all_single", lambda: dist.all_to_all_single(out, source))
    expected = torch.cat([blocks[r][rank * numel : (rank + 1) * numel] for r in range(world)])
    _close(out, expected, torch.float64, "all_to_all_single")
    # reduce to the last rank, int64 (exact): the root's tensor in place, the others kept.
    values = _inputs(seed + 3, world, numel, torch.int64)
    contribution = values[rank].to(dev)
    measured("reduce", lambda: dist.reduce(contribution, dst=root))
    expected_reduce = torch.stack(values).sum(0) if rank == root else values[rank]
    _close(contribution, expected_reduce.to(torch.float64), torch.int64, "reduce")
    # In place (input is the output): staged whole, not pipelined.
    inplace = blocks[rank].to(dev)
    measured("all_to_all_single in place", lambda: dist.all_to_all_single(inplace, inplace))
    _close(inplace, expected, torch.float64, "all_to_all_single in place")
    return counts


# 2049 float64 per block: 16392 bytes, 5 chunks of at most 4096 bytes (the last one short).
def test_gather_scatter_all_to_all_reduce_run_as_pipelines(rank_pool, seeded):
    numel = 2049
    chunks = math.ceil(numel * 8 / CHUNK_BYTES)
    for counts in rank_pool.run(pipelines_per_operation, seeded.seed, numel, timeout=300):
        for op in ("gather", "scatter", "all_to_all_single", "reduce"):
            assert counts[op] == (1, chunks), (op, counts)
        assert counts["all_to_all_single in place"] == (0, 0), counts


def _split_counts(world: int, large: int) -> list[list[int]]:
    """counts[r][p]: rows rank r sends to rank p. Uneven, one pair empty, and one pair
    (the last rank to rank 0) of `large` rows: the only message past one chunk, so the ranks
    that neither send nor receive it must learn the chunk count from the others."""
    counts = [[3 + 5 * r + 2 * p for p in range(world)] for r in range(world)]
    counts[0][world - 1] = 0
    counts[world - 1][0] = large
    return counts


def split_all_to_all(seed: int, large: int, ctx):
    """all_to_all_single with split sizes (rows of 3 elements) and the list form, every dtype
    family, fresh inputs into poisoned outputs, each checked exactly against the blocks the
    peers sent; returns each case's (pipelined_ops, pipeline_chunks, staged_buffers)."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    counts = _split_counts(world, large)
    sends = counts[rank]
    recvs = [counts[p][rank] for p in range(world)]
    result = {}
    for index, dtype in enumerate(
        (torch.float64, torch.bfloat16, torch.int32, torch.complex64, torch.uint8)
    ):
        parts = []
        for r in range(world):
            g = torch.Generator().manual_seed(seed + 17 * index + r)
            shape = (sum(counts[r]), 3)
            if dtype == torch.uint8:
                parts.append(torch.randint(0, 256, shape, dtype=dtype, generator=g))
            elif dtype == torch.complex64:
                parts.append(torch.randn(shape, dtype=torch.complex64, generator=g))
            else:
                parts.append(_inputs(seed + 17 * index + r, 1, shape[0] * 3, dtype)[0].view(shape))
        # Rows of rank p's input bound for this rank, in rank order.
        expected = torch.cat(
            [parts[p][sum(counts[p][:rank]) : sum(counts[p][: rank + 1])] for p in range(world)]
        )
        out = torch.full((sum(recvs), 3), 77, dtype=dtype, device=dev)
        before = _counters()
        dist.all_to_all_single(out, parts[rank].to(dev), recvs, sends)
        delta = _delta(before, _counters())
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0, msg=f"{dtype}")
        result[str(dtype)] = (
            delta["pipelined_ops"],
            delta["pipeline_chunks"],
            delta["staged_buffers"],
        )
    # The list form: one tensor per peer, packed into one buffer by the backend.
    parts = [_inputs(seed + 99 + r, 1, sum(counts[r]), torch.float32)[0] for r in range(world)]
    inputs = list(parts[rank].to(dev).split(sends))
    outputs = [torch.full((n,), 77.0, device=dev) for n in recvs]
    before = _counters()
    dist.all_to_all(outputs, inputs)
    delta = _delta(before, _counters())
    for p in range(world):
        start = sum(counts[p][:rank])
        torch.testing.assert_close(
            outputs[p].cpu(), parts[p][start : start + recvs[p]], rtol=0, atol=0, msg=f"from {p}"
        )
    result["list"] = (delta["pipelined_ops"], delta["pipeline_chunks"], delta["staged_buffers"])
    return result


# The large pair's bytes: rows of 3 elements (the list form: 1-D, float32). With 700 rows:
# float64 and complex64 16800 bytes (5 chunks of 4096), int32 8400 (3), bfloat16 4200 (2),
# uint8 2100 and the list form 2800 (one chunk: staged whole). With 3000 rows float64, int32 and
# complex64 reach the 8-chunk cap, bfloat16 makes 5, uint8 and the list form 3.
SPLIT_CASES = {
    "torch.float64": 24,
    "torch.bfloat16": 6,
    "torch.int32": 12,
    "torch.complex64": 24,
    "torch.uint8": 3,
    "list": 4,
}


@pytest.mark.parametrize("large", [700, 3000])
def test_split_all_to_all_pipelines_on_the_agreed_chunk_count(rank_pool, seeded, large):
    for rank, result in enumerate(rank_pool.run(split_all_to_all, seeded.seed, large, timeout=300)):
        for case, row_bytes in SPLIT_CASES.items():
            chunks = min(8, math.ceil(large * row_bytes / CHUNK_BYTES))
            pipelined, ran, staged = result[case]
            if chunks > 1:
                # Every rank, whether or not the large pair is its own, ran the same chunks.
                assert (pipelined, ran) == (1, chunks), (rank, case, result[case])
            else:
                assert (pipelined, ran, staged) == (0, 0, 2), (rank, case, result[case])


def pipeline_chunks_of_all_reduce(seed: int, numel: int, ctx):
    """One float32 all_reduce of `numel` elements, non-contiguous (a transposed view):
    checked, and returns the counter delta."""
    world, rank = ctx.world_size, ctx.rank
    inputs = _inputs(seed, world, numel, torch.float32)
    before = _counters()
    # numel = 2 * k: a (2, k) tensor transposed to (k, 2) is not contiguous.
    t = inputs[rank].view(2, -1).to(ctx.device).t()
    assert not t.is_contiguous()
    dist.all_reduce(t)
    delta = _delta(before, _counters())
    expected = torch.stack([x.to(torch.float64) for x in inputs]).sum(0).view(2, -1).t()
    _close(t, expected, torch.float32, "non-contiguous all_reduce")
    return delta


# (elements, chunks): 20800 bytes of float32 make 6 chunks of at most 4096 bytes; 160000
# bytes would make 40, but a pipeline has at most 8 (its chunks grow instead).
@pytest.mark.parametrize(("numel", "chunks"), [(2 * 2600, 6), (2 * 20_000, 8)])
def test_pipeline_splits_along_the_chunk_size(rank_pool, seeded, numel, chunks):
    assert chunks == min(8, math.ceil(numel * 4 / CHUNK_BYTES))
    for delta in rank_pool.run(pipeline_chunks_of_all_reduce, seeded.seed, numel, timeout=120):
        assert delta["pipelined_ops"] == 1, delta
        assert delta["pipeline_chunks"] == chunks, delta
        assert delta["bytes_to_host"] == numel * 4 and delta["bytes_from_host"] == numel * 4


def large_staged_buffers(seed: int, ctx):
    """An all_reduce and an all_gather of 300 000 float32 per rank (1.2 MiB: past the core's
    256 KiB direct-path floor), fresh inputs into poisoned outputs, checked against float64;
    returns the counter delta."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    numel = 300_000
    inputs = _inputs(seed, world, numel, torch.float32)
    exact = torch.stack([x.to(torch.float64) for x in inputs])
    before = _counters()
    t = inputs[rank].to(dev)
    dist.all_reduce(t)
    out = _poisoned(numel * world, torch.float32, dev)
    dist.all_gather_into_tensor(out, inputs[rank].to(dev))
    delta = _delta(before, _counters())
    _close(t, exact.sum(0), torch.float32, "all_reduce 1.2 MiB")
    _close(out, exact.reshape(-1), torch.float32, "all_gather_into_tensor 1.2 MiB")
    return delta


@pytest.mark.parametrize("arena", ["default", "off"])
def test_large_host_buffers_come_from_the_core_arena(make_pool, seeded, arena):
    """Large staging buffers are the core's shareable memory (peers read them in place, one
    copy between processes instead of two); SPYRECCL_STAGING_ARENA=0 keeps them pinned."""
    env = dict(DISCRETE, **({"SPYRECCL_STAGING_ARENA": "0"} if arena == "off" else {}))
    pool = make_pool(2, **POOL, env=env)
    for delta in pool.run(large_staged_buffers, seeded.seed, timeout=120):
        assert delta["pipelined_ops"] == 2, delta
        # all_reduce in place: one host buffer; all_gather: its input and its output.
        assert delta["arena_buffers"] == (3 if arena == "default" else 0), delta


def pipelines_per_setting(seed: int, ctx):
    """A 5001-element float32 all_reduce (5 chunks) under each pipeline setting, starting from
    the environment's (auto), each on fresh inputs checked against float64; returns, per
    setting, whether it ran as a pipeline."""
    import os

    from spyreccl_torch import _C

    assert _C._copies_use_host_cpu("spyre"), "the emulated device copies with the host's CPUs"
    assert not _C._copies_use_host_cpu("cpu")
    world, rank = ctx.world_size, ctx.rank
    ran = {}
    for i, setting in enumerate(("auto", "0", "1", "auto")):
        _C._set_staging_pipeline(setting)
        assert _C._staging_pipeline() == setting
        inputs = _inputs(seed + i, world, 5001, torch.float32)
        t = inputs[rank].to(ctx.device)
        before = _counters()
        dist.all_reduce(t)
        delta = _delta(before, _counters())
        _close(t, torch.stack([x.to(torch.float64) for x in inputs]).sum(0), torch.float32, setting)
        ran.setdefault(setting, []).append(delta["pipelined_ops"] == 1)
        assert delta["pipelined_ops"] == 1 or delta["staged_buffers"] == 1, delta
    return ran, os.sysconf("SC_NPROCESSORS_ONLN")


def test_auto_pipelines_where_a_core_is_spare(make_pool, seeded):
    """auto pipelines the emulated device's staged copies (memcpys on the host's cores) only
    where the machine has two online CPUs per rank; 1 and 0 force it either way."""
    env = dict(DISCRETE, SPYRECCL_STAGING_PIPELINE="auto")
    pool = make_pool(2, **POOL, env=env)
    for ran, cpus in pool.run(pipelines_per_setting, seeded.seed, timeout=120):
        spare = cpus >= 2 * 2
        assert ran == {"auto": [spare, spare], "0": [False], "1": [True]}, (ran, cpus)


def pipelined_timeout(ctx):
    """Rank 0 runs a pipelined all_reduce on a 2 s group its peers never join: it must fail
    within the timeout, not hang; the default group keeps working."""
    group = dist.new_group(backend="spyreccl", timeout=datetime.timedelta(seconds=2))
    elapsed = message = None
    if ctx.rank == 0:
        t = torch.randn(50_000, device=ctx.device)
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            dist.all_reduce(t, group=group)
        elapsed, message = time.monotonic() - start, str(info.value)
    check = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(check)
    assert check.cpu().tolist() == [float(sum(range(1, ctx.world_size + 1)))] * 3
    return elapsed, message


def test_pipelined_operation_times_out(make_pool):
    pool = make_pool(2, **POOL, env=DISCRETE)
    elapsed, message = pool.run(pipelined_timeout, timeout=120)[0]
    assert elapsed < 30, f"the pipelined all_reduce took {elapsed:.1f}s to fail"
    assert "allreduce" in message.lower() or "all_reduce" in message.lower(), message


def host_mode_is_zero_copy(seed: int, ctx):
    from spyreccl_torch import _C

    assert _C._host_addressable("spyre"), "host mode must declare spyre memory addressable"
    world, rank = ctx.world_size, ctx.rank
    before = _counters()
    for numel in SMALL + LARGE:
        inputs = _inputs(seed + numel, world, numel, torch.float32)
        t = inputs[rank].to(ctx.device)
        dist.all_reduce(t)
        exact = torch.stack([x.to(torch.float64) for x in inputs]).sum(0)
        _close(t, exact, torch.float32, f"host-mode all_reduce n={numel}")
        out = _poisoned(numel * world, torch.float32, ctx.device)
        dist.all_gather_into_tensor(out, inputs[rank].to(ctx.device))
        _close(out, torch.cat(inputs).to(torch.float64), torch.float32, "host-mode all_gather")
    return _delta(before, _counters())


def test_host_mode_stays_zero_copy(make_pool, seeded):
    pool = make_pool(2, **POOL, env={"SPYRECCL_SPYRE_MEMORY": "host"})
    for delta in pool.run(host_mode_is_zero_copy, seeded.seed, timeout=120):
        assert all(value == 0 for value in delta.values()), delta


def test_capability_is_declared_not_guessed():
    """CPU is host memory; a device type nobody declared is not; a declaration takes effect
    and can be withdrawn; the emulated device declared spyre per its memory mode."""
    from spyreccl_torch import _C
    from spyreccl_torch.device._memory_mode import memory_mode

    assert _C._host_addressable("cpu")
    assert not _C._host_addressable("meta")
    try:
        _C._set_host_addressable("meta", True)
        assert _C._host_addressable("meta")
    finally:
        _C._set_host_addressable("meta", False)
    assert not _C._host_addressable("meta")
    assert _C._host_addressable("spyre") == (memory_mode() == "host")
    with pytest.raises(RuntimeError, match="nosuchdevice"):
        _C._host_addressable("nosuchdevice")
