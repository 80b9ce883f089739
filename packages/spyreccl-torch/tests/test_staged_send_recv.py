"""Staged send/recv larger than one chunk run as chunk pipelines (peer_pipeline.h).

With ``SPYRECCL_SPYRE_MEMORY=discrete`` a spyre tensor's memory is not host-addressable and
the backend stages it through host buffers. A send or receive larger than one staging chunk
(4 KiB here, the pipeline forced on) travels as a chain of chunk messages whose device copies
overlap the transfer; these tests check every message bit for bit against the sender's
tensor (fresh random values, poisoned receive buffers) for every dtype family, odd lengths,
exactly one chunk and one element (one byte for bytes) over it, blocking pairs, unbatched
isend/irecv rings, batch_isend_irecv, receives from any source, consecutive messages to one
peer, strided tensors and messages beyond the inline bound, and that the staging counters
show a pipeline for every large message and none for the small ones. A size mismatch must
fail the receive with a message naming it, and a receive without a sender must time out
within the group's timeout; host mode stays zero-copy. The pools force discrete memory, so
this file checks the same in both test sessions.
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

from spyreccl_testing.inputs import poison_

pytestmark = pytest.mark.rank_pool_options(**POOL, env=DISCRETE)

# Every dtype family: 4-, 2- and 8-byte types, one-byte types (bool and uint8), complex.
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.bool,
    torch.uint8,
    torch.complex64,
)


def _sizes(dtype: torch.dtype) -> dict[str, int]:
    """Element counts of one dtype: exactly one chunk (not pipelined), one element over it
    (one byte for one-byte types: two chunks, the last of one element), an odd count of
    several chunks, and one large enough to reach the cap of 8 chunks."""
    per_chunk = CHUNK_BYTES // dtype.itemsize
    return {"one chunk": per_chunk, "one over": per_chunk + 1, "odd": 5001, "capped": 20_011}


def _chunks(numel: int, dtype: torch.dtype) -> int:
    """The plan the backend must follow, computed here from its definition: chunks of the
    chunk setting, grown so that a message has at most 8."""
    if numel * dtype.itemsize <= CHUNK_BYTES:
        return 0  # not pipelined
    step = max(CHUNK_BYTES // dtype.itemsize, math.ceil(numel / 8))
    return math.ceil(numel / step)


def _message(seed: int, sender: int, receiver: int, numel: int, dtype: torch.dtype, salt=0):
    """What `sender` sends to `receiver` (every rank can rebuild it): fresh random values."""
    g = torch.Generator().manual_seed((seed + 7919 * sender + 104_729 * receiver + salt) % 2**62)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_complex:
        return torch.randn(numel, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (numel,), generator=g, dtype=dtype)


def _poisoned(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    if dtype.is_complex:
        return torch.full((numel,), complex(math.nan, math.nan), dtype=dtype, device=device)
    return poison_(torch.empty(numel, dtype=dtype, device=device))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().view(torch.uint8)


def _exact(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    same = _bits(actual) == _bits(expected)
    if not bool(same.all()):
        wrong = (~same).nonzero().flatten()
        raise AssertionError(
            f"{what}: {wrong.numel()} of {same.numel()} bytes differ, first at byte {int(wrong[0])}"
        )


def _pipelines_since(before) -> tuple[int, int]:
    after = _counters()
    return (
        after["pipelined_ops"] - before["pipelined_ops"],
        after["pipeline_chunks"] - before["pipeline_chunks"],
    )


def _pairs(numel, dtype, seed, ctx):
    """Blocking dist.send/dist.recv for every ordered pair, one pair at a time."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    for src in range(world):
        for dst in range(world):
            if src == dst or rank not in (src, dst):
                continue
            message = _message(seed, src, dst, numel, dtype)
            if rank == src:
                tensor = message.to(dev)
                dist.send(tensor, dst=dst, tag=3 * src + dst)
                _exact(tensor, message, f"pair {src}->{dst}: the sent tensor")
            else:
                out = _poisoned(numel, dtype, dev)
                assert dist.recv(out, src=src, tag=3 * src + dst) == src
                _exact(out, message, f"pair {src}->{dst}: received")


def _unbatched_ring(numel, dtype, seed, ctx):
    """Every rank isends to its right neighbour and irecvs from its left one, then waits for
    both: the pipeline-parallel exchange, which must not deadlock (both sides in flight)."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    right, left = (rank + 1) % world, (rank - 1) % world
    sent = _message(seed, rank, right, numel, dtype, salt=1)
    tensor = sent.to(dev)
    out = _poisoned(numel, dtype, dev)
    # Half the ranks post the receive first: neither order may deadlock.
    if rank % 2:
        works = [dist.irecv(out, src=left), dist.isend(tensor, dst=right)]
    else:
        works = [dist.isend(tensor, dst=right), dist.irecv(out, src=left)]
    for work in works:
        work.wait()
    _exact(out, _message(seed, left, rank, numel, dtype, salt=1), "unbatched ring: received")
    _exact(tensor, sent, "unbatched ring: the sent tensor")


def _batched_ring(numel, dtype, seed, ctx):
    """batch_isend_irecv in both directions of the ring at once."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    right, left = (rank + 1) % world, (rank - 1) % world
    ops, checks = [], []
    for direction, (to, frm) in enumerate(((right, left), (left, right))):
        out = _poisoned(numel, dtype, dev)
        ops.append(
            dist.P2POp(
                dist.isend, _message(seed, rank, to, numel, dtype, 2 + direction).to(dev), to
            )
        )
        ops.append(dist.P2POp(dist.irecv, out, frm))
        checks.append((out, _message(seed, frm, rank, numel, dtype, 2 + direction), direction))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for out, expected, direction in checks:
        _exact(out, expected, f"batch_isend_irecv direction {direction}")


def staged_send_recv(seed: int, cases, ctx):
    """Runs every (dtype, size) case through blocking pairs, an unbatched ring and a batched
    two-way ring; returns, per case, this rank's pipelines and chunks."""
    from spyreccl_torch import _C

    assert not _C._host_addressable("spyre"), "discrete mode must declare spyre not addressable"
    assert _C._staging_chunk_bytes() == CHUNK_BYTES
    counts = {}
    for i, (dtype_name, numel) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        before = _counters()
        case_seed = seed + 1000 * i
        _pairs(numel, dtype, case_seed, ctx)
        _unbatched_ring(numel, dtype, case_seed, ctx)
        _batched_ring(numel, dtype, case_seed, ctx)
        counts[(dtype_name, numel)] = _pipelines_since(before)
    dist.barrier()
    return counts


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_large_send_recv_run_as_pipelines(rank_pool, seeded, dtype):
    world = rank_pool.world_size
    sizes = _sizes(dtype)
    name = str(dtype).removeprefix("torch.")
    cases = [(name, numel) for numel in sizes.values()]
    # Per rank: 2 (world - 1) pair messages, 2 of the unbatched ring, 4 of the batched one.
    messages = 2 * (world - 1) + 2 + 4
    for counts in rank_pool.run(staged_send_recv, seeded.seed, cases, timeout=300):
        for label, numel in sizes.items():
            chunks = _chunks(numel, dtype)
            ops, ran = counts[(name, numel)]
            if chunks == 0:
                assert (ops, ran) == (0, 0), f"{label} ({numel}) fits one chunk: {ops}, {ran}"
            else:
                assert chunks >= 2, (label, numel)
                assert (ops, ran) == (messages, messages * chunks), (label, numel, ops, ran)


def consecutive_messages(seed: int, ctx):
    """Rank 0 isends three messages to rank 1 without waiting (pipelined, one chunk, and
    pipelined again, each with its own tag) while rank 1 has posted the three receives
    first: a pipelined message's chunks must stay together in the pair's order. Then rank 1
    receives from any source what the other ranks send it."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    sizes = (3001, 1000, 4099)  # float32: 3 chunks, 1 chunk, 5 chunks
    messages = [_message(seed, 0, 1, n, torch.float32, salt=10 + i) for i, n in enumerate(sizes)]
    if rank == 1:
        outs = [_poisoned(n, torch.float32, dev) for n in sizes]
        works = [dist.irecv(out, src=0, tag=20 + i) for i, out in enumerate(outs)]
        dist.barrier()
        for work in works:
            work.wait()
        for i, (out, expected) in enumerate(zip(outs, messages)):
            _exact(out, expected, f"consecutive message {i}")
    elif rank == 0:
        dist.barrier()
        tensors = [m.to(dev) for m in messages]
        works = [dist.isend(t, dst=1, tag=20 + i) for i, t in enumerate(tensors)]
        for work in works:
            work.wait()
    else:
        dist.barrier()
    # Any source: every other rank sends rank 1 an odd-sized bfloat16 message (3 chunks).
    numel = 5001
    before = _counters()
    if rank != 1:
        dist.send(_message(seed, rank, 1, numel, torch.bfloat16, salt=30).to(dev), dst=1, tag=9)
        senders = []
    else:
        senders = []
        for _ in range(world - 1):
            out = _poisoned(numel, torch.bfloat16, dev)
            sender = dist.recv(out, tag=9)
            _exact(out, _message(seed, sender, 1, numel, torch.bfloat16, salt=30), "any source")
            senders.append(sender)
        assert sorted(senders) == [r for r in range(world) if r != 1], senders
    any_source = _pipelines_since(before)
    dist.barrier()
    return any_source


def test_consecutive_messages_and_any_source(rank_pool, seeded):
    world = rank_pool.world_size
    chunks = _chunks(5001, torch.bfloat16)
    for rank, (ops, ran) in enumerate(
        rank_pool.run(consecutive_messages, seeded.seed, timeout=120)
    ):
        expected = world - 1 if rank == 1 else 1
        assert (ops, ran) == (expected, expected * chunks), (rank, ops, ran)


def beyond_the_inline_bound(seed: int, numel: int, ctx):
    """An unbatched float32 ring of `numel` elements, more than the 4 MiB up to which a lone
    send or receive is posted on the calling thread: posted by the progress thread."""
    before = _counters()
    _unbatched_ring(numel, torch.float32, seed, ctx)
    return _pipelines_since(before)


def test_messages_beyond_the_inline_bound(rank_pool, seeded):
    numel = (4 << 20) // 4 + 3
    chunks = _chunks(numel, torch.float32)
    for result in rank_pool.run(beyond_the_inline_bound, seeded.seed, numel, timeout=120):
        assert result == (2, 2 * chunks), result


def strided_messages(seed: int, ctx):
    """A strided (every other element) float32 send into a transposed (non-contiguous)
    receive buffer, both larger than a chunk: through dense device temporaries."""
    rank, dev = ctx.rank, ctx.device
    if rank > 1:
        return None
    message = _message(seed, 0, 1, 2 * 3001, torch.float32, salt=40)
    before = _counters()
    if rank == 0:
        source = message.to(dev)[::2]
        assert not source.is_contiguous()
        dist.send(source, dst=1)
        _exact(source, message[::2], "strided send: the sent tensor")
    else:
        out = _poisoned(2 * 3001, torch.float32, dev).view(3001, 2).t()[0]
        assert not out.is_contiguous()
        dist.recv(out, src=0)
        _exact(out, message[::2], "strided recv")
    return _pipelines_since(before)


def test_strided_tensors(rank_pool, seeded):
    results = rank_pool.run(strided_messages, seeded.seed, timeout=120)
    chunks = _chunks(3001, torch.float32)
    assert results[:2] == [(1, chunks), (1, chunks)], results


def mismatched_receive(send, receive, ctx):
    """On a fresh group, rank 0 sends `send` = (elements, dtype name) and rank 1 receives
    `receive`; returns rank 1's error message and how long it took. The default group must
    keep working."""
    group = dist.new_group(backend="spyreccl", timeout=datetime.timedelta(seconds=60))
    message = elapsed = None
    if ctx.rank == 0:
        numel, dtype = send
        work = dist.isend(
            _message(0, 0, 1, numel, getattr(torch, dtype)).to(ctx.device), dst=1, group=group
        )
        try:
            work.wait()  # may complete (the chunks fit the core's slots) or fail: not hang
        except RuntimeError:
            pass
    elif ctx.rank == 1:
        numel, dtype = receive
        out = torch.empty(numel, dtype=getattr(torch, dtype), device=ctx.device)
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            dist.recv(out, src=0, group=group)
        elapsed, message = time.monotonic() - start, str(info.value)
    check = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(check)
    assert check.cpu().tolist() == [float(sum(range(1, ctx.world_size + 1)))] * 3
    return message, elapsed


# (sent, received): 3072 against 4096 float32 are 3 and 4 chunks of the same size (only the
# header tells them apart); the same bytes in another dtype (the header again); 40000
# elements make larger chunks (the core refuses the first message); 100 elements fit one
# chunk and are not pipelined (the core refuses the first message, either way round).
MISMATCHES = [
    ((3072, "float32"), (4096, "float32")),
    ((3072, "float32"), (3072, "int32")),
    ((3072, "float32"), (40_000, "float32")),
    ((3072, "float32"), (100, "float32")),
    ((100, "float32"), (4096, "float32")),
]


@pytest.mark.parametrize(("send", "receive"), MISMATCHES, ids=str)
def test_size_mismatch_fails_the_receive(make_pool, send, receive):
    pool = make_pool(2, **POOL, env=DISCRETE)
    message, elapsed = pool.run(mismatched_receive, send, receive, timeout=120)[1]
    # The mismatch itself fails it, not the group's 60 s timeout.
    assert elapsed < 50, f"the mismatched recv took {elapsed:.1f}s to fail: {message}"
    assert "recv" in message and "rank 0" in message, message
    assert "spyrecclMismatch" in message or "a receive must match" in message, message
    numel, dtype = receive
    if numel * getattr(torch, dtype).itemsize > CHUNK_BYTES:
        # The pipelined receive names its argument and what it expected.
        assert f"'tensors[0]' ({numel} elements of torch.{dtype}" in message or (
            f"'tensors[0]' holds {numel} elements of torch.{dtype}" in message
        ), message
    if (send, receive) in MISMATCHES[:2]:
        # Only the header tells these apart: it names what the sender sent.
        assert f"rank 0 sent {send[0]} elements of torch.{send[1]}" in message, message


def receive_without_sender(ctx):
    """Rank 0 irecvs a pipelined message on a 2 s group from a rank that never sends."""
    group = dist.new_group(backend="spyreccl", timeout=datetime.timedelta(seconds=2))
    elapsed = message = None
    if ctx.rank == 0:
        out = torch.empty(50_000, device=ctx.device)
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            dist.irecv(out, src=1, group=group).wait()
        elapsed, message = time.monotonic() - start, str(info.value)
    dist.barrier()
    return elapsed, message


def test_pipelined_receive_times_out(make_pool):
    pool = make_pool(2, **POOL, env=DISCRETE)
    elapsed, message = pool.run(receive_without_sender, timeout=120)[0]
    assert elapsed < 30, f"the pipelined irecv took {elapsed:.1f}s to fail"
    assert "recv" in message and "rank 1" in message, message


def host_mode_send_recv(seed: int, ctx):
    from spyreccl_torch import _C

    assert _C._host_addressable("spyre"), "host mode must declare spyre memory addressable"
    before = _counters()
    _unbatched_ring(20_011, torch.float32, seed, ctx)
    _batched_ring(20_011, torch.float32, seed, ctx)
    after = _counters()
    return {key: after[key] - before[key] for key in after if key != "slots_in_use"}


def test_host_mode_send_recv_stays_zero_copy(make_pool, seeded):
    env = dict(DISCRETE, SPYRECCL_SPYRE_MEMORY="host")
    pool = make_pool(2, **POOL, env=env)
    for delta in pool.run(host_mode_send_recv, seeded.seed, timeout=120):
        assert all(value == 0 for value in delta.values()), delta
