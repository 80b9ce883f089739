"""Throw-away process groups forked from a torch-ready launcher process (for fault tests).

Use it for scenarios that break their process group on purpose; RankPool (a persistent pool
of ranks) serves everything else. Example (the launcher is a one-rank torch-free RankPool, as
in spyreccl-torch's tests/reliability/conftest.py)::

    reports = results(ForkedGroup(3, body, *args, pg_timeout=10).finish(60))


Reliability scenarios break their process group on purpose (a rank is SIGKILLed, a
communicator times out, is aborted or sees mismatched collectives), so each needs a fresh
group. Spawning fresh ranks costs ~5-10 s each on the CI machine (importing torch), which
would put the suite far over its time budget. Instead, one launcher process (a one-rank,
torch-free RankPool worker, see conftest.py) imports torch once, before it has run any
tensor operation or created a process group, and then *forks* the ranks of every scenario:
a fork takes milliseconds and the children start with torch already imported.

Forking a process that imported torch is safe here because the launcher never ran a
parallel region or a collective (no OpenMP pool, no backend threads to lose) and each child
only ever uses state it creates itself.

A child runs `body(ctx, *args)` inside an initialised default process group and sends back
its return value; `ctx.event(name)` timestamps progress the launcher can wait for (for
example "every rank is inside the collective loop, kill one now"). Timestamps are
CLOCK_MONOTONIC, which is system wide on Linux, so times from different ranks and from the
launcher can be subtracted.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class RankContext:
    """What a child's body knows about its rank; `event` reports progress to the launcher."""

    rank: int
    world_size: int
    directory: str  # private to this group, shared by its ranks
    _conn: Connection

    def event(self, name: str, **data: Any) -> float:
        now = time.monotonic()
        self._conn.send(("event", name, now, data))
        return now

    def wait_for_file(self, name: str, timeout: float) -> bool:
        """Polls for `name` in the group directory (a rank-to-rank signal that needs no
        process group, e.g. when the group under test is the thing being broken)."""
        path = os.path.join(self.directory, name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(path):
                return True
            time.sleep(0.01)
        return False

    def touch(self, name: str) -> None:
        # Explicit mode: security scenarios run under umask 0.
        os.close(os.open(os.path.join(self.directory, name), os.O_CREAT | os.O_WRONLY, 0o600))


@dataclass
class RankOutcome:
    rank: int
    exitcode: int | None  # None: still running at the deadline (then SIGKILLed)
    result: Any = None  # the body's return value
    error: str | None = None  # traceback when the body raised (an unexpected failure)
    events: dict[str, float] = field(default_factory=dict)  # name -> monotonic time
    event_data: dict[str, dict] = field(default_factory=dict)
    exit_seconds: float | None = None  # from the body's return to the process' exit

    def describe(self) -> str:
        state = {None: "still running"}.get(self.exitcode, f"exit code {self.exitcode}")
        text = f"rank {self.rank}: {state}"
        if self.error:
            text += f"\n{self.error}"
        return text


def _child_main(
    conn: Connection,
    rank: int,
    world_size: int,
    directory: str,
    env: Mapping[str, str],
    pg_timeout: float,
    init_backend: str | None,
    body: Callable[..., Any],
    args: tuple,
    full_exit: bool,
) -> None:
    # Die with the launcher, whatever state the group is in.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    code = 0
    try:
        import torch.distributed as dist

        # Read once at `import torch.distributed`, i.e. in the launcher: re-read it now that
        # this rank's environment is final (TORCH_DISTRIBUTED_DEBUG=DETAIL scenarios).
        dist.set_debug_level_from_env()
        if init_backend != "none":
            kwargs: dict[str, Any] = {
                "init_method": "file://" + os.path.join(directory, "store"),
                "rank": rank,
                "world_size": world_size,
                "timeout": datetime.timedelta(seconds=pg_timeout),
            }
            if init_backend is not None:
                kwargs["backend"] = init_backend
            dist.init_process_group(**kwargs)
        ctx = RankContext(rank, world_size, directory, conn)
        result = body(ctx, *args)
        conn.send(("result", pickle.dumps(result), time.monotonic()))
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        code = 1
        try:
            conn.send(("error", traceback.format_exc(), time.monotonic()))
        except Exception:
            pass
    finally:
        try:
            conn.close()
        except Exception:
            pass
    if full_exit:
        # A real process exit: C atexit handlers and the static destructors of libtorch,
        # libspyreccl and the backend run (os._exit would skip them and hide a hang there).
        # Python's own finalisation is skipped on purpose: it would run the launcher's
        # (pytest worker's) atexit hooks, which belong to the parent. Costs ~1-2 s on a
        # loaded machine (the destructors touch copy-on-write pages), hence optional.
        _libc.exit(code)
    os._exit(code)


class ForkedGroup:
    """`world_size` forked ranks running `body(ctx, *args)` in a fresh default group.

    pg_timeout: the timeout given to init_process_group (bounds every collective).
    env: extra environment of every rank (set before init_process_group).
    backend: init_process_group's backend argument (None: spyre's default, spyreccl);
        "none" skips init_process_group (the body creates its groups itself).
    full_exit: leave through libc exit() (static destructors run) instead of os._exit.
    """

    def __init__(
        self,
        world_size: int,
        body: Callable[..., Any],
        *args: Any,
        pg_timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
        backend: str | None = None,
        full_exit: bool = False,
    ):
        self.world_size = world_size
        self.directory = tempfile.mkdtemp(prefix="spyreccl-reliability-")
        os.chmod(self.directory, 0o700)
        self.pids: list[int] = []
        self._conns: list[Connection] = []
        self._outcomes = [RankOutcome(rank, None) for rank in range(world_size)]
        self._result_at: dict[int, float] = {}
        self._exit_at: dict[int, float] = {}
        child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
        for rank in range(world_size):
            reader, writer = Pipe(duplex=False)
            pid = os.fork()
            if pid == 0:  # child
                reader.close()
                for other in self._conns:
                    other.close()
                _child_main(
                    writer,
                    rank,
                    world_size,
                    self.directory,
                    child_env,
                    pg_timeout,
                    backend,
                    body,
                    args,
                    full_exit,
                )
            writer.close()
            self.pids.append(pid)
            self._conns.append(reader)

    # -- launcher side ----------------------------------------------------------------------

    def _drain(self, conns: list[Connection], timeout: float) -> None:
        for conn in wait(conns, timeout=timeout):
            rank = self._conns.index(conn)
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._conns[rank] = None  # type: ignore[call-overload]
                continue
            outcome = self._outcomes[rank]
            if message[0] == "event":
                _, name, at, data = message
                outcome.events[name] = at
                outcome.event_data[name] = data
            elif message[0] == "result":
                outcome.result = pickle.loads(message[1])
                self._result_at[rank] = message[2]
            else:
                outcome.error = message[1]
                self._result_at[rank] = message[2]

    def wait_event(self, name: str, ranks: list[int] | None = None, timeout: float = 30.0) -> bool:
        """Waits until every rank of `ranks` (default all) reported event `name`."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        deadline = time.monotonic() + timeout
        while True:
            if all(name in self._outcomes[r].events for r in ranks):
                return True
            live = [c for c in self._conns if c is not None]
            remaining = deadline - time.monotonic()
            if not live or remaining <= 0:
                return False
            self._drain(live, remaining)

    def kill(self, rank: int) -> float:
        """SIGKILLs `rank`; returns the monotonic time just before the signal."""
        at = time.monotonic()
        os.kill(self.pids[rank], signal.SIGKILL)
        return at

    def finish(self, timeout: float = 30.0) -> list[RankOutcome]:
        """Collects every rank's outcome, waiting at most `timeout` seconds for all of them
        to exit; ranks still running then are SIGKILLed and reported with exitcode None."""
        deadline = time.monotonic() + timeout
        pending = {pid: rank for rank, pid in enumerate(self.pids)}
        while pending:
            live = [c for c in self._conns if c is not None]
            if live:
                self._drain(live, min(0.05, max(0.0, deadline - time.monotonic())))
            for pid, rank in list(pending.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self._exit_at[rank] = time.monotonic()
                    self._outcomes[rank].exitcode = os.waitstatus_to_exitcode(status)
                    del pending[pid]
            if pending and time.monotonic() > deadline:
                for pid in pending:
                    os.kill(pid, signal.SIGKILL)
                for pid in pending:
                    os.waitpid(pid, 0)
                break
            if pending and not live:
                time.sleep(0.01)
        for conn in self._conns:
            if conn is not None:
                conn.close()
        for rank, outcome in enumerate(self._outcomes):
            if rank in self._result_at and rank in self._exit_at:
                outcome.exit_seconds = self._exit_at[rank] - self._result_at[rank]
        shutil.rmtree(self.directory, ignore_errors=True)
        return self._outcomes


def run_group(
    world_size: int, body: Callable[..., Any], *args: Any, timeout: float = 60.0, **options: Any
) -> list[RankOutcome]:
    """Forks the group, waits for every rank to finish and returns the outcomes."""
    return ForkedGroup(world_size, body, *args, **options).finish(timeout)


def results(outcomes: list[RankOutcome]) -> list[Any]:
    """The per-rank return values; raises with every failing rank's story otherwise."""
    bad = [o for o in outcomes if o.exitcode != 0 or o.error]
    if bad:
        raise AssertionError("forked ranks failed:\n" + "\n".join(o.describe() for o in bad))
    return [o.result for o in outcomes]
