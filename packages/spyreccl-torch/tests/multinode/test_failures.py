"""The failure board and the sliced gloo wait of hierarchical groups (failures.py), in one
process: a HashStore stands in for the group's store, a real 1-rank gloo Work and a fake
pending one for gloo's."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from spyreccl_torch.multinode.failures import SLICE_S, FailureBoard, PeerFailure, wait_sliced


def _boards(n: int = 3) -> list[FailureBoard]:
    store = dist.HashStore()
    node_of = [0, 0, 1][:n]
    return [FailureBoard(dist.PrefixStore("g/", store), r, node_of) for r in range(n)]


def test_first_publication_wins_and_every_rank_reads_it():
    boards = _boards()
    assert all(b.published() is None for b in boards)
    boards[2].publish("all_reduce", 7, RuntimeError("spyreccl reduce failed:\n  peer died"))
    boards[0].publish("broadcast", 8, "later")
    for board in boards:
        record = board.published()
        assert record == {
            "op": "all_reduce",
            "seq": 7,
            "rank": 2,
            "node": 1,
            "error": "spyreccl reduce failed: peer died",
        }
    text = FailureBoard.describe(boards[0].published())
    assert text == "all_reduce seq 7 failed on rank 2 (node 1): spyreccl reduce failed: peer died"


def test_long_errors_are_cut_and_abort_is_described():
    boards = _boards()
    boards[1].publish("abort", 3, "x" * 5000)
    record = boards[0].published()
    assert len(record["error"]) == 600 and record["error"].endswith("...")
    assert FailureBoard.describe(record).startswith(
        "the group was aborted on rank 1 (node 0) after its seq 3: xxx"
    )


def test_clear_removes_what_an_earlier_group_left():
    boards = _boards()
    boards[1].publish("all_reduce", 1, "old failure")
    boards[1].report()
    # A group of the same name created again over the same store: every rank clears.
    fresh = _boards_over(boards)
    for board in fresh:
        board.clear()
    assert all(b.published() is None for b in fresh)
    assert fresh[0].silent_ranks(0.0) == [1, 2]


def _boards_over(boards: list[FailureBoard]) -> list[FailureBoard]:
    store = boards[0]._store
    return [FailureBoard(store, r, [0, 0, 1]) for r in range(len(boards))]


def test_a_store_that_fails_is_not_asked_again():
    class Gone:
        calls = 0

        def check(self, keys):
            Gone.calls += 1
            raise RuntimeError("Connection reset by peer")

        def __getattr__(self, name):
            raise RuntimeError("Connection reset by peer")

    board = FailureBoard(Gone(), 0, [0, 1])
    board.publish("all_reduce", 1, "x")  # best effort: no exception
    assert board.published() is None and board.published() is None
    assert Gone.calls == 1  # each look could block up to the store's timeout: one only
    assert board.silent_ranks(1.0) is None


def test_silent_ranks_are_those_that_never_report():
    boards = _boards()
    boards[2].report()
    start = time.monotonic()
    assert boards[0].silent_ranks(0.3) == [1]  # rank 0 reports itself, rank 2 did
    assert 0.25 <= time.monotonic() - start < 2.0
    threading.Timer(0.1, boards[1].report).start()
    assert boards[0].silent_ranks(5.0) == []


class _PendingWork:
    """A gloo-like Work that completes (or fails) when told; wait(timeout) raises on expiry
    and leaves it pending, as gloo's does."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: Exception | None = None
        self.waits = 0

    def finish(self, error: Exception | None = None) -> None:
        self.error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits += 1
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True


def test_sliced_wait_returns_at_completion_and_checks_only_between_slices():
    work = _PendingWork()
    checks = []
    threading.Timer(0.35, work.finish).start()
    start = time.monotonic()
    wait_sliced(work, lambda: checks.append(time.monotonic()))
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 2.0  # (a loaded machine may fire the timer late)
    # One look per expired slice, none after completion.
    assert 2 <= len(checks) <= elapsed / SLICE_S + 1, (len(checks), elapsed)
    # A Work that completes within the first slice costs one wait and no look.
    quick, looks = _PendingWork(), []
    quick.finish()
    wait_sliced(quick, lambda: looks.append(1))
    assert quick.waits == 1 and looks == []


def test_sliced_wait_raises_gloo_error_and_stops_on_a_published_failure():
    failing = _PendingWork()
    threading.Timer(0.15, failing.finish, args=(RuntimeError("Connection closed by peer"),)).start()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_sliced(failing, lambda: None)
    boards = _boards()
    stuck = _PendingWork()

    def between() -> None:
        record = boards[0].published()
        if record is not None:
            raise PeerFailure(FailureBoard.describe(record))

    threading.Timer(0.25, boards[2].publish, args=("all_reduce", 4, "peer died")).start()
    start = time.monotonic()
    with pytest.raises(PeerFailure, match=r"all_reduce seq 4 failed on rank 2 \(node 1\)"):
        wait_sliced(stuck, between)
    assert time.monotonic() - start < 2.0
    assert not stuck.is_completed()


def test_sliced_wait_on_a_real_gloo_work():
    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))
    t = torch.arange(4.0)
    wait_sliced(group.allreduce([t]), lambda: pytest.fail("a 1-rank all_reduce took a slice"))
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert issubclass(PeerFailure, dist.DistBackendError)
