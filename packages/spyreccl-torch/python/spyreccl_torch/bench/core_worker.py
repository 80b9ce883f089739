"""One rank of the ``core`` / ``core-host`` levels: spyreccl_core collectives, no torch.

``memory`` (an argument) chooses the buffers: "arena" (spyreccl_core.empty: large
collectives read peers' buffers in place) or "host" (numpy.empty: staged transfers).

This file is executed with :func:`runpy.run_path` in a fresh spawn process (see
``launcher.RankJob``), never imported as part of ``spyreccl_torch``: importing the package
would import torch, and this level exists to measure the library without torch's dispatch
overhead (and without torch's memory footprint, which matters with 4 ranks on 2 cores).
Its only imports are the standard library, numpy, spyreccl_core and the torch-free sibling
modules ``timing.py`` and ``check.py``, loaded by file path.

The parent passes ``SPYRECCL_BENCH_ARGS`` (a dict) as a global: rank, nranks, conn (the write
end of the report pipe), unique_id (bytes), dtype, numpy_dtype, reinterpret, cases (list
of dicts, see plan.Case), policy (dict of timing.LoopPolicy fields), check (bool: verify
each case's result once before timing it, see check.py), timeout_s, memory.
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


class _Case:
    """Buffers and the one-operation closure of a case on this rank."""

    def __init__(
        self, core: Any, comm: Any, case: dict, dtype: Any, np_dtype: str, rank: int, memory: str
    ) -> None:
        import numpy as np

        self.op = case["op"]
        self.send = self.recv = None
        self.step: Callable[[], object] | None = None
        if self.op == "barrier":
            self.step = comm.barrier
            return
        # Written once so that every page is private and resident before timing: a fresh
        # np.empty/np.zeros maps the shared zero page, which would make the first timed
        # reads look faster than memory.
        empty = core.empty if memory == "arena" else np.empty
        send = self.send = empty(case["send_elems"], dtype=np_dtype)
        recv = self.recv = empty(case["recv_elems"], dtype=np_dtype)
        send.fill(0)
        recv.fill(0)
        kw = {} if dtype is None else {"dtype": dtype}
        SUM = core.ReduceOp.SUM
        op = self.op
        if op == "all_reduce":
            self.step = lambda: comm.all_reduce(send, recv, SUM, **kw)
        elif op == "all_reduce_inplace":
            self.step = lambda: comm.all_reduce(send, send, SUM, **kw)
        elif op == "all_gather_into_tensor":
            self.step = lambda: comm.all_gather(send, recv, **kw)
        elif op == "reduce_scatter_tensor":
            self.step = lambda: comm.reduce_scatter(send, recv, SUM, **kw)
        elif op == "broadcast":
            self.step = lambda: comm.broadcast(send, 0, **kw)
        elif op == "all_to_all_single":
            self.step = lambda: comm.all_to_all(send, recv, **kw)
        elif op == "sendrecv":
            if rank == 0:

                def ping() -> None:
                    comm.send(send, 1, **kw)
                    comm.recv(recv, 1, **kw)

                self.step = ping
            elif rank == 1:

                def pong() -> None:
                    comm.recv(recv, 0, **kw)
                    comm.send(send, 0, **kw)

                self.step = pong
        else:
            raise ValueError(f"core bench rank: unknown operation {op!r}")


def _encode(np: Any, values: list[int], np_dtype: str, reinterpret: bool) -> Any:
    """values as an array of the buffer dtype; bfloat16 travels as its upper 16 bits."""
    if reinterpret:
        return (np.asarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.asarray(values, dtype=np_dtype)


def _check(
    check: Any,
    np: Any,
    c: _Case,
    case: dict,
    rank: int,
    nranks: int,
    np_dtype: str,
    reinterpret: bool,
) -> None:
    """Runs the case once on known inputs and raises if this rank's result is wrong."""
    if c.send is None or c.step is None:
        return
    inputs = _encode(np, check.input_blocks(c.op, rank, nranks), np_dtype, reinterpret)
    c.send.reshape(len(inputs), -1)[:] = inputs[:, None]
    result = c.send if check.result_is_send(c.op, "core") else c.recv
    if result is not c.send:
        result.fill(check.POISON)
    c.step()
    expected = check.expected_blocks(c.op, rank, nranks)
    if expected is not None:
        want = np.repeat(_encode(np, expected, np_dtype, reinterpret), result.size // len(expected))
        if not np.array_equal(result, want):
            bad = np.flatnonzero(result != want)
            i = int(bad[0])
            raise AssertionError(
                f"core {c.op} of {case['nbytes']} B at {nranks} ranks: rank {rank} has "
                f"{bad.size} wrong element(s) of {result.size}; first at index {i}: "
                f"{result[i]!r}, expected {want[i]!r}"
            )
    c.send.fill(0)
    c.recv.fill(0)


def _run(args: dict) -> None:
    conn = args["conn"]
    rank, nranks = args["rank"], args["nranks"]
    try:
        timing = _load_sibling("timing")
        check = _load_sibling("check")
        import numpy as np

        import spyreccl_core as core

        reinterpret = args["reinterpret"]
        np_dtype = args["numpy_dtype"]
        dtype = getattr(core.DataType, args["dtype"].upper()) if reinterpret else None
        comm = core.Communicator(
            rank, nranks, core.UniqueId.from_bytes(args["unique_id"]), timeout=args["timeout_s"]
        )
        conn.send(
            (
                "ready",
                {
                    "pid": os.getpid(),
                    "spyreccl_core": core.__version__,
                    "library": core.library_version(),
                    "numpy": np.__version__,
                },
            )
        )
        policy = timing.LoopPolicy(**args["policy"])
        probe = np.zeros(1, dtype=np.float64)

        def agree_max(value: float) -> float:
            probe[0] = value
            comm.all_reduce(probe, op=core.ReduceOp.MAX)
            return float(probe[0])

        for case in args["cases"]:
            c = _Case(core, comm, case, dtype, np_dtype, rank, args.get("memory", "host"))
            if args["check"]:
                _check(check, np, c, case, rank, nranks, np_dtype, reinterpret)
            samples = timing.measure_case(
                c.step, comm.barrier, agree_max, nbytes=case["nbytes"], policy=policy
            )
            conn.send(("case", case["index"], samples))
            del c
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
