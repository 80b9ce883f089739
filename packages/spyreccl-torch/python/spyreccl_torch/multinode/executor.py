"""The per-group thread that runs a hierarchical group's operations in issue order.

A cross-node operation is a chain of stages (on-node spyreccl, then gloo, then spyreccl
again) where each stage needs the previous one's result, so it cannot be handed to one
engine and forgotten. Running the chain on the caller's thread made ``async_op=True``
block; running it on a thread of its own lets the caller compute meanwhile.

Why exactly one thread per group: every rank must issue the stages of its collectives to
the sub-groups in the same order (gloo and spyreccl match operations by their order), and a
single FIFO consumer keeps the order in which the caller issued them. A job is run on the
caller's thread instead when nothing is queued or running and the caller is going to wait
anyway (``async_op=False``): the order is still the issue order, and the hand-off to the
thread (a wake-up and a GIL transfer, tens of microseconds) is not paid where it buys
nothing.

An operation's Work completes inside its job, so the callbacks chained to its Future run
there, on the thread that runs the group's jobs. A callback that issues an operation of the
same group and waits for it (DDP's PowerSGD hook does) would wait forever for the thread it
runs on; such an operation runs at once instead, nested, after the jobs queued before it.

The thread exits after a while without work (and starts again on the next job), so idle
or forgotten groups keep no thread alive.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

# Seconds without a job after which the thread exits (a later job starts a new one).
IDLE_EXIT_S = 5.0


class OrderedExecutor:
    """Runs submitted callables one at a time, in submission order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._busy = False  # a job is running (on the thread or inline on a caller)
        self._thread: threading.Thread | None = None
        self._closed = False
        # How deep the calling thread is inside this executor's jobs (see _running_here).
        self._local = threading.local()

    def submit(self, job: Callable[[], None], inline_ok: bool) -> None:
        """Runs `job` after every job submitted before it. With `inline_ok` and nothing
        queued or running, it runs now on this thread. Submitted from inside one of this
        executor's jobs (a completion callback), it runs now too, after the jobs queued
        before it (_run_through). `job` must not raise (the caller's Work carries its
        errors)."""
        nested = self._running_here()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"spyreccl: {self._name} is shut down")
            inline = not nested and inline_ok and not self._busy and not self._queue
            if inline:
                self._busy = True
            else:
                self._queue.append(job)
                if not nested:  # a nested job runs below, on this thread (its outer job is busy)
                    if self._thread is None:
                        self._thread = threading.Thread(
                            target=self._loop, name=f"spyreccl {self._name}", daemon=True
                        )
                        self._thread.start()
                    self._cv.notify_all()
        if inline:
            self._run(job)
        elif nested:
            self._run_through(job)

    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cv:
            return len(self._queue) + int(self._busy)

    def close(self, timeout_s: float = 5.0) -> None:
        """No more jobs; waits up to `timeout_s` for the queued ones to finish."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue or self._busy:
                    if self._closed and not self._queue:
                        self._thread = None
                        return
                    if not self._cv.wait(IDLE_EXIT_S) and not self._queue and not self._busy:
                        self._thread = None  # idle: exit; submit() starts a new thread
                        return
                job = self._queue.popleft()
                self._busy = True
            self._run(job)

    def _running_here(self) -> bool:
        """Whether the calling thread is inside one of this executor's jobs."""
        return getattr(self._local, "depth", 0) > 0

    def _call(self, job: Callable[[], None]) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            job()
        finally:
            self._local.depth -= 1

    def _run(self, job: Callable[[], None]) -> None:
        """Runs `job` (marked busy by the caller) and lets the next one start."""
        try:
            self._call(job)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _run_through(self, job: Callable[[], None]) -> None:
        """On a thread inside one of this executor's jobs, which holds _busy: runs the
        queued jobs up to and including `job`, nested, in submission order (the thread that
        would run them is this one)."""
        while True:
            with self._cv:
                if not self._queue:
                    return
                next_job = self._queue.popleft()
            self._call(next_job)
            if next_job is job:
                return
