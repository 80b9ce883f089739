"""A pool of long-lived rank processes that run test cases on a shared communicator.

Starting processes and forming communicators costs far more than one small collective, so
each test module starts its ranks once (module-scoped fixture) and then sends them many
cases. A case is a picklable callable ``fn(comm, *args)`` (a module-level function of the
test module: the workers are forked, so they import nothing new) executed by every rank;
``RankPool.run`` returns the per-rank results in rank order.

Failure handling keeps one broken case from stalling or poisoning the others: when any rank
raises, the pool aborts the communicator of every rank (from a helper thread in each worker,
which unblocks a rank stuck in a collective with AbortedError), collects every rank's
traceback, re-forms the communicators and raises RankFailure.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import spyreccl_core

CASE_TIMEOUT_S = 60.0


class RankFailure(AssertionError):
    """A case raised on at least one rank; the message holds every rank's traceback."""


def _worker(
    rank: int,
    size: int,
    uid_bytes: bytes,
    options: dict,
    conn: multiprocessing.connection.Connection,
    control: multiprocessing.connection.Connection,
) -> None:
    # The communicator and its generation (how many were formed): an abort request names the
    # generation it targets, so a late request never hits the replacement communicator.
    current: dict[str, Any] = {"comm": None, "generation": -1}
    lock = threading.Lock()

    def abort_listener() -> None:
        # Runs beside the case: an "abort" message unblocks a stuck collective.
        while True:
            try:
                message = control.recv()
            except EOFError:
                return
            command, generation = message
            if command == "abort":
                with lock:
                    if current["generation"] == generation and current["comm"] is not None:
                        current["comm"].abort()

    def form(uid: bytes) -> None:
        comm = spyreccl_core.Communicator(
            rank, size, spyreccl_core.UniqueId.from_bytes(uid), **options
        )
        with lock:
            current["comm"] = comm
            current["generation"] += 1

    def drop() -> None:
        with lock:
            comm, current["comm"] = current["comm"], None
        if comm is not None:
            comm.destroy()

    threading.Thread(target=abort_listener, daemon=True).start()
    try:
        form(uid_bytes)
        conn.send(("ready", os.getpid()))
        while True:
            command, payload = conn.recv()
            if command == "exit":
                break
            if command == "reform":
                drop()
                form(payload)
                conn.send(("ready", os.getpid()))
                continue
            fn, args = payload
            try:
                result = fn(current["comm"], *args)
                conn.send(("ok", result))
            except BaseException as e:
                conn.send(("raised", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        drop()
    finally:
        conn.close()
        os._exit(0)  # skip the inherited pytest atexit machinery


class RankPool:
    def __init__(self, size: int, **comm_options: Any) -> None:
        self.size = size
        self.generation = 0
        self.options = {"timeout": 30.0, **comm_options}
        ctx = multiprocessing.get_context("fork")
        uid = spyreccl_core.UniqueId().to_bytes()
        self._conns = []
        self._controls = []
        self.processes = []
        for rank in range(size):
            conn, child_conn = ctx.Pipe()
            control, child_control = ctx.Pipe()
            process = ctx.Process(
                target=_worker,
                args=(rank, size, uid, self.options, child_conn, child_control),
                daemon=True,
            )
            process.start()
            child_conn.close()
            child_control.close()
            self._conns.append(conn)
            self._controls.append(control)
            self.processes.append(process)
        self.pids = [self._expect_ready(rank) for rank in range(size)]

    def _expect_ready(self, rank: int) -> int:
        if not self._conns[rank].poll(CASE_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"rank {rank} did not form its communicator")
        status, pid = self._conns[rank].recv()
        assert status == "ready", status
        return pid

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = CASE_TIMEOUT_S) -> list[Any]:
        """Runs fn(comm, *args) on every rank; returns the results in rank order."""
        for conn in self._conns:
            conn.send(("run", (fn, args)))
        results: list[Any] = [None] * self.size
        failures: dict[int, str] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        aborted = False
        while pending:
            remaining = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(pending), timeout=max(remaining, 0))
            if not ready:
                if aborted:
                    self.close()
                    raise RankFailure(f"ranks {sorted(pending.values())} hang even after abort")
                for rank in pending.values():
                    failures[rank] = f"no result after {timeout:g} s"
                self._abort_all()
                aborted = True
                deadline = time.monotonic() + 10.0
                continue
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except EOFError:
                    self.close()
                    raise RankFailure(f"rank {rank} died") from None
                if status == "ok":
                    results[rank] = payload
                else:
                    failures[rank] = payload
                    if not aborted:
                        # The other ranks may wait for this one forever: unblock them.
                        self._abort_all()
                        aborted = True
                        deadline = time.monotonic() + 10.0
        if failures or aborted:
            self.reform()
        if failures:
            text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failures.items()))
            raise RankFailure(f"{fn.__name__}{args!r:.200} failed:\n{text}")
        return results

    def _abort_all(self) -> None:
        for control in self._controls:
            control.send(("abort", self.generation))

    def reform(self) -> None:
        """Replaces every rank's communicator with a fresh one (after a broken case)."""
        uid = spyreccl_core.UniqueId().to_bytes()
        self.generation += 1
        for conn in self._conns:
            conn.send(("reform", uid))
        for rank in range(self.size):
            self._expect_ready(rank)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("exit", None))
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns + self._controls:
            conn.close()
        self._conns = []
        self._controls = []
