"""What the spyreccl_core binding tests add to spyreccl-testing: a Communicator per rank, and
the C API's names for the element types (numpy only, never torch).

The rank pool, seeds, number formats, references and tolerances all come from
spyreccl-testing (`spyreccl_testing.numerics`), shared with the torch tests. This module
supplies:

- `with_communicator`, the pool's task_wrapper: every task runs as fn(comm, *args) with its
  rank's Communicator, formed once per pool start over a rendezvous file in the pool's private
  directory. When a task raises, the wrapper destroys that communicator, so that peers blocked
  in a collective on it fail at once (departed peer) instead of stalling until the pool kills
  them; the pool then restarts and the next task forms a fresh communicator.
- `TType`: a format plus the dtype= override the bindings need (bfloat16 and float8 travel as
  uint16 / uint8 buffers).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import spyreccl_core
from spyreccl_core import DataType, ReduceOp
from spyreccl_testing import RankContext, numerics

# Small staging areas so that modest arrays already exercise the chunked pipelines.
STAGING_BYTES = 16384
COMM_OPTIONS = {"timeout": 30.0, "chunk_bytes": STAGING_BYTES, "p2p_chunk_bytes": STAGING_BYTES}

# ---------------------------------------------------------------------------------------
# The per-rank communicator
# ---------------------------------------------------------------------------------------

_comm: spyreccl_core.Communicator | None = None


def rank_communicator(ctx: RankContext) -> spyreccl_core.Communicator:
    """This rank's communicator, formed at the first task after the pool (re)started."""
    global _comm
    if _comm is None:
        # shared_dir is new at every pool start, so the rendezvous file is never stale.
        path = os.path.join(ctx.shared_dir, "communicator.uid")
        _comm = spyreccl_core.rendezvous.init_from_file(
            path, ctx.rank, ctx.world_size, rendezvous_timeout=60.0, **COMM_OPTIONS
        )
    return _comm


def with_communicator(
    task: Callable[..., Any], args: tuple, kwargs: dict[str, Any], ctx: RankContext
) -> Any:
    """task_wrapper of the core tests' pools: runs task(comm, *args, **kwargs)."""
    global _comm
    comm = rank_communicator(ctx)
    try:
        return task(comm, *args, **kwargs)
    except BaseException:
        _comm = None
        comm.destroy()  # peers waiting on this rank now get RemoteError instead of hanging
        raise


# ---------------------------------------------------------------------------------------
# Element types as the bindings see them
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TType:
    name: str  # the C API's name (test ids)
    fmt: numerics.NumericFormat
    override: DataType | None  # dtype= passed to spyreccl (None: inferred from the buffer)

    def __repr__(self) -> str:
        return self.name

    @property
    def storage(self) -> np.dtype:
        return self.fmt.storage

    @property
    def kind(self) -> str:
        """ "float" (32/64-bit), "lowp" (16/8-bit: float32 accumulation), "int" or "bool"."""
        if self.fmt.is_float:
            return "lowp" if self.fmt.low_precision else "float"
        return self.fmt.kind

    @property
    def kwargs(self) -> dict:
        return {} if self.override is None else {"dtype": self.override}

    def decode(self, stored: np.ndarray) -> np.ndarray:
        return self.fmt.decode(stored)

    def encode(self, values: np.ndarray) -> np.ndarray:
        return self.fmt.encode(values)

    def random(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Full-range integers, and floats whose SUM/MIN/MAX over <= 3 ranks are exact in
        float32 accumulation (numerics.random_full_range)."""
        return numerics.random_full_range(self.fmt, n, rng)

    def poison(self, n: int) -> np.ndarray:
        return numerics.poisoned(self.fmt, n)


def _t(name: str, fmt: str, override: DataType | None = None) -> TType:
    return TType(name, numerics.numeric_format(fmt), override)


FLOATS = [_t("float32", "float32"), _t("float64", "float64")]
LOWP = [
    _t("float16", "float16"),
    _t("bfloat16", "bfloat16", DataType.BFLOAT16),
    _t("float8_e4m3", "float8_e4m3fn", DataType.FLOAT8_E4M3),
    _t("float8_e5m2", "float8_e5m2", DataType.FLOAT8_E5M2),
]
INTS = [_t(n, n) for n in ("int8", "uint8", "int16", "int32", "uint32", "int64", "uint64")]
BOOL = _t("bool", "bool")
ALL_TYPES = FLOATS + LOWP + INTS + [BOOL]
TYPES_BY_NAME = {t.name: t for t in ALL_TYPES}

# ---------------------------------------------------------------------------------------
# Inputs and checks
# ---------------------------------------------------------------------------------------


def valid_ops(tt: TType) -> list[ReduceOp]:
    """Reduce ops the C API defines for `tt` (see spyrecclRedOp_t)."""
    names = numerics.valid_ops(tt.fmt)
    return [op for op in ReduceOp if op.name.lower() in names]


def invalid_ops(tt: TType) -> list[ReduceOp]:
    return [op for op in ReduceOp if op not in valid_ops(tt)]


def inputs_for(tt: TType, seed: int, tag: int, rank: int, n: int) -> np.ndarray:
    """Rank `rank`'s input of a case; workers and the checking parent derive the same."""
    return tt.random(np.random.default_rng([seed, tag, rank, n]), n)


def check_reduction(
    tt: TType,
    op: ReduceOp,
    got: np.ndarray,
    raw_inputs: Sequence[np.ndarray],
    scalar: float | None = None,
    what: str = "",
) -> None:
    """Asserts that `got` is `op` over `raw_inputs`, within the C API's rounding rules:

    - integers and bools: exact;
    - 16/8-bit floats: float32 accumulation and one rounding; the inputs make SUM/MIN/MAX
      exact in float32, so those must equal the correctly rounded reference, while PROD, AVG
      and PREMUL_SUM may round twice (one ulp);
    - float32/float64: any summation order, so the error is bounded by (ranks + 1) roundings
      of the magnitudes involved, plus the rounding of the reference itself.
    """
    ref_op = numerics.premul_sum(scalar) if op == ReduceOp.PREMUL_SUM else op
    expected = numerics.reduce_reference(raw_inputs, ref_op, tt.fmt)
    n = len(raw_inputs)
    if tt.kind in ("int", "bool"):
        numerics.assert_close(got, expected, tt.fmt, n, what=what)
        return
    if tt.kind == "lowp":
        exact_ops = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN)
        ulps = 0.0 if op in exact_ops else 1.0
        numerics.assert_close(got, expected, tt.fmt, n, rtol=0, atol=0, ulps=ulps, what=what)
        return
    xs = np.stack([tt.decode(x) for x in raw_inputs]) if n else np.zeros((0,))
    magnitude = {
        ReduceOp.SUM: lambda: np.abs(xs).sum(axis=0),
        ReduceOp.AVG: lambda: np.abs(xs).sum(axis=0) / n,
        ReduceOp.PREMUL_SUM: lambda: np.abs(scalar * xs).sum(axis=0) * 2,
        ReduceOp.PROD: lambda: np.abs(expected),
    }.get(op, lambda: np.zeros_like(expected))()
    bound = (n + 2) * tt.fmt.eps * magnitude
    numerics.assert_close(got, expected, tt.fmt, n, rtol=0, atol=0, ulps=0, bound=bound, what=what)


assert_bytes_equal = numerics.assert_bytes_equal


# ---------------------------------------------------------------------------------------
# Ranks in processes of their own (cases that kill a rank or need a per-rank environment
# ruin or bypass a pool)
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def own_processes(
    target: Callable[..., None],
    args_per_rank: Sequence[tuple[Any, ...]],
    *,
    method: str = "fork",
) -> Iterator[tuple[list[Connection], list[multiprocessing.process.BaseProcess]]]:
    """Starts target(*args, conn) for each rank's args; yields (pipes, processes).

    Each rank reports through `conn`, the child end of its pipe; the test reads the parent
    ends. On leaving, every process is joined, and one still alive after 10 s is killed, so
    that a failing assertion never leaves a rank behind.
    """
    ctx = multiprocessing.get_context(method)
    pipes: list[Connection] = []
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        for args in args_per_rank:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(*args, child), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        yield pipes, procs
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def collect_reports(pipes: Sequence[Connection], timeout: float) -> list[Any]:
    """Each rank's ("ok", value) report, in rank order; a rank's ("error", text) fails."""
    results = []
    for rank, conn in enumerate(pipes):
        assert conn.poll(timeout), f"rank {rank} did not report"
        kind, value = conn.recv()
        assert kind == "ok", f"rank {rank}: {value}"
        results.append(value)
    return results


def assert_matches_reference_and_staged(
    got: dict, staged: dict, expected: dict, size: int, rank: int, path: str
) -> None:
    """One rank's float32 results of a path under test: within float32 rounding of the
    float64 reference (sums of `size` terms), and bit for bit equal to the same calls on the
    staged path (`path` names the path under test in the message)."""
    for key, want in expected.items():
        np.testing.assert_allclose(
            got[key].astype(np.float64), want, rtol=1e-6, atol=1e-6 * size, err_msg=f"{key} r{rank}"
        )
        assert np.array_equal(got[key].view(np.uint32), staged[key].view(np.uint32)), (
            f"{key} on rank {rank}: {path} and the staged path differ"
        )
