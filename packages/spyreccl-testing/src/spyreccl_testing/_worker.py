"""The rank worker: the entry point of every spawned process of a RankPool.

This module must stay importable without torch: the spawn bootstrap imports it before the worker
has set RANK/WORLD_SIZE & co, and torch-free pools (spyreccl-core tests) never import torch.

Protocol (pickled tuples over a duplex multiprocessing Pipe):
  parent -> worker: ("task", task_id, payload)   payload = pickle of (FunctionRef, args, kwargs)
                    ("close",)
  worker -> parent: ("ready", info) | ("init_error", exc_type, traceback_text)
                    ("ok", task_id, pickled_result) | ("error", task_id, exc_type, traceback_text)
Payloads and results are pickled separately from the envelope so that an unpicklable result
becomes an ordinary task error instead of a broken pipe.
"""

from __future__ import annotations

import faulthandler
import inspect
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from spyreccl_testing import _procutil, _tasks
from spyreccl_testing.context import RankContext


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    parent_pid: int
    use_pdeathsig: bool
    distributed: bool
    backend: str | None
    init_method: str
    pg_timeout_s: float
    set_device: bool
    log_path: str
    shared_dir: str
    generation: int
    env: dict[str, str] = field(default_factory=dict)
    device_id: bool = False
    task_wrapper: _tasks.FunctionRef | None = None


SKIP_KIND = "pytest.skip"


def _exception_kind(exc: BaseException) -> str:
    """Qualified class name of `exc`, or SKIP_KIND for pytest.skip(): the parent turns a skip on
    every rank into a skipped test. Recognised by name so that this module need not import
    pytest (whose outcome classes also claim to live in `builtins`)."""
    cls = type(exc)
    if cls.__name__ == "Skipped" and any(b.__name__ == "OutcomeException" for b in cls.__mro__):
        return SKIP_KIND
    return f"{cls.__module__}.{cls.__qualname__}"


def _format(exc: BaseException) -> str:
    """The traceback without this module's own frames (the user's code starts below them)."""
    te = traceback.TracebackException.from_exception(exc)
    own = os.path.realpath(__file__)
    kept = [f for f in te.stack if os.path.realpath(f.filename) != own]
    te.stack = traceback.StackSummary.from_list(kept)
    return "".join(te.format())


def _init_rank(spec: WorkerSpec) -> RankContext:
    device = None
    backend = spec.backend
    if spec.distributed:
        # torch is imported only now, after the environment is final: the spyreccl autoload hook
        # (and the backend itself) read it at import / init time.
        import torch
        import torch.distributed as dist

        if spec.set_device:
            spyre = getattr(torch, "spyre", None)
            if spyre is None:
                raise RuntimeError(
                    "RankPool(set_device=True): torch has no 'spyre' device module; is "
                    "spyreccl-torch installed (its torch.backends autoload hook registers it) and "
                    "is TORCH_DEVICE_BACKEND_AUTOLOAD unset?"
                )
            spyre.set_device(spec.rank)
            device = f"spyre:{spec.rank}"
        kwargs: dict[str, Any] = {
            "init_method": spec.init_method,
            "rank": spec.rank,
            "world_size": spec.world_size,
            "timeout": timedelta(seconds=spec.pg_timeout_s),
        }
        if backend is not None:
            kwargs["backend"] = backend
        if spec.device_id:
            # Binds the group to this rank's device up front (eager init), as training
            # scripts do with device_id=torch.device("cuda", local_rank).
            kwargs["device_id"] = torch.device("spyre", spec.rank)
        dist.init_process_group(**kwargs)
    return RankContext(
        rank=spec.rank,
        world_size=spec.world_size,
        local_rank=spec.rank,
        backend=backend,
        device=device,
        shared_dir=spec.shared_dir,
        generation=spec.generation,
        distributed=spec.distributed,
    )


_wants_ctx_cache: dict[Any, bool] = {}


def _wants_ctx(fn: Any) -> bool:
    cached = _wants_ctx_cache.get(fn)
    if cached is None:
        try:
            cached = "ctx" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            cached = False
        _wants_ctx_cache[fn] = cached
    return cached


def _with_ctx(fn: Any, kwargs: dict[str, Any], ctx: RankContext, what: str) -> dict[str, Any]:
    if not _wants_ctx(fn):
        return kwargs
    if "ctx" in kwargs:
        raise TypeError(
            f"{what}: 'ctx' is reserved for the RankContext the pool passes; rename the keyword "
            "argument"
        )
    return {**kwargs, "ctx": ctx}


def _run_task(payload: bytes, ctx: RankContext, wrapper: Any) -> bytes:
    ref, args, kwargs = pickle.loads(payload)
    fn = _tasks.resolve(ref)
    if wrapper is None:
        result = fn(*args, **_with_ctx(fn, kwargs, ctx, ref.describe()))
    else:
        # The wrapper decides how the task is called (e.g. with a per-rank communicator as its
        # first argument); it gets the RankContext whether or not the task wants it.
        result = wrapper(fn, args, _with_ctx(fn, kwargs, ctx, ref.describe()), ctx)
    try:
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"the return value of {ref.describe()} on rank {ctx.rank} cannot be pickled back to "
            f"the test process ({type(result).__name__}: {exc}); return plain data, numpy "
            "arrays or CPU tensors"
        ) from exc


def _shutdown(spec: WorkerSpec) -> None:
    if spec.distributed and "torch.distributed" in sys.modules:
        dist = sys.modules["torch.distributed"]
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            traceback.print_exc()


def worker_main(conn: Any, spec: WorkerSpec) -> None:
    _procutil.die_with_parent(spec.parent_pid, spec.use_pdeathsig)
    # Ctrl-C in the terminal reaches the whole process group; the parent decides what happens
    # to the workers, so they must not die half-way through a collective on their own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(spec.env)
    # Fatal signals (a segfault in a C++ collective) and the parent's SIGUSR1 "where are you
    # stuck?" request dump every thread's Python stack into this rank's log; the parent puts
    # the log into the failure message.
    log = open(spec.log_path, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True, chain=False)

    try:
        ctx = _init_rank(spec)
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(("init_error", _exception_kind(exc), _format(exc))))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    try:
        wrapper = _tasks.resolve(spec.task_wrapper) if spec.task_wrapper is not None else None
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(("init_error", _exception_kind(exc), _format(exc))))
        os._exit(1)
    conn.send_bytes(pickle.dumps(("ready", {"pid": os.getpid(), "rank": spec.rank})))

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the parent closed the pipe or died
        if message[0] == "close":
            break
        _, task_id, payload = message
        try:
            reply = ("ok", task_id, _run_task(payload, ctx, wrapper))
        except BaseException as exc:  # SystemExit / pytest.skip in a task are results too
            reply = ("error", task_id, _exception_kind(exc), _format(exc))
        try:
            conn.send_bytes(pickle.dumps(reply))
        except (BrokenPipeError, OSError):
            break

    _shutdown(spec)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: it would run atexit hooks of torch and the backend in whatever
    # state the tests left them, and a hang there would only cost the parent's join timeout.
    os._exit(0)
