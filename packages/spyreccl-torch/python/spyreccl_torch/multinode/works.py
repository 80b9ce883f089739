"""The Work objects a hierarchical group returns.

- :class:`AsyncWork`: an operation run by the group's executor; it completes when the
  executor has run it. ``wait()`` is bounded by the group timeout; ``get_future()`` is
  completed (or failed) by the thread that runs the operation, so DDP comm hooks and
  ``Future.then`` chains see it complete without anybody waiting.
- :class:`ThenWork`: waits for other Works, then runs a finishing step once (point-to-point
  transfers through host copies; a coalesced batch).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from . import flight


def timeout_seconds(timeout: Any, default: datetime.timedelta) -> float:
    """A wait's limit in seconds: `timeout` when given (a timedelta, or None / zero, which
    c10d's C++ callers pass for "no timeout given"), else the group's timeout."""
    if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    if isinstance(timeout, int | float) and timeout > 0:
        return float(timeout)
    return default.total_seconds()


def _copy(error: BaseException) -> BaseException:
    """A fresh exception like `error` to raise (raising the kept one would attach the
    raiser's frames to it; see AsyncWork.fail)."""
    try:
        return type(error)(*error.args)
    except Exception:
        return RuntimeError(str(error))


class AsyncWork(dist.Work):
    """An operation queued on (or run by) a hierarchical group's executor."""

    def __init__(
        self,
        op_name: str,
        seq: int,
        group_timeout: datetime.timedelta,
        on_timeout: Callable[[AsyncWork, float], BaseException],
    ) -> None:
        super().__init__()
        self.op_name = op_name
        self.seq = seq
        self._group_timeout = group_timeout
        self._on_timeout = on_timeout
        # Completion: a flag, and a lock held until then that waiters acquire (with their limit) and
        # release. A threading.Event is a condition variable and two locks, made per operation:
        # microseconds on every small operation (docs/notes/multinode-small-messages.md, "The small
        # path's Python cost").
        self._done = False
        self._gate = threading.Lock()
        self._gate.acquire()
        self._lock = threading.Lock()
        self._result: list[torch.Tensor] = []
        self._error: BaseException | None = None
        # Made when first asked for (get_future): most Works are only waited for, and a
        # torch Future costs microseconds to make and to complete on every small operation.
        self._future: Future | None = None

    # -- completion (the executor's side) ---------------------------------------------------

    def complete(self, result: list[torch.Tensor] | None) -> None:
        with self._lock:
            if self._done:
                return  # already failed by a timed-out wait
            self._result = result if result is not None else []
            self._done = True
            self._gate.release()
            future = self._future
        flight.completed(self)
        if future is not None:
            future.set_result(self._result)

    def fail(self, error: BaseException) -> None:
        # Kept without its traceback: the traceback's frames hold this Work and its group,
        # and the future (a C++ object the garbage collector cannot see through) holds the
        # error, so the group would never be freed (nor its sockets closed).
        error = error.with_traceback(None)
        error.__cause__ = error.__context__ = None
        with self._lock:
            if self._done:
                return
            self._error = error
            self._done = True
            self._gate.release()
            future = self._future
        if future is not None:
            future.set_exception(error)

    # -- the caller's side -------------------------------------------------------------------

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        limit = timeout_seconds(timeout, self._group_timeout)
        if not self._done and not self._wait_gate(limit):
            # The group is failed (its sub-groups aborted, so the executor's stage stops
            # too) and this Work carries the timeout from now on.
            self.fail(self._on_timeout(self, limit))
        if self._error is not None:
            raise _copy(self._error)
        return True

    def _wait_gate(self, limit: float) -> bool:
        """Waits up to `limit` seconds for completion; whether it came."""
        if not self._gate.acquire(timeout=limit):
            return self._done
        self._gate.release()  # for the next waiter: the gate stays open from now on
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> Future:
        """Completed (or failed) by the thread that runs the operation; already complete
        when the operation is (complete() and fail() publish the outcome and read whether a
        future exists under one lock, so exactly one of the two sides completes it)."""
        with self._lock:
            if self._future is not None:
                return self._future
            future = self._future = Future()
            if not self._done:
                return future
            error = self._error
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(self._result)
        return future

    def synchronize(self) -> None:
        pass


class ThenWork(dist.Work):
    """Waits for other Works, then runs `after` (e.g. copies a host buffer that gloo
    received into the spyre tensor) exactly once. `works` may also be a callable that
    returns them (posted later by the executor: see HierarchicalProcessGroup._post)."""

    def __init__(
        self,
        works: Sequence[Any] | Callable[[], Sequence[Any]],
        after: Callable[[], None] | None = None,
        result: list[torch.Tensor] | None = None,
        keep: Any = None,
        describe: Callable[[BaseException], BaseException] | None = None,
        before: Sequence[Any] = (),
    ) -> None:
        super().__init__()
        self._before = list(before)  # Works that post `works` (waited for first)
        self._works = works
        self._after = after
        self._result = result if result is not None else []
        self._keep = keep  # host copies gloo reads/writes until the Work completes
        self._describe = describe
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def _inner(self) -> list[Any]:
        return list(self._works() if callable(self._works) else self._works)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        with self._lock:
            if self._done:
                return True
            if self._error is not None:
                raise self._error
            try:
                for work in self._before:
                    work.wait(timeout)
                for work in self._inner():
                    if timeout is None:
                        work.wait()
                    else:
                        work.wait(timeout)
                if self._after is not None:
                    self._after()
            except Exception as error:
                # Sticky, like c10d's Works: a later wait() raises the same error.
                self._error = self._describe(error) if self._describe is not None else error
                if self._error is error:
                    raise
                raise self._error from error
            self._done = True
            self._keep = None
        flight.completed(self)
        return True

    def is_completed(self) -> bool:
        # Pollers (`while not work.is_completed()`) never call wait(): finish the Work here
        # once everything it waits for has completed, or it would never complete.
        if self._done or self._error is not None:
            return True
        if all(w.is_completed() for w in self._before) and all(
            w.is_completed() for w in self._inner()
        ):
            try:
                self.wait()
            except Exception:  # kept in self._error: exception() and wait() report it
                pass
        return self._done or self._error is not None

    def exception(self) -> BaseException | None:
        return self._error

    def is_success(self) -> bool:
        return self._done

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> Future:
        future: Future = Future()
        try:
            self.wait()
        except Exception as error:
            future.set_exception(error)
            return future
        future.set_result(self._result)
        return future

    def synchronize(self) -> None:
        pass
