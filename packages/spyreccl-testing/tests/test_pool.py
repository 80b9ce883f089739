"""RankPool on a CPU gloo process group: results, context, exceptions, deaths, hangs, recovery.

These tests need torch but not spyreccl: every pool here uses backend="gloo".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from spyreccl_testing import RankError, RankPool

pytestmark = pytest.mark.rank_pool_options(backend="gloo")

# --- task functions (module level: the workers import them by file and name) -------------------

_remembered: list[object] = []


def all_reduce_ranks(n: int, ctx):
    import torch
    import torch.distributed as dist

    t = torch.full((n,), float(ctx.rank + 1), dtype=torch.float64)
    dist.all_reduce(t)
    return ctx.rank, t


def describe_rank(ctx):
    import torch.distributed as dist

    return {
        "ctx": (ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend, ctx.distributed),
        "dist": (dist.get_rank(), dist.get_world_size(), str(dist.get_backend())),
        "env": tuple(os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")),
        "pid": os.getpid(),
        "shared_dir": ctx.shared_dir,
        "generation": ctx.generation,
    }


def echo(*args, **kwargs):
    return args, kwargs


def remember(value):
    _remembered.append(value)
    return len(_remembered)


def recall():
    return list(_remembered)


def raise_on_rank(bad_rank: int, ctx):
    if ctx.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    return ctx.rank


def fail_then_block(ctx):
    import torch
    import torch.distributed as dist

    if ctx.rank == 0:
        raise KeyError("rank 0 gives up before the collective")
    dist.all_reduce(torch.ones(1))  # never completes: rank 0 does not take part


def kill_self_on_rank(bad_rank: int, ctx):
    if ctx.rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # stands for a collective waiting for the dead rank


def sleep_on_rank(slow_rank: int, seconds: float, ctx):
    if ctx.rank == slow_rank:
        time.sleep(seconds)
    return ctx.rank


def segfault_on_rank(bad_rank: int, ctx):
    import ctypes

    if ctx.rank == bad_rank:
        ctypes.string_at(0)  # reads address 0: SIGSEGV, reported through faulthandler
    return ctx.rank


def skip_everywhere():
    pytest.skip("not applicable on this configuration")


def return_unpicklable():
    import threading

    return threading.Lock()


def assert_rank_is_zero(ctx):
    observed = ctx.rank * 7
    assert observed == 0


def worker_pid():
    return os.getpid()


def torch_free(ctx):
    return ctx.rank, "torch" in sys.modules, ctx.distributed


# --- tests using the shared module pool ----------------------------------------------------


def test_results_come_from_every_rank_in_rank_order(rank_pool):
    n = rank_pool.world_size
    results = rank_pool.run(all_reduce_ranks, 5)
    assert [rank for rank, _ in results] == list(range(n))
    expected = n * (n + 1) / 2
    for _, tensor in results:
        assert tensor.tolist() == [expected] * 5


def test_rank_context_environment_and_process_group_agree(rank_pool):
    n = rank_pool.world_size
    infos = rank_pool.run(describe_rank)
    for rank, info in enumerate(infos):
        assert info["ctx"] == (rank, n, rank, "gloo", True)
        assert info["dist"] == (rank, n, "gloo")
        assert info["env"] == (str(rank), str(n), str(rank), "127.0.0.1")
    assert len({info["pid"] for info in infos}) == n
    assert len({info["shared_dir"] for info in infos}) == 1


@pytest.mark.world_sizes(3)
def test_arguments_round_trip(rank_pool):
    import numpy as np
    import torch

    array = np.arange(7, dtype=np.int16)
    tensor = torch.linspace(0, 1, 9)
    results = rank_pool.run(echo, array, [1, "two"], tensor=tensor, flag=None)
    assert len(results) == 3
    for args, kwargs in results:
        np.testing.assert_array_equal(args[0], array)
        assert args[1] == [1, "two"]
        assert torch.equal(kwargs["tensor"], tensor)
        assert kwargs["flag"] is None


@pytest.mark.world_sizes(2)
def test_workers_persist_between_runs(rank_pool):
    before = [info["pid"] for info in rank_pool.run(describe_rank)]
    token = os.urandom(4).hex()
    rank_pool.run(remember, token)
    assert all(token in seen for seen in rank_pool.run(recall))
    assert [info["pid"] for info in rank_pool.run(describe_rank)] == before


def test_exception_on_one_rank_carries_its_traceback_and_pool_recovers(rank_pool):
    n = rank_pool.world_size
    bad = n - 1
    generation = rank_pool.run(describe_rank)[0]["generation"]
    with pytest.raises(RankError) as info:
        rank_pool.run(raise_on_rank, bad)
    err = info.value
    assert set(err.failures) == {bad}
    failure = err.failures[bad]
    assert failure.kind == "raised"
    assert failure.exc_type == "builtins.ValueError"
    text = str(err)
    assert f"deliberate failure on rank {bad}" in text
    assert "in raise_on_rank" in text  # the user's frame is in the traceback
    assert "_worker.py" not in failure.detail  # the pool's own frames are not
    # The pool was rebuilt: the next case runs on fresh processes.
    infos = rank_pool.run(describe_rank)
    assert infos[0]["generation"] == generation + 1
    assert [i["ctx"][0] for i in infos] == list(range(n))


@pytest.mark.world_sizes(3)
def test_ranks_blocked_on_a_failed_rank_are_reported_as_stalled(rank_pool):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        rank_pool.run(fail_then_block, timeout=60)
    assert time.monotonic() - start < 30, "stalled ranks must not be waited for until timeout"
    failures = info.value.failures
    assert failures[0].kind == "raised" and failures[0].exc_type == "builtins.KeyError"
    for rank in (1, 2):
        assert failures[rank].kind == "stalled"
        assert "fail_then_block" in failures[rank].log  # faulthandler stack dump
    assert rank_pool.run(sleep_on_rank, -1, 0) == [0, 1, 2]


def test_all_ranks_skipping_skips_the_test_without_restarting(rank_pool):
    generation = rank_pool.run(describe_rank)[0]["generation"]
    with pytest.raises(pytest.skip.Exception, match="not applicable"):
        rank_pool.run(skip_everywhere)
    assert rank_pool.run(describe_rank)[0]["generation"] == generation


@pytest.mark.world_sizes(2)
def test_unpicklable_results_and_arguments_are_reported(rank_pool):
    with pytest.raises(RankError, match="cannot be pickled"):
        rank_pool.run(return_unpicklable)
    import threading

    with pytest.raises(TypeError, match="arguments cannot be pickled"):
        rank_pool.run(echo, threading.Lock())


def test_functions_that_workers_cannot_import_are_rejected(rank_pool):
    def nested():
        return 1

    with pytest.raises(TypeError, match="module level"):
        rank_pool.run(nested)
    with pytest.raises(TypeError, match="module level"):
        rank_pool.run(lambda: 1)


# --- tests with their own pools (failure injection) -----------------------------------------


# Failure-injection tests use torch-free pools: what they check (death, hang, crash
# detection and recovery) is the pool's own logic, and a worker without torch starts in a
# fraction of a second. Death and stalls inside gloo collectives are covered above.


def test_killed_rank_is_detected_and_pool_recovers(make_pool):
    pool = make_pool(3, distributed=False)
    pids = pool.run(worker_pid)
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(kill_self_on_rank, 1, timeout=60)
    assert time.monotonic() - start < 20, "survivors must not be waited for until the timeout"
    failures = info.value.failures
    assert failures[1].kind == "died"
    assert "SIGKILL" in failures[1].detail
    for rank in (0, 2):
        assert failures[rank].kind == "stalled"
        assert "kill_self_on_rank" in failures[rank].log
    for pid in pids:
        assert not _pid_alive(pid), f"worker {pid} of the broken pool is still alive"
    new_pids = pool.run(worker_pid)
    assert set(new_pids).isdisjoint(pids)


def test_hang_past_timeout_is_detected_with_a_stack_dump(make_pool):
    pool = make_pool(2, distributed=False)
    pool.run(worker_pid)  # start outside the measured window
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(sleep_on_rank, 0, 120.0, timeout=2.0)
    assert time.monotonic() - start < 20
    failures = info.value.failures
    assert set(failures) == {0}
    assert failures[0].kind == "timeout"
    assert "timeout=2s" in failures[0].detail
    assert "sleep_on_rank" in failures[0].log
    assert pool.run(sleep_on_rank, -1, 0) == [0, 1]


def test_segfault_is_reported_with_the_native_crash_trace(make_pool):
    pool = make_pool(2, distributed=False)
    with pytest.raises(RankError) as info:
        pool.run(segfault_on_rank, 1)
    failure = info.value.failures[1]
    assert failure.kind == "died"
    assert "SIGSEGV" in failure.detail
    assert "Segmentation fault" in failure.log
    assert "segfault_on_rank" in failure.log


def test_start_failure_reports_the_init_traceback(make_pool):
    pool = make_pool(2, backend="no-such-backend")
    with pytest.raises(RankError, match="could not start") as info:
        pool.run(describe_rank)
    failures = info.value.failures
    assert any(f.kind == "init" and "no-such-backend" in f.detail for f in failures.values())
    # Deterministic start failures are not retried for every later run.
    start = time.monotonic()
    with pytest.raises(RankError, match="not retrying"):
        pool.run(describe_rank)
    assert time.monotonic() - start < 1.0


def test_asserts_in_rank_functions_report_their_values(make_pool):
    pool = make_pool(2, distributed=False)
    with pytest.raises(RankError) as info:
        pool.run(assert_rank_is_zero)
    assert set(info.value.failures) == {1}
    assert "assert 7 == 0" in info.value.failures[1].detail  # pytest's assertion rewriting


def test_torch_free_pool_never_imports_torch(make_pool):
    pool = make_pool(3, distributed=False)
    assert pool.run(torch_free) == [(r, False, False) for r in range(3)]


def test_closed_pool_has_no_processes_left(make_pool):
    pool = make_pool(2, distributed=False)
    pids = pool.run(worker_pid)
    pool.close()
    for pid in pids:
        assert not _pid_alive(pid)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(worker_pid)


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os
    import time

    from spyreccl_testing import RankPool


    def pid():
        return os.getpid()


    if __name__ == "__main__":
        pool = RankPool(2, distributed=False)
        print(" ".join(map(str, pool.run(pid))), flush=True)
        time.sleep(600)
    """
)


def test_workers_die_when_the_test_process_is_killed(tmp_path: Path):
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, f"orphan script printed {line!r}"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    deadline = time.monotonic() + 10
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_pid_alive(p) for p in pids), "workers outlived their killed parent"


def test_pool_arguments_are_validated():
    with pytest.raises(ValueError, match="world_size"):
        RankPool(0)
    with pytest.raises(ValueError, match="rendezvous"):
        RankPool(2, rendezvous="carrier-pigeon")
    with pytest.raises(ValueError, match="set_device"):
        RankPool(2, distributed=False, set_device=True)


def test_tcp_rendezvous(make_pool):
    pool = make_pool(2, backend="gloo", rendezvous="tcp")
    assert [r for r, _ in pool.run(all_reduce_ranks, 1)] == [0, 1]


def _pid_alive(pid: int) -> bool:
    """True if `pid` runs; a zombie (dead, not yet reaped by init) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")
