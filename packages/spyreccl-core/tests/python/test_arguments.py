"""Argument checking at the binding layer: bad calls raise on the calling rank, with a
message naming the operation and the argument, before anything is communicated.

Most checks need no peer, so they run on an in-process single-rank communicator; the
multi-rank ones run on the pool. A hypothesis fuzz throws random argument combinations at
every operation: each call must work or raise a clean Python exception, never crash.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spyreccl_core
from spyreccl_core import DataType, ReduceOp

F32 = np.float32


@pytest.fixture(scope="module")
def solo():
    comm = spyreccl_core.Communicator(0, 1, spyreccl_core.UniqueId(), timeout=5.0, name="solo")
    yield comm
    comm.destroy()


def raises(exc, *words):
    """pytest.raises matching every word of `words` in the message, in order."""
    return pytest.raises(exc, match=".*".join(re.escape(w) for w in words))


def test_size_mismatch_message_names_argument_and_expectation(solo):
    with raises(ValueError, "all_gather: argument 'recv' has 10 elements", "size*len(send) = 12"):
        solo.all_gather(np.zeros(12, F32), np.zeros(10, F32))
    with raises(ValueError, "reduce_scatter: argument 'send'", "size*len(recv) = 4"):
        solo.reduce_scatter(np.zeros(5, F32), np.zeros(4, F32))
    with raises(ValueError, "all_reduce: argument 'recv' has 3 elements", "len(send) = 4"):
        solo.all_reduce(np.zeros(4, F32), np.zeros(3, F32))
    with raises(ValueError, "gather: argument 'recv'"):
        solo.gather(np.zeros(4, F32), np.zeros(5, F32), 0)
    with raises(ValueError, "scatter: argument 'send'"):
        solo.scatter(np.zeros(5, F32), np.zeros(4, F32), 0)


def test_binding_errors_are_invalid_argument_errors(solo):
    with pytest.raises(spyreccl_core.InvalidArgumentError) as info:
        solo.all_reduce(np.zeros(4, F32), np.zeros(3, F32))
    assert info.value.code == spyreccl_core.Result.INVALID_ARGUMENT
    assert isinstance(info.value, spyreccl_core.SpyrecclError)
    assert isinstance(info.value, RuntimeError)


def test_non_contiguous_and_read_only(solo):
    x = np.zeros((4, 4), F32)
    with raises(ValueError, "all_reduce: argument 'send' is not C-contiguous"):
        solo.all_reduce(x[:, 1], np.zeros(4, F32))
    with raises(ValueError, "broadcast: argument 'buf' is not C-contiguous"):
        solo.broadcast(x.T, 0)
    ro = np.zeros(4, F32)
    ro.flags.writeable = False
    with raises(ValueError, "all_reduce: argument 'recv' is read-only"):
        solo.all_reduce(np.zeros(4, F32), ro)
    with raises(ValueError, "all_reduce: argument 'send' is read-only"):
        solo.all_reduce(ro)  # in place: send is the output
    with raises(ValueError, "recv_any_source: argument 'buf' is read-only"):
        solo.recv_any_source(b"abcd")
    solo.all_reduce(ro, np.zeros(4, F32))  # a read-only input is fine


def test_types(solo):
    with raises(TypeError, "all_reduce: argument 'recv' has dtype float64", "'send' has float32"):
        solo.all_reduce(np.zeros(4, F32), np.zeros(4, np.float64))
    with raises(TypeError, "all_reduce: argument 'send' must be a C-contiguous buffer", "list"):
        solo.all_reduce([1.0, 2.0])
    with raises(TypeError, "argument 'send' has unsupported buffer format"):
        solo.all_reduce(np.zeros(4, np.complex64))
    with raises(TypeError, "argument 'send' has unsupported buffer format"):
        solo.all_reduce(np.zeros(4, ">f4"))
    with raises(TypeError, "no spyreccl data type", "DataType.BFLOAT16"):
        solo.all_reduce(np.zeros(4, np.uint16))
    with raises(TypeError, "dtype=bfloat16 cannot reinterpret argument 'send'"):
        solo.all_reduce(np.zeros(4, F32), dtype=DataType.BFLOAT16)
    # The name is float8_e4m3 or, since the C API adopted torch's spelling, float8_e4m3fn.
    with raises(TypeError, "dtype=float8_e4m3", "cannot reinterpret argument 'send'"):
        solo.all_reduce(np.zeros(4, np.float16), dtype=DataType.FLOAT8_E4M3)


def test_other_buffer_exporters(solo):
    data = bytearray(range(10))
    solo.all_reduce(data, op=ReduceOp.MAX)  # bytearray: unsigned bytes
    assert data == bytearray(range(10))
    view = memoryview(np.arange(6, dtype=np.int64))
    out = np.zeros(6, np.int64)
    solo.all_reduce(view, out)
    np.testing.assert_array_equal(out, np.arange(6))
    bits = np.array([0x3F80, 0x4000], dtype=np.uint16)  # bfloat16 1.0, 2.0
    solo.all_reduce(bits, op=ReduceOp.PREMUL_SUM, scalar=2.0, dtype=DataType.BFLOAT16)
    assert bits.tolist() == [0x4000, 0x4080]  # 2.0, 4.0


def test_roots_peers_tags(solo):
    x = np.zeros(4, F32)
    for root in (-1, 1, 7):
        with raises(ValueError, "argument 'root' =", "outside [0, size=1)"):
            solo.broadcast(x, root)
        with raises(ValueError, "reduce: argument 'root'"):
            solo.reduce(x, x.copy(), root)
    with raises(ValueError, "send: argument 'peer' = 0 is this rank"):
        solo.send(x, 0)
    with raises(ValueError, "recv: argument 'peer' = 3 is outside"):
        solo.recv(x, 3)
    with raises(ValueError, "recv_any_source: argument 'tag' = -2"):
        solo.recv_any_source(x, tag=-2)


def test_reduce_op_arguments(solo):
    x = np.ones(4, F32)
    with raises(ValueError, "ReduceOp.PREMUL_SUM needs argument 'scalar'"):
        solo.all_reduce(x, op=ReduceOp.PREMUL_SUM)
    with raises(ValueError, "argument 'scalar' is only used with ReduceOp.PREMUL_SUM"):
        solo.all_reduce(x, op=ReduceOp.MAX, scalar=2.0)
    with pytest.raises(TypeError):
        solo.all_reduce(x, op=0)  # raw ints are not ReduceOps
    with pytest.raises(spyreccl_core.InvalidArgumentError):
        solo.all_reduce(np.ones(4, np.bool_), op=ReduceOp.AVG)
    with pytest.raises(spyreccl_core.InvalidArgumentError):
        solo.all_reduce(np.ones(4, np.int32), op=ReduceOp.PREMUL_SUM, scalar=2.0)
    solo.barrier()  # InvalidArgument leaves the communicator usable


def test_all_to_all_v_arguments(solo):
    x, y = np.zeros(6, F32), np.zeros(6, F32)
    with raises(ValueError, "argument 'send_counts' has 2 entries, expected size = 1"):
        solo.all_to_all_v(x, [3, 3], y, [6])
    with raises(ValueError, "argument 'recv_counts'[0] = -1 must be >= 0"):
        solo.all_to_all_v(x, [6], y, [-1])
    with raises(ValueError, "send_displs[0] + send_counts[0] = 8 exceeds len(send) = 6"):
        solo.all_to_all_v(x, [6], y, [6], [2], [0])
    with raises(ValueError, "(packed displacement)[0] + recv_counts[0] = 7 exceeds len(recv)"):
        solo.all_to_all_v(x, [6], y, [7])
    with pytest.raises(TypeError):
        solo.all_to_all_v(x, "six", y, [6])


def test_overlap_rules(solo):
    buf = np.arange(8, dtype=F32)
    with raises(ValueError, "arguments 'send' and 'recv' overlap"):
        solo.all_reduce(buf[:4], buf[2:6])
    with raises(ValueError, "all_to_all: arguments 'send' and 'recv' overlap", "not in place"):
        solo.all_to_all(buf, buf)
    solo.all_reduce(buf, buf)  # exactly the same memory is in place
    solo.all_gather(buf, buf)  # send == block `rank` (0) of recv


def test_communicator_arguments():
    uid = spyreccl_core.UniqueId()
    with raises(ValueError, "Communicator: argument 'rank' = 2 is outside [0, size=2)"):
        spyreccl_core.Communicator(2, 2, uid)
    with raises(ValueError, "argument 'size' must be >= 1"):
        spyreccl_core.Communicator(0, 0, uid)
    with raises(ValueError, "argument 'timeout' must be a positive"):
        spyreccl_core.Communicator(0, 1, uid, timeout=-1.0)
    with raises(ValueError, "argument 'timeout' must be a positive"):
        spyreccl_core.Communicator(0, 1, uid, timeout=float("nan"))
    with raises(TypeError, "argument 'timeout' must be a datetime.timedelta"):
        spyreccl_core.Communicator(0, 1, uid, timeout="10s")
    with raises(ValueError, "argument 'chunk_bytes' must be >= 0"):
        spyreccl_core.Communicator(0, 1, uid, chunk_bytes=-5)
    with raises(ValueError, "argument 'yield_ns' must be >= 0"):
        spyreccl_core.Communicator(0, 1, uid, yield_ns=-1)


def test_timeout_forms_and_split_arguments():
    from datetime import timedelta

    with spyreccl_core.Communicator(
        0, 1, spyreccl_core.UniqueId(), timeout=timedelta(seconds=3)
    ) as c:
        c.set_timeout(0.25)
        c.set_timeout(timedelta(milliseconds=1))
        with raises(ValueError, "split: argument 'color' must be >= 0 or None"):
            c.split(-3)
        assert c.split(None) is None
        with c.split(5, key=0) as child:
            assert (child.rank, child.size) == (0, 1)
    assert c.closed
    # yield_ns=0: waits sleep right after their spin (tests/cpp: lifecycle.yield_*).
    with spyreccl_core.Communicator(0, 1, spyreccl_core.UniqueId(), yield_ns=0) as c:
        values = np.array([1.5, -2.0, 3.25], dtype=np.float32)
        out = np.full(3, np.nan, dtype=np.float32)
        c.all_reduce(values, out)
        assert np.array_equal(out, values)


def test_group_usage(solo):
    with raises(spyreccl_core.InvalidUsageError, "group_end: no group is open"):
        spyreccl_core.group_end()
    with pytest.raises(spyreccl_core.InvalidUsageError, match="inside a group"), solo.group():
        solo.recv_any_source(np.zeros(1, F32))
    with pytest.raises(spyreccl_core.InvalidUsageError), solo.group():
        solo.barrier()  # collectives are not allowed inside a group


def rank_all_to_all_not_multiple(comm):
    try:
        comm.all_to_all(np.zeros(comm.size + 1, F32), np.zeros(comm.size + 1, F32))
    except ValueError as e:
        error = e
    comm.barrier()
    return str(error)


def test_multi_rank_argument_errors(rank_pool):
    for message in rank_pool.run(rank_all_to_all_not_multiple):
        assert f"not a multiple of size = {rank_pool.world_size}" in message


def test_set_thread_yield_arguments():
    with raises(
        spyreccl_core.InvalidArgumentError, "set_thread_yield: argument 'ns' must be >= -1"
    ):
        spyreccl_core.set_thread_yield(-2)
    with raises(TypeError, "set_thread_yield"):
        spyreccl_core.set_thread_yield("1ms")
    spyreccl_core.set_thread_yield(0)
    spyreccl_core.set_thread_yield(-1)  # back to the communicators' own


LATE_S = 0.4


def _thread_sched() -> tuple[float, float, int] | None:
    """(seconds on a CPU, seconds runnable but queued for one, voluntary context switches: how
    often it blocked) of the calling thread, from /proc/self/task/<tid>/schedstat and status;
    None where the kernel does not keep them."""
    import threading

    task = f"/proc/self/task/{threading.get_native_id()}"
    try:
        with open(f"{task}/schedstat") as f:
            on_cpu, run_delay = f.read().split()[:2]
        with open(f"{task}/status") as f:
            blocked = next(
                int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches")
            )
    except (OSError, ValueError, StopIteration):
        return None
    return int(on_cpu) / 1e9, int(run_delay) / 1e9, blocked


def rank_waits_with_thread_yield(comm, seed):
    """The last rank joins an all_reduce LATE_S late, twice: the early ranks wait first with
    their thread's yield phase at 0 (they sleep right after the spin), then at 10 s (they
    yield the CPU all along, never blocking). Returns, per early wait, (thread CPU seconds,
    wall seconds, seconds the thread was off the run queue, times it blocked), the last two
    None without the kernel's per-thread statistics; the sums are checked against float64."""
    import time

    def inputs(rank, k):
        return np.random.default_rng([seed, rank, k]).standard_normal(17).astype(F32)

    waits = []
    for k, ns in enumerate((0, 10_000_000_000)):
        spyreccl_core.set_thread_yield(ns)
        try:
            out = np.full(17, np.nan, dtype=F32)
            # Timed from before the barrier: the last rank's sleep starts only once every
            # rank has entered it, so an early rank's timed wait lasts at least LATE_S,
            # however late the scheduler lets it run after the barrier.
            sched0, cpu0, wall0 = _thread_sched(), time.thread_time(), time.monotonic()
            comm.barrier()
            if comm.rank == comm.size - 1:
                time.sleep(LATE_S)
            comm.all_reduce(inputs(comm.rank, k), out)
            sched1, cpu1, wall1 = _thread_sched(), time.thread_time(), time.monotonic()
        finally:
            spyreccl_core.set_thread_yield(-1)
        off_queue = blocked = None
        if sched0 is not None and sched1 is not None:
            runnable = sched1[0] - sched0[0] + sched1[1] - sched0[1]
            off_queue = max(0.0, (wall1 - wall0) - runnable)
            blocked = sched1[2] - sched0[2]
        waits.append((cpu1 - cpu0, wall1 - wall0, off_queue, blocked))
        expected = sum(inputs(r, k).astype(np.float64) for r in range(comm.size))
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    return waits


def test_set_thread_yield_changes_how_this_thread_waits(rank_pool):
    import os

    seed = int.from_bytes(os.urandom(4), "little")
    results = rank_pool.run(rank_waits_with_thread_yield, seed)
    for rank, (sleeping, yielding) in enumerate(results[:-1]):
        what = (rank, "(cpu s, wall s, off-queue s, blocked)", sleeping, yielding)
        sleep_cpu, sleep_wall, _, sleep_blocked = sleeping
        yield_cpu, yield_wall, yield_off, yield_blocked = yielding
        assert min(sleep_wall, yield_wall) >= 0.99 * LATE_S, what
        # A sleeping wait uses the CPU for its spin and its wake-ups only, however loaded the
        # machine: CPU time never grows with the load.
        assert sleep_cpu < 0.25 * LATE_S, what
        if yield_blocked is None:
            # Without the per-thread statistics: the CPU time, which a yielding thread only
            # gets while nothing else wants the CPU (3 ranks on 2 CPUs and another busy
            # process: 25 % of the wait), so this bound can fail on a loaded machine.
            assert yield_cpu > 0.15 * LATE_S and yield_cpu > 4 * sleep_cpu, what
            continue
        # How much CPU a yielding thread gets depends on the load (at load 15 on 2 CPUs:
        # 0.2 % of the wait), but not that it never blocks and never leaves the run queue,
        # while a sleeping wait blocks in every 1 ms futex slice (hundreds of times idle; at
        # least dozens when each wake-up queues behind busy processes).
        assert sleep_blocked >= 10, what
        assert yield_blocked * 5 < sleep_blocked, what
        assert yield_off < 0.25 * yield_wall, what


# ---------------------------------------------------------------------------------------
# Fuzz
# ---------------------------------------------------------------------------------------

NUMPY_TYPES = [
    np.float32,
    np.float64,
    np.float16,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.bool_,
    np.complex64,
]


@st.composite
def buffers(draw):
    kind = draw(st.sampled_from(["array", "array", "array", "none", "list", "bytes"]))
    if kind == "none":
        return None
    if kind == "list":
        return [1, 2, 3]
    if kind == "bytes":
        return bytes(draw(st.integers(0, 8)))
    dtype = draw(st.sampled_from(NUMPY_TYPES))
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
    a = np.zeros(shape, dtype=dtype)
    if a.ndim and draw(st.booleans()):
        a = a[..., ::2]  # often non-contiguous
    if draw(st.integers(0, 4)) == 0:
        a.flags.writeable = False
    return a


small_ints = st.integers(-3, 3)
maybe_dtype = st.none() | st.sampled_from(list(DataType))
maybe_scalar = st.none() | st.floats(allow_nan=True, allow_infinity=True)
counts = st.lists(st.integers(-2, 8), min_size=0, max_size=3)

ops = st.sampled_from(list(ReduceOp))
reducing = {"scalar": maybe_scalar, "dtype": maybe_dtype}
plain = {"dtype": maybe_dtype}
# method -> (strategies of the positional arguments, strategies of the keyword arguments)
CALLS = {
    "all_reduce": ([buffers(), buffers(), ops], reducing),
    "reduce": ([buffers(), buffers(), small_ints, ops], reducing),
    "broadcast": ([buffers(), small_ints], plain),
    "all_gather": ([buffers(), buffers()], plain),
    "reduce_scatter": ([buffers(), buffers(), ops], reducing),
    "all_to_all": ([buffers(), buffers()], plain),
    "all_to_all_v": (
        [buffers(), counts, buffers(), counts, st.none() | counts, st.none() | counts],
        plain,
    ),
    "gather": ([buffers(), buffers(), small_ints], plain),
    "scatter": ([buffers(), buffers(), small_ints], plain),
    "send": ([buffers(), small_ints, small_ints], plain),
    "recv": ([buffers(), small_ints, small_ints], plain),
}


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(sorted(CALLS)), data=st.data())
def test_fuzz_arguments(solo, name, data):
    positional, keywords = CALLS[name]
    args = [data.draw(strategy) for strategy in positional]
    kwargs = {key: data.draw(strategy) for key, strategy in keywords.items()}
    message = None
    try:
        getattr(solo, name)(*args, **kwargs)
    except (TypeError, ValueError) as e:  # InvalidArgumentError is a ValueError
        message = str(e)
    # Anything else (another SpyrecclError, a crash) fails the test. Every exception must
    # explain itself, and the communicator must stay healthy.
    assert message is None or message
    assert solo.async_error() == spyreccl_core.Result.SUCCESS
