"""The Work a hierarchical group returns (multinode/works.py, AsyncWork), without ranks: how it
completes, fails, times out and hands out its Future, including to waiters on other threads.
The multi-node jobs (test_multinode.py, test_failures.py) use it through every collective;
these cases pin the completion protocol itself (a flag and a held lock, a Future made only
when asked for) where a race would otherwise show only now and then."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from spyreccl_torch.multinode.works import AsyncWork

GROUP_TIMEOUT = datetime.timedelta(seconds=30)


class _Timeouts:
    """The group's on_timeout: records each call and returns the error the Work then holds."""

    def __init__(self) -> None:
        self.calls: list[tuple[AsyncWork, float]] = []

    def __call__(self, work: AsyncWork, limit: float) -> BaseException:
        self.calls.append((work, limit))
        return RuntimeError(f"{work.op_name} seq {work.seq} timed out after {limit:g} s")


def _work(timeouts: _Timeouts | None = None) -> AsyncWork:
    return AsyncWork("all_reduce", 7, GROUP_TIMEOUT, timeouts or _Timeouts())


def test_complete_then_wait_and_future():
    work = _work()
    result = [torch.randn(5)]
    assert not work.is_completed()
    work.complete(result)
    assert work.is_completed() and work.is_success()
    assert work.wait() is True
    assert work.wait(datetime.timedelta(milliseconds=1)) is True  # again: the gate stays open
    assert work.result() is result
    future = work.get_future()
    assert future.done() and future.value() is result
    assert work.get_future() is future  # one Future per Work


def test_future_asked_for_before_completion_completes_with_the_work():
    work = _work()
    future = work.get_future()
    assert not future.done()
    result = [torch.randn(3)]
    work.complete(result)
    assert future.done() and future.value() is result


def test_failure_reaches_wait_and_future_before_and_after():
    early = _work()
    early_future = early.get_future()
    early.fail(ValueError("spyreccl: ReduceOp.BAND is not supported for dtype torch.float32"))
    for work, future in ((early, early_future), (_work(), None)):
        if future is None:
            work.fail(
                ValueError("spyreccl: ReduceOp.BAND is not supported for dtype torch.float32")
            )
            future = work.get_future()
        assert work.is_completed() and not work.is_success()
        with pytest.raises(ValueError, match="BAND"):
            work.wait()
        with pytest.raises(ValueError, match="BAND"):
            work.wait()  # sticky
        assert isinstance(work.exception(), ValueError)
        with pytest.raises(ValueError, match="BAND"):
            future.wait()


def test_completion_after_failure_is_ignored():
    work = _work()
    work.fail(RuntimeError("peer failed"))
    work.complete([torch.ones(1)])
    with pytest.raises(RuntimeError, match="peer failed"):
        work.wait()
    assert work.result() == []


def test_wait_that_runs_out_of_time_fails_the_work_once():
    timeouts = _Timeouts()
    work = _work(timeouts)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 0\.05 s"):
        work.wait(datetime.timedelta(milliseconds=50))
    assert 0.04 <= time.monotonic() - start < 5
    assert [(w, limit) for w, limit in timeouts.calls] == [(work, 0.05)]
    assert work.is_completed() and not work.is_success()
    work.complete([torch.ones(1)])  # the executor finishing late changes nothing
    with pytest.raises(RuntimeError, match="timed out"):
        work.wait()
    assert len(timeouts.calls) == 1
    future = work.get_future()
    with pytest.raises(RuntimeError, match="timed out"):
        future.wait()


def test_waiters_on_other_threads_all_return_when_it_completes():
    work = _work()
    returned: list[bool] = []
    lock = threading.Lock()

    def waiter() -> None:
        value = work.wait(datetime.timedelta(seconds=20))
        with lock:
            returned.append(value)

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)  # let them block on the gate
    assert returned == []
    completed_at = time.monotonic()
    work.complete([torch.randn(2)])
    for thread in threads:
        thread.join(10)
    # Woken by the completion, not by their own limit (20 s) running out.
    assert time.monotonic() - completed_at < 5
    assert returned == [True] * 4
    assert not any(thread.is_alive() for thread in threads)


def _ask_for_future(work: AsyncWork, futures: list, errors: list[BaseException]) -> None:
    try:
        futures.append(work.get_future())
    except BaseException as error:
        errors.append(error)


def test_future_raced_against_completion_is_completed_exactly_once():
    # get_future() on one thread while another completes the Work: whichever side comes
    # second completes the Future, and it is never completed twice (a second set_result
    # would raise on the completing thread).
    for _ in range(200):
        work = _work()
        result = [torch.ones(1)]
        errors: list[BaseException] = []
        futures: list = []
        asker = threading.Thread(target=_ask_for_future, args=(work, futures, errors))
        asker.start()
        work.complete(result)
        asker.join(10)
        assert errors == []
        assert futures[0].wait() is result
