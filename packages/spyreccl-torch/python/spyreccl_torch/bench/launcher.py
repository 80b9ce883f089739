"""Starting the rank processes of one benchmark job and collecting what they report.

Every rank process gets the write end of its own pipe and sends tuples ``(kind, ...)``:
``("ready", info)``, ``("case", index, samples_or_None)``, ``("done",)`` or
``("error", text)``. The parent never takes part in the communication, so it can show
progress, notice a dead rank at once (its pipe closes) and stop the others.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import runpy
import sys
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["BenchError", "RankJob", "reporting_to"]


class BenchError(RuntimeError):
    """A benchmark job failed (a rank raised, died or stopped reporting)."""


@contextlib.contextmanager
def reporting_to(conn: Connection) -> Iterator[None]:
    """Runs the body of a rank process (a ``target`` of :class:`RankJob`): an exception is
    sent to the parent as ``("error", traceback)`` and ends the rank quietly (the parent
    prints the report; a second copy on stderr would only repeat it); the pipe is closed
    either way."""
    try:
        yield
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()


@contextlib.contextmanager
def _environ(overrides: Mapping[str, str | None]) -> Iterator[None]:
    """Temporarily applies ``overrides`` (None removes) to os.environ.

    spawn children copy the parent's environment when they start, so this is how per-job
    settings (SPYRECCL_* tuning variables, thread counts) reach them.
    """
    saved = {k: os.environ.get(k) for k in overrides}
    try:
        for k, v in overrides.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _without_main_reimport() -> Iterator[None]:
    """Keeps spawn children from re-importing the parent's ``__main__``.

    multiprocessing's spawn start method re-runs the parent's main script in every child
    (as ``__mp_main__``). For the ``spyreccl-bench`` console script that script imports
    ``spyreccl_torch``, hence torch, which the core-level rank processes must not load: they
    measure spyreccl_core on numpy alone. While a child is being started, ``__main__`` is
    replaced by an empty module that names no file, so the child has nothing to re-import.
    """
    real_main = sys.modules["__main__"]
    stub = types.ModuleType("__main__")
    stub.__spec__ = None
    sys.modules["__main__"] = stub
    try:
        yield
    finally:
        sys.modules["__main__"] = real_main


class RankJob:
    """``nranks`` processes running one worker; iterate :meth:`messages` to drive them.

    With ``script`` the ranks execute that file through :func:`runpy.run_path` (nothing of
    the parent is imported in them); ``args`` is then available to it as the global
    ``SPYRECCL_BENCH_ARGS`` with ``rank`` and ``conn`` added. Otherwise ``target(args)`` is
    called, ``target`` being a module-level function.
    """

    def __init__(
        self,
        name: str,
        nranks: int,
        args: Mapping[str, Any],
        *,
        script: str | None = None,
        target: Callable[[dict[str, Any]], None] | None = None,
        env: Mapping[str, str | None] | None = None,
    ) -> None:
        if (script is None) == (target is None):
            raise ValueError(f"RankJob({name}): pass exactly one of script= and target=")
        if nranks < 1:
            raise ValueError(f"RankJob({name}): nranks must be >= 1, got {nranks}")
        self.name = name
        self.nranks = nranks
        self._ctx = mp.get_context("spawn")
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: dict[Connection, int] = {}
        self._finished: set[int] = set()
        with (
            _environ(env or {}),
            _without_main_reimport() if script is not None else contextlib.nullcontext(),
        ):
            for rank in range(nranks):
                reader, writer = self._ctx.Pipe(duplex=False)
                rank_args = dict(args, rank=rank, conn=writer)
                if script is not None:
                    proc = self._ctx.Process(
                        target=runpy.run_path,
                        args=(script,),
                        kwargs={
                            "init_globals": {"SPYRECCL_BENCH_ARGS": rank_args},
                            "run_name": "spyreccl_bench_rank",
                        },
                        name=f"{name}-rank{rank}",
                        daemon=True,
                    )
                else:
                    proc = self._ctx.Process(
                        target=target, args=(rank_args,), name=f"{name}-rank{rank}", daemon=True
                    )
                try:
                    proc.start()
                except BaseException:
                    reader.close()
                    self.close()  # the ranks already started would wait for this one forever
                    raise
                finally:
                    writer.close()  # the child holds its own copy now
                self._procs.append(proc)
                self._conns[reader] = rank

    def messages(self, stall_timeout_s: float) -> Iterator[tuple[int, tuple]]:
        """Yields ``(rank, message)`` until every rank has sent ``("done",)``.

        Raises BenchError when a rank reports an error, exits without finishing (its pipe
        closes: this also covers a rank killed by a signal), or when no rank reports
        anything for ``stall_timeout_s`` seconds (a hung collective).
        """
        while len(self._finished) < self.nranks:
            ready = wait(list(self._conns), timeout=stall_timeout_s)
            if not ready:
                raise BenchError(
                    f"{self.name}: no rank reported for {stall_timeout_s:.0f} s "
                    f"(finished ranks: {sorted(self._finished)}); a collective is probably hung"
                )
            for conn in ready:
                rank = self._conns[conn]
                try:
                    msg = conn.recv()
                except EOFError:
                    del self._conns[conn]
                    if rank in self._finished:
                        continue
                    proc = self._procs[rank]
                    proc.join(timeout=5)
                    raise BenchError(
                        f"{self.name}: rank {rank} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode} before finishing"
                    ) from None
                if msg[0] == "error":
                    raise BenchError(f"{self.name}: rank {rank} failed:\n{msg[1]}")
                if msg[0] == "done":
                    self._finished.add(rank)
                yield rank, msg

    def close(self) -> None:
        """Waits briefly for the ranks, then terminates those still running."""
        for proc in self._procs:
            proc.join(timeout=10 if self._finished else 0.1)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns.clear()

    def __enter__(self) -> RankJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
