"""RankPool: N long-lived rank processes that run many test cases.

Each rank pays several seconds to import torch and join the process group, so spawning per test
case would dominate the suite's run time. A pool is started once (lazily, at the first run) and
serves tasks until it is closed. Any failure (a rank raises, dies or hangs) may leave the other
ranks blocked inside a collective, so the pool is then torn down completely (every worker
killed and reaped) and started afresh by the next run: one broken case never cascades into the
following ones.

Workers are started with the 'spawn' method (forking a process that imported torch is unsafe),
except torch-free pools in a test process without torch, which fork: a forked worker starts in
milliseconds with numpy & co already imported, where a spawned one pays an interpreter start
and every import again. Workers die with the test process (PR_SET_PDEATHSIG plus a
parent-watch thread).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spyreccl_testing import _procutil
from spyreccl_testing._tasks import FunctionRef
from spyreccl_testing._worker import SKIP_KIND, WorkerSpec, worker_main

_LOG_LIMIT = 6000  # characters of a rank's faulthandler log put into an error message


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank during a run (or the pool start)."""

    rank: int
    kind: str  # "raised", "died", "timeout", "stalled", "init"
    exc_type: str | None  # qualified exception class for "raised" / "init"
    detail: str  # traceback text or a sentence describing the death/hang
    log: str = ""  # faulthandler output (stack dumps, fatal signal reports)

    def render(self) -> str:
        title = {
            "raised": f"raised {self.exc_type}",
            "init": f"failed to start: {self.exc_type}",
        }.get(self.kind, self.kind)
        text = f"--- rank {self.rank}: {title} ---\n{self.detail.rstrip()}"
        if self.log.strip():
            text += f"\n[rank {self.rank} stack dump]\n{self.log.rstrip()}"
        return text


class RankError(Exception):
    """One or more ranks failed; `failures` maps rank -> RankFailure, and the message holds
    every failing rank's traceback or stack dump."""

    def __init__(self, message: str, failures: Mapping[int, RankFailure]):
        super().__init__(message)
        self.failures = dict(failures)


@dataclass
class _Worker:
    rank: int
    process: Any
    conn: Any
    log_path: str


_live_pools: weakref.WeakSet[RankPool] = weakref.WeakSet()


@atexit.register
def _kill_live_pools() -> None:
    # Runs before multiprocessing's own exit handler (registered earlier, atexit is LIFO), so
    # no interpreter exit ever waits on, or leaves behind, a worker.
    for pool in list(_live_pools):
        pool.close(graceful=False)


class RankPool:
    """A pool of `world_size` rank processes on this host.

    backend: the string passed to init_process_group (None: no argument, so spyre tensors go to
        torch's default for the accelerator, spyreccl). "cpu:gloo,spyre:spyreccl" serves CPU
        tensors with gloo in the same process group; "gloo" runs without spyreccl at all.
    distributed: False starts torch-free workers (no torch import, no process group): for
        spyreccl-core tests that bootstrap their own communicators.
    set_device: call torch.spyre.set_device(rank) before init_process_group.
    env: extra environment for every rank (set before torch is imported).
    rendezvous: "file" (a FileStore in the pool's private directory: no port races) or "tcp"
        (MASTER_ADDR=127.0.0.1 with a free port).
    start_timeout: seconds allowed for all ranks to import torch and join the group.
    pg_timeout: the process group's own timeout (bounds collectives inside the backend).
    failure_grace: seconds the other ranks get to finish or fail after the first rank failed,
        before they are considered stalled (blocked on the failed rank) and killed.
    device_id: pass device_id=torch.device("spyre", rank) to init_process_group (binds the
        group to the rank's device and initialises the backend eagerly).
    start_method: "spawn", "fork" or None (the default: "fork" for a torch-free pool while the
        test process has not imported torch, else "spawn").
    task_wrapper: a module-level function wrapper(task, args, kwargs, ctx) -> result through
        which the ranks call every task. It lets torch-free pools hand tasks a per-rank
        resource formed once per pool start (spyreccl-core's tests pass each task its rank's
        Communicator this way) and react to a failing task (e.g. abort that resource so that
        the peers blocked on it fail fast instead of stalling).
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str | None = None,
        distributed: bool = True,
        set_device: bool = False,
        env: Mapping[str, str] | None = None,
        rendezvous: str = "file",
        start_timeout: float = 180.0,
        pg_timeout: float = 300.0,
        failure_grace: float = 3.0,
        device_id: bool = False,
        task_wrapper: Callable[..., Any] | None = None,
        start_method: str | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"RankPool: world_size must be >= 1, got {world_size}")
        if rendezvous not in ("file", "tcp"):
            raise ValueError(f"RankPool: rendezvous must be 'file' or 'tcp', got {rendezvous!r}")
        if set_device and not distributed:
            raise ValueError("RankPool: set_device=True needs distributed=True (it uses torch)")
        if start_method not in (None, "spawn", "fork"):
            raise ValueError(
                f"RankPool: start_method must be 'spawn', 'fork' or None, got {start_method!r}"
            )
        if start_method == "fork" and distributed:
            raise ValueError(
                "RankPool: start_method='fork' needs distributed=False (a process that imported "
                "torch cannot be forked safely)"
            )
        if device_id and not distributed:
            raise ValueError("RankPool: device_id=True needs distributed=True (init_process_group)")
        self.world_size = world_size
        self.backend = backend
        self.distributed = distributed
        self.set_device = set_device
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.rendezvous = rendezvous
        self.start_timeout = start_timeout
        self.pg_timeout = pg_timeout
        self.failure_grace = failure_grace
        self.device_id = device_id
        self.task_wrapper = task_wrapper
        # Resolved now, so that a wrapper the workers could not import fails here, in the test
        # process, with the reason.
        self._wrapper_ref = (
            FunctionRef.from_callable(task_wrapper) if task_wrapper is not None else None
        )
        self.generation = 0  # number of starts so far
        self._workers: list[_Worker] = []
        self._shared_dir: str | None = None
        self._task_id = 0
        self._closed = False
        # A failed start (backend missing, import error...) is deterministic: remembering it
        # keeps every later test of the module from paying for another doomed spawn.
        self._start_error: RankError | None = None
        self._lock = threading.Lock()
        self.start_method = start_method
        _live_pools.add(self)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return bool(self._workers)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self.started else "idle")
        return (
            f"RankPool(world_size={self.world_size}, backend={self.backend!r}, "
            f"distributed={self.distributed}, generation={self.generation}, {state})"
        )

    def start(self) -> None:
        """Starts the workers now (run() does it lazily). Raises RankError if a rank cannot
        start (e.g. the backend fails to initialise), with that rank's traceback."""
        with self._lock:
            self._ensure_started()

    def close(self, graceful: bool = True) -> None:
        """Stops every worker (asking them to leave the process group first when `graceful`)
        and removes the pool's directory. The pool cannot be used afterwards."""
        with self._lock:
            self._closed = True
            self._teardown(graceful=graceful)
        _live_pools.discard(self)

    def _ensure_started(self) -> None:
        __tracebackhide__ = True
        if self._closed:
            raise RuntimeError(f"{self!r}: the pool is closed")
        if self._start_error is not None:
            raise RankError(
                "RankPool: not retrying, the pool failed to start earlier:\n"
                + str(self._start_error),
                self._start_error.failures,
            )
        if self._workers and all(w.process.is_alive() for w in self._workers):
            return
        if self._workers:
            # A worker died between two runs (killed from outside, OOM...): nothing can be
            # trusted about the process group any more.
            self._teardown(graceful=False)
        self._spawn()

    def _spawn(self) -> None:
        __tracebackhide__ = True
        self.generation += 1
        self._shared_dir = tempfile.mkdtemp(prefix=f"spyreccl-testing-ws{self.world_size}-")
        port = _procutil.free_tcp_port()
        if self.rendezvous == "file":
            init_method = "file://" + os.path.join(self._shared_dir, "rendezvous")
        else:
            init_method = f"tcp://127.0.0.1:{port}"
        use_pdeathsig = threading.current_thread() is threading.main_thread()
        mp = multiprocessing.get_context(self._start_method())
        for rank in range(self.world_size):
            env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.world_size),
                "GROUP_RANK": "0",
                # N ranks share the machine's cores: intra-op thread pools sized for the whole
                # machine in every rank would oversubscribe it many times over.
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            }
            env.update(self.env)
            log_path = os.path.join(self._shared_dir, f"rank{rank}.log")
            spec = WorkerSpec(
                rank=rank,
                world_size=self.world_size,
                parent_pid=os.getpid(),
                use_pdeathsig=use_pdeathsig,
                distributed=self.distributed,
                backend=self.backend,
                init_method=init_method,
                pg_timeout_s=self.pg_timeout,
                set_device=self.set_device,
                log_path=log_path,
                shared_dir=self._shared_dir,
                generation=self.generation,
                env=env,
                device_id=self.device_id,
                task_wrapper=self._wrapper_ref,
            )
            parent_conn, child_conn = mp.Pipe(duplex=True)
            process = mp.Process(
                target=worker_main,
                args=(child_conn, spec),
                name=f"spyreccl-rank{rank}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            self._workers.append(_Worker(rank, process, parent_conn, log_path))

        replies, failures, pending = self._collect(
            expected=None, timeout=self.start_timeout, what="start"
        )
        for rank, reply in replies.items():
            if reply[0] == "init_error":
                failures[rank] = RankFailure(rank, "init", reply[1], reply[2])
        for rank in pending:
            failures[rank] = RankFailure(
                rank,
                "timeout",
                None,
                f"did not finish starting within start_timeout={self.start_timeout:g}s "
                "(import torch + init_process_group)",
            )
        if failures:
            try:
                self._fail(
                    f"RankPool: could not start {self.world_size} ranks "
                    f"(backend={self.backend!r}, generation {self.generation})",
                    failures,
                    stalled=pending,
                )
            except RankError as exc:
                self._start_error = exc
                raise

    def _start_method(self) -> str:
        if self.start_method is not None:
            return self.start_method
        # Decided at every start: the test process may have imported torch since the last one.
        if self.distributed or "torch" in sys.modules:
            return "spawn"
        return "fork"

    def _teardown(
        self, graceful: bool, dump_stacks: set[int] | frozenset[int] = frozenset()
    ) -> dict[int, str]:
        """Stops and reaps every worker; returns each rank's log (stack dumps) read before the
        pool's directory is removed."""
        workers, self._workers = self._workers, []
        for w in workers:
            if w.rank in dump_stacks and w.process.is_alive():
                try:
                    os.kill(w.process.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        if dump_stacks:
            time.sleep(0.5)  # let faulthandler write the dumps before the kill
        if graceful:
            for w in workers:
                try:
                    w.conn.send_bytes(pickle.dumps(("close",)))
                except (BrokenPipeError, OSError):
                    pass
            deadline = time.monotonic() + 15.0
            for w in workers:
                w.process.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.process.is_alive():
                w.process.kill()
        logs = {}
        for w in workers:
            w.process.join(10.0)
            w.conn.close()
            try:
                w.process.close()
            except ValueError:
                pass  # not reaped 10 s after SIGKILL (uninterruptible sleep): nothing more to do
            logs[w.rank] = _read_log(w.log_path)
        if self._shared_dir is not None:
            shutil.rmtree(self._shared_dir, ignore_errors=True)
            self._shared_dir = None
        return logs

    # -- running tasks ----------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any) -> list:
        """Calls fn(*args, **kwargs) on every rank and returns the per-rank return values.

        `fn` must be a module-level function (workers import it by file and name); it gets a
        RankContext as keyword `ctx` if it declares such a parameter. If any rank raises, dies
        or exceeds `timeout` seconds, the pool is torn down and RankError is raised with every
        failing rank's traceback (stalled ranks get a stack dump). If every rank called
        pytest.skip, the test is skipped.
        """
        __tracebackhide__ = True  # pytest: the failure is the ranks' tracebacks, not this frame
        ref = FunctionRef.from_callable(fn)
        try:
            payload = pickle.dumps((ref, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"pool.run({ref.describe()}): the arguments cannot be pickled for the workers: "
                f"{exc}"
            ) from exc
        with self._lock:
            self._ensure_started()
            self._task_id += 1
            task_id = self._task_id
            message = pickle.dumps(("task", task_id, payload))
            sent_failures: dict[int, RankFailure] = {}
            for w in self._workers:
                try:
                    w.conn.send_bytes(message)
                except (BrokenPipeError, OSError) as exc:
                    sent_failures[w.rank] = RankFailure(
                        w.rank, "died", None, f"could not receive the task: {exc}"
                    )
            try:
                replies, failures, pending = self._collect(
                    expected=task_id, timeout=timeout, what=ref.describe(), skip=sent_failures
                )
            except BaseException:
                # Interrupted (Ctrl-C) while ranks are mid-task: they cannot be trusted.
                self._teardown(graceful=False)
                raise
            failures.update(sent_failures)
            results: dict[int, Any] = {}
            for rank, reply in replies.items():
                if reply[0] == "ok":
                    try:
                        results[rank] = pickle.loads(reply[2])
                    except Exception as exc:
                        failures[rank] = RankFailure(
                            rank,
                            "raised",
                            type(exc).__qualname__,
                            f"its return value could not be unpickled in the test process: "
                            f"{exc!r} (return plain data, numpy arrays or CPU tensors)",
                        )
                else:
                    failures[rank] = RankFailure(rank, "raised", reply[2], reply[3])
            first_failure = min(failures) if failures else None
            for rank in pending:
                if failures:
                    detail = (
                        f"still running {self.failure_grace:g}s after rank {first_failure} failed "
                        "(most likely blocked in a collective waiting for it)"
                    )
                    failures[rank] = RankFailure(rank, "stalled", None, detail)
                else:
                    failures[rank] = RankFailure(
                        rank, "timeout", None, f"did not finish within timeout={timeout:g}s"
                    )
            if not failures:
                return [results[r] for r in range(self.world_size)]
            if len(failures) == self.world_size and all(
                f.kind == "raised" and f.exc_type == SKIP_KIND for f in failures.values()
            ):
                # Every rank skipped consistently: the pool is healthy, the test is skipped.
                import pytest

                pytest.skip(_last_line(failures[0].detail))
            self._fail(
                f"pool.run({ref.describe()}) failed on {len(failures)} of {self.world_size} "
                f"ranks (backend={self.backend!r}, pool generation {self.generation}); the pool "
                "was torn down and restarts at the next run",
                failures,
                stalled=pending,
            )
            raise AssertionError("unreachable")  # _fail always raises

    def _collect(
        self,
        expected: int | None,
        timeout: float,
        what: str,
        skip: Mapping[int, RankFailure] | None = None,
    ) -> tuple[dict[int, tuple], dict[int, RankFailure], set[int]]:
        """Waits for one reply per rank. Returns (replies, deaths, ranks still pending).

        Once a rank has failed, the others get `failure_grace` more seconds; after that they
        are reported as pending (stalled) rather than waited for until `timeout`.
        """
        by_rank = {w.rank: w for w in self._workers}
        pending = {r for r in by_rank if not skip or r not in skip}
        replies: dict[int, tuple] = {}
        failures: dict[int, RankFailure] = {}
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = time.monotonic() if skip else None
        while pending:
            limit = deadline
            if grace_deadline is not None:
                limit = min(deadline, grace_deadline + self.failure_grace)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            handles: list[Any] = []
            for r in pending:
                handles += [by_rank[r].conn, by_rank[r].process.sentinel]
            ready = set(multiprocessing.connection.wait(handles, timeout=remaining))
            for r in sorted(pending):
                w = by_rank[r]
                if w.conn not in ready and w.process.sentinel not in ready:
                    continue
                reply = None
                if w.conn.poll():
                    try:
                        reply = pickle.loads(w.conn.recv_bytes())
                    except (EOFError, OSError):
                        reply = None
                if reply is not None:
                    if expected is not None and reply[1] != expected:
                        continue  # cannot happen: the pool is rebuilt after every timeout
                    replies[r] = reply
                    pending.discard(r)
                    if reply[0] in ("error", "init_error") and grace_deadline is None:
                        grace_deadline = time.monotonic()
                    continue
                # EOF or sentinel without a reply: the process is gone (or going).
                w.process.join(2.0)
                failures[r] = RankFailure(
                    r,
                    "died",
                    None,
                    f"process {w.process.pid} {_procutil.describe_exit(w.process.exitcode)} "
                    f"during {what}",
                )
                pending.discard(r)
                if grace_deadline is None:
                    grace_deadline = time.monotonic()
        return replies, failures, pending

    def _fail(self, headline: str, failures: dict[int, RankFailure], stalled: set[int]) -> None:
        __tracebackhide__ = True
        logs = self._teardown(graceful=False, dump_stacks=set(stalled))
        enriched = {
            rank: RankFailure(f.rank, f.kind, f.exc_type, f.detail, logs.get(rank, ""))
            for rank, f in sorted(failures.items())
        }
        message = headline + "\n" + "\n".join(f.render() for f in enriched.values())
        raise RankError(message, enriched)


def _read_log(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    if len(text) > _LOG_LIMIT:
        text = "...\n" + text[-_LOG_LIMIT:]
    return text


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
