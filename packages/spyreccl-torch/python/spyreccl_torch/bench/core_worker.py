"""One rank of the ``core`` level: spyreccl_core collectives on numpy buffers, no torch.

This file is executed with :func:`runpy.run_path` in a fresh spawn process (see
``launcher.RankJob``), never imported as part of ``spyreccl_torch``: importing the package
would import torch, and this level exists to measure the library without torch's dispatch
overhead (and without torch's memory footprint, which matters with 4 ranks on 2 cores).
Its only imports are the standard library, numpy, spyreccl_core and the torch-free sibling
module ``timing.py``, loaded by file path.

The parent passes ``SPYRECCL_BENCH_ARGS`` (a dict) as a global: rank, nranks, conn (the write
end of the report pipe), unique_id (bytes), dtype, cases (list of dicts, see plan.Case),
policy (dict of timing.LoopPolicy fields).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


def _load_sibling(name: str) -> Any:
    """Imports ``<this directory>/<name>.py`` under a private top-level module name."""
    module_name = f"spyreccl_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"core bench rank: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _make_step(core: Any, comm: Any, case: dict, dtype: Any, np_dtype: str, rank: int,
               nranks: int) -> Callable[[], object] | None:
    """A closure performing one operation of ``case``; None when this rank sits it out."""
    import numpy as np

    def buffer(elems: int) -> np.ndarray:
        # Written once so that every page is private and resident before timing: a fresh
        # np.empty/np.zeros maps the shared zero page, which would make the first timed
        # reads look faster than memory.
        a = np.empty(elems, dtype=np_dtype)
        a.fill(0)
        return a

    op = case["op"]
    SUM = core.ReduceOp.SUM
    if op == "barrier":
        return comm.barrier
    send = buffer(case["send_elems"])
    recv = buffer(case["recv_elems"])
    kw = {} if dtype is None else {"dtype": dtype}
    if op == "all_reduce":
        return lambda: comm.all_reduce(send, recv, SUM, **kw)
    if op == "all_gather_into_tensor":
        return lambda: comm.all_gather(send, recv, **kw)
    if op == "reduce_scatter_tensor":
        return lambda: comm.reduce_scatter(send, recv, SUM, **kw)
    if op == "broadcast":
        return lambda: comm.broadcast(send, 0, **kw)
    if op == "all_to_all_single":
        return lambda: comm.all_to_all(send, recv, **kw)
    if op == "sendrecv":
        if rank == 0:
            def ping() -> None:
                comm.send(send, 1, **kw)
                comm.recv(recv, 1, **kw)
            return ping
        if rank == 1:
            def pong() -> None:
                comm.recv(recv, 0, **kw)
                comm.send(send, 0, **kw)
            return pong
        return None
    raise ValueError(f"core bench rank: unknown operation {op!r}")


def _run(args: dict) -> None:
    conn = args["conn"]
    rank, nranks = args["rank"], args["nranks"]
    try:
        timing = _load_sibling("timing")
        import numpy as np

        import spyreccl_core as core

        dtype = getattr(core.DataType, args["dtype"].upper()) if args["reinterpret"] else None
        comm = core.Communicator(rank, nranks, core.UniqueId.from_bytes(args["unique_id"]),
                                 timeout=args["timeout_s"])
        conn.send(("ready", {"pid": os.getpid(), "spyreccl_core": core.__version__,
                             "library": core.library_version(), "numpy": np.__version__}))
        policy = timing.LoopPolicy(**args["policy"])
        probe = np.zeros(1, dtype=np.float64)

        def agree_max(value: float) -> float:
            probe[0] = value
            comm.all_reduce(probe, op=core.ReduceOp.MAX)
            return float(probe[0])

        for case in args["cases"]:
            step = _make_step(core, comm, case, dtype, args["numpy_dtype"], rank, nranks)
            idle = step is None
            samples = timing.measure(
                (lambda: None) if idle else step,
                comm.barrier,
                agree_max,
                warmup=timing.warmup_iters(case["nbytes"]),
                policy=policy,
            )
            conn.send(("case", case["index"], None if idle else samples))
            del step
        comm.destroy()
        conn.send(("done",))
    except BaseException:
        # The parent prints the report; exiting quietly avoids a second copy on stderr.
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()


if __name__ == "spyreccl_bench_rank":
    _run(SPYRECCL_BENCH_ARGS)  # type: ignore[name-defined]  # noqa: F821
