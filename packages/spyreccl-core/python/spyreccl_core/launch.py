"""``launch(fn, nprocs, *args)``: run ``fn(comm, *args)`` on `nprocs` local ranks.

Meant for demos, tests and benchmarks of programs without torch:

    def work(comm, n):
        x = numpy.full(n, comm.rank, dtype=numpy.float32)
        comm.all_reduce(x)
        return float(x[0])

    spyreccl_core.launch(work, 4, 1000)   # -> [6.0, 6.0, 6.0, 6.0]

The parent creates the UniqueId and hands it to every child, so no file or socket is needed.
Each child forms the communicator, runs `fn` and sends its return value back over a pipe;
the parent returns the values in rank order or raises LaunchError describing every rank that
failed (its exception and traceback, or how its process died).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._core import Communicator, UniqueId

__all__ = ["LaunchError", "launch"]

# After the first rank failed, the others usually fail soon too (RemoteError); give them this
# long to report before they are killed, so that the error shows every rank's view.
_FAILURE_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """One or more ranks of launch() failed. `failures` maps rank -> description."""

    def __init__(self, failures: dict[int, str], nprocs: int) -> None:
        self.failures = dict(sorted(failures.items()))
        self.nprocs = nprocs
        lines = [f"{len(self.failures)} of {nprocs} ranks failed:"]
        for rank, text in self.failures.items():
            lines.append(f"--- rank {rank} ---\n{text.rstrip()}")
        super().__init__("\n".join(lines))

    def __reduce__(self):  # picklable despite the custom signature
        return (type(self), (self.failures, self.nprocs))


def _child(
    fn: Callable[..., Any],
    rank: int,
    nprocs: int,
    uid_bytes: bytes,
    args: tuple,
    options: dict,
    conn: multiprocessing.connection.Connection,
) -> None:
    try:
        with Communicator(rank, nprocs, UniqueId.from_bytes(uid_bytes), **options) as comm:
            result = fn(comm, *args)
        conn.send(("ok", result))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _describe_exit(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        return f"process died from signal {signal.Signals(-code).name} without reporting"
    return f"process exited with code {code} without reporting"


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: timedelta | float | None = None,
    launch_timeout: float | None = None,
    start_method: str = "fork",
    chunk_bytes: int = 0,
    p2p_chunk_bytes: int = 0,
    name: str | None = None,
) -> list[Any]:
    """Runs ``fn(comm, *args)`` in `nprocs` processes and returns their results by rank.

    `timeout` is the communicator timeout; `launch_timeout` (seconds, None = unbounded) bounds
    the whole run, after which every child is killed and LaunchError raised. With
    start_method="spawn", `fn`, `args` and the results must be picklable.
    """
    if nprocs < 1:
        raise ValueError(f"launch: nprocs must be >= 1, got {nprocs}")
    ctx = multiprocessing.get_context(start_method)
    uid = UniqueId()
    options = {
        "timeout": timeout,
        "chunk_bytes": chunk_bytes,
        "p2p_chunk_bytes": p2p_chunk_bytes,
        "name": name,
    }
    processes = []
    readers: dict[Any, int] = {}
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_child,
                args=(fn, rank, nprocs, uid.to_bytes(), args, options, writer),
                name=f"spyreccl-rank{rank}",
                daemon=True,
            )
            process.start()
            writer.close()  # the child holds the only write end: EOF tells us it is gone
            processes.append(process)
            readers[reader] = rank
        return _collect(processes, readers, launch_timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
        for reader in readers:
            reader.close()


def _collect(processes: list, readers: dict, launch_timeout: float | None) -> list[Any]:
    nprocs = len(processes)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    pending = dict(readers)
    deadline = None if launch_timeout is None else time.monotonic() + launch_timeout
    while pending:
        if failures:
            grace_end = time.monotonic() + _FAILURE_GRACE_S
            deadline = grace_end if deadline is None else min(deadline, grace_end)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(list(pending), timeout=remaining)
        if not ready:
            for rank in pending.values():
                failures[rank] = "still running at the launch deadline; killed"
            break
        for reader in ready:
            rank = pending.pop(reader)
            try:
                status, payload = reader.recv()
            except EOFError:
                processes[rank].join(timeout=1.0)
                failures[rank] = _describe_exit(processes[rank])
                continue
            if status == "ok":
                results[rank] = payload
            else:
                failures[rank] = payload
    if failures:
        raise LaunchError(failures, nprocs)
    return [results[rank] for rank in range(nprocs)]
