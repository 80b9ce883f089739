"""Case matrices and per-rank checking loops shared by the per-operation test modules.

Every module of this directory tests one c10d operation of the spyreccl backend in one
module-scoped rank pool per world size (2 and 3). To keep the inter-process overhead low, a
test sends a whole list of cases to the ranks in ONE `pool.run` call; each rank runs them in
order (all ranks see the same list, so they issue the same collectives in the same order),
checks its own results and returns the failures as text. Each case:

- draws fresh inputs (the case seed derives from a base seed taken from `os.urandom`, or from
  SPYRECCL_TEST_SEED to replay a failure) with `spyreccl_testing.inputs.random_tensor`; every
  rank can rebuild every other rank's input from the seed, so the reference is computed
  locally, without exchanging data;
- poisons out-of-place outputs before the call (`poison_`);
- compares with the float64 / exact reference of `spyreccl_testing.accuracy`, and - where gloo
  supports the dtype and reduce op - with gloo's answer for the same inputs as CPU tensors (the
  pools use "cpu:gloo,spyre:spyreccl", so the same ranks run both);
- checks that inputs of out-of-place operations are left untouched.

Cases are plain tuples (dtypes, strings, ints, shapes): they are pickled to the ranks in one
message per batch.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spyreccl_testing import FunctionRef, RankContext, RankPool
from spyreccl_testing.accuracy import assert_close_dtype, gloo_tolerance, premul_sum
from spyreccl_testing.inputs import fresh_seed, random_tensor, rank_seed

# -- the matrix ----------------------------------------------------------------------------

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
FLOAT_DTYPES = frozenset(d for d in DTYPES if d.is_floating_point)

REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM", "BAND", "BOR", "BXOR")

# Staging area of the collectives and of send/recv in these pools: the core's minimum, so that
# the large cases span many pipeline slots for every dtype (LARGE one-byte elements are 4 slots,
# LARGE float64 elements 32) while staying cheap to generate and check on a 2-core machine.
CHUNK_BYTES = 16 * 1024
P2P_CHUNK_BYTES = 16 * 1024
LARGE = 65_537

# Element counts: empty, one element, odd, and larger than the staging chunk for every dtype.
SIZES = (0, 1, 1001, LARGE)
# Shapes with those counts for operations that take any shape: a 0-d tensor for the single
# element, and a 3-d odd shape.
SHAPES = ((0,), (), (7, 11, 13), (LARGE,))

POOL_OPTIONS: dict[str, Any] = {
    "backend": "cpu:gloo,spyre:spyreccl",
    "set_device": True,
    "env": {
        "SPYRECCL_CHUNK_BYTES": str(CHUNK_BYTES),
        "SPYRECCL_P2P_CHUNK_BYTES": str(P2P_CHUNK_BYTES),
    },
}
# Apply with `pytestmark = pytest.mark.rank_pool_options(**POOL_OPTIONS)` in a test module.

# The same pools, started once per world size for the whole session instead of once per
# module: each rank pays ~3 s to import torch and join the group, on a 2-core machine. Safe for
# modules that only issue collectives on the default group and leave no state behind (no
# subgroups, no timeouts that abort the group, no profiler sessions); a failing batch restarts
# the shared pool like any other. Apply with
# `pytestmark = pytest.mark.rank_pool_options(**SHARED_POOL_OPTIONS)`.
SHARED_POOL_OPTIONS: dict[str, Any] = {**POOL_OPTIONS, "shared": True}

RUN_TIMEOUT = 300.0  # seconds for one batch of cases (the machine is shared and has 2 cores)


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_params(dtypes: Iterable[torch.dtype] = DTYPES) -> list:
    return [pytest.param(d, id=dtype_id(d)) for d in dtypes]


# -- what is valid where -------------------------------------------------------------------


def reduction_valid(dtype: torch.dtype, op: str) -> bool:
    """Whether spyreccl.h defines `op` for `dtype` (independently of what the backend does):
    bitwise ops on integers and bool only, no average of booleans, PREMUL_SUM on floats."""
    if op in ("BAND", "BOR", "BXOR"):
        return dtype not in FLOAT_DTYPES
    if op == "AVG":
        return dtype != torch.bool
    if op == "PREMUL_SUM":
        return dtype in FLOAT_DTYPES
    return True


def rejection_pattern(dtype: torch.dtype, op: str) -> str:
    """Regex of the backend's message for an invalid (dtype, op) pair."""
    return rf"ReduceOp\.{op} is not supported for dtype {re.escape(str(dtype))}"


# gloo (torch 2.13) has no kernels for these dtypes at all ("Invalid scalar type").
_GLOO_UNSUPPORTED = frozenset({torch.int16, torch.float8_e4m3fn, torch.float8_e5m2})


def gloo_moves(dtype: torch.dtype) -> bool:
    return dtype not in _GLOO_UNSUPPORTED


def gloo_reduces(dtype: torch.dtype, op: str) -> bool:
    """Whether gloo computes (dtype, op): no PREMUL_SUM, no integer AVG, no float bitwise."""
    if not gloo_moves(dtype) or op == "PREMUL_SUM" or not reduction_valid(dtype, op):
        return False
    return not (op == "AVG" and dtype not in FLOAT_DTYPES)


def reduce_cases(
    dtype: torch.dtype,
    ops: Sequence[str] = REDUCE_OPS,
    sizes: Sequence[Any] = SIZES,
    async_modes: Sequence[bool] = (False, True),
) -> list[tuple]:
    """(dtype, op, size, async_op) for every combination; `size` is whatever the module's
    check function takes (an element count or a shape)."""
    return [(dtype, op, size, a) for op in ops for size in sizes for a in async_modes]


def numel(size: Any) -> int:
    """Element count of a size given as a count, a shape, or a list of shapes (summed)."""
    if isinstance(size, int):
        return size
    if size and all(isinstance(s, tuple | list) for s in size):
        return sum(numel(s) for s in size)
    total = 1
    for extent in size:
        total *= extent
    return total


# -- building blocks used inside the ranks --------------------------------------------------


def case_seed(base_seed: int, index: int) -> int:
    """Seed of case `index` of a batch (the same on every rank)."""
    return (base_seed + (index + 1) * 0x632BE59BD9B4E019) % (1 << 63)


def rank_inputs(
    seed: int, shape: Any, dtype: torch.dtype, world_size: int, salt: int = 0
) -> list[torch.Tensor]:
    """Every rank's CPU input for a case (any rank can rebuild any other rank's data)."""
    return [
        random_tensor(shape, dtype, "cpu", rank_seed(seed + salt, r), nranks=world_size)
        for r in range(world_size)
    ]


def premul_factor(seed: int) -> float:
    """A PREMUL_SUM factor in [0.25, 2) for a case, reproducible from its seed."""
    gen = torch.Generator().manual_seed(seed)
    return 0.25 + 1.75 * float(torch.rand((), generator=gen, dtype=torch.float64))


def dist_op(op: str, factor: float | None = None) -> Any:
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, op)


def reference_op(op: str, factor: float | None = None) -> Any:
    if op == "PREMUL_SUM":
        return premul_sum(factor)
    return op.lower()


def device(ctx: RankContext) -> torch.device:
    """The spyre device this rank's pool bound (set_device=True: spyre:<rank>)."""
    return torch.device(ctx.device if ctx.device else "spyre")


def issue(collective: Callable[..., Any], *args: Any, async_op: bool, **kwargs: Any) -> Any:
    """Calls a torch.distributed collective synchronously or asynchronously; in the async
    case waits on what it returned (a Work, or a Future for the deprecated coalesced APIs)
    and checks that it reports successful completion. Returns that object (or None)."""
    name = getattr(collective, "__name__", repr(collective))
    result = collective(*args, async_op=async_op, **kwargs)
    if not async_op:
        assert result is None, f"{name}(async_op=False) returned {result!r}, expected None"
        return None
    assert result is not None, f"{name}(async_op=True) returned nothing to wait on"
    if isinstance(result, torch._C.Future):
        result.wait()
        assert result.done(), f"{name}: Future not done after wait()"
        return result
    assert result.wait(), f"{name}: Work.wait() returned False"
    assert result.is_completed(), f"{name}: Work not completed after wait()"
    assert result.is_success(), f"{name}: Work completed without success"
    return result


def check_result(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    world_size: int,
    seed: int,
    what: str,
    op: str | None = None,
) -> None:
    """Backend result vs the independent reference, with the dtype's default tolerance (for
    16/8-bit floats: 2 ulps plus the float32-accumulation absolute term that covers results
    where the ranks' values cancel, e.g. bfloat16 PREMUL_SUM under a fused multiply-add).
    `op` (the reduce op that produced it) is kept for the failure message."""
    assert actual.device.type == "spyre", f"{what}: result moved to {actual.device}"
    assert_close_dtype(actual.cpu(), expected, dtype, world_size, seed=seed, what=what)


def check_gloo(
    actual: torch.Tensor,
    gloo: torch.Tensor,
    dtype: torch.dtype,
    world_size: int,
    seed: int,
    what: str,
    op: str = "SUM",
) -> None:
    """Backend result vs gloo's on the same CPU inputs, within gloo_tolerance: gloo reduces
    16-bit floats in their own precision (and AVG rounds the sum, then the quotient), so its
    answer is the less precise one; the strict check is the one against the float64
    reference."""
    assert_close_dtype(
        actual.cpu(),
        gloo,
        dtype,
        world_size,
        seed=seed,
        what=f"{what} vs gloo",
        **gloo_tolerance(dtype, world_size, op),
    )


def check_exact(
    actual: torch.Tensor, expected: torch.Tensor, seed: int, world_size: int, what: str
) -> None:
    """Data movement must be bit-exact: same dtype, shape and bytes as `expected` (a CPU
    tensor). On a mismatch, assert_close_dtype explains it (elements, never-written poison);
    a result that is merely close is still reported as not bit-exact."""
    assert actual.device.type == "spyre", f"{what}: result moved to {actual.device}"
    got = actual.detach().cpu().contiguous()
    want = expected.contiguous()
    if (
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    ):
        return
    assert_close_dtype(got, want, want.dtype, world_size, seed=seed, what=what, ulps=0.0)
    raise AssertionError(f"{what} (seed={seed}): values match but the bytes differ")


def check_untouched(tensor: torch.Tensor, original: torch.Tensor, what: str) -> None:
    """Bitwise equality (NaN-safe) of an input after an out-of-place operation."""
    now = tensor.detach().cpu().contiguous()
    assert now.shape == original.shape and now.dtype == original.dtype, (
        f"{what}: changed to shape {tuple(now.shape)} / {now.dtype}"
    )
    if now.numel() == 0:
        return
    a = now.reshape(-1).view(torch.uint8)
    b = original.contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(a, b):
        raise AssertionError(f"{what}: the operation modified a tensor it should only read")


def expect_rejection(call: Callable[[], Any], pattern: str, what: str) -> None:
    """`call` must raise on this rank with a message matching `pattern`."""
    try:
        call()
    except (RuntimeError, ValueError, TypeError) as exc:
        if not re.search(pattern, str(exc)):
            raise AssertionError(
                f"{what}: raised {type(exc).__name__} with an unexpected message (wanted "
                f"/{pattern}/): {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc
        return
    raise AssertionError(f"{what}: expected a rejection matching /{pattern}/, but it ran")


class DeferredChecks:
    """Collects check failures of a case whose collectives are interleaved with checks, so
    that a rank whose check fails still takes part in every later collective of the case
    (skipping one would leave the other ranks blocked in it). Use as a context manager: the
    failures are raised together when the block ends normally."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        try:
            check(*args, **kwargs)
        except AssertionError as exc:
            self.failures.append(str(exc))

    def __enter__(self) -> DeferredChecks:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None and self.failures:
            raise AssertionError("\n".join(self.failures))


_MAX_REPORTED = 12


class BatchAborted(RuntimeError):
    """A collective raised unexpectedly: the rest of the batch was not run."""


def run_cases(
    check: Callable[..., None], cases: Sequence[tuple], base_seed: int, ctx: RankContext
) -> list[str]:
    """Runs check(case, seed, ctx) for each case on this rank and returns one line per
    failed check (case, seed, message).

    A failed check (AssertionError: wrong numbers, unexpected rejection message) leaves the
    group usable, so the batch goes on. Any other exception comes from the operation itself
    and may have broken the communicator or torch's per-group state: the batch stops and
    BatchAborted is raised, so that the rank pool reports every rank's traceback and starts
    afresh instead of handing a broken group to the next test.
    """
    failures: list[str] = []
    for index, case in enumerate(cases):
        seed = case_seed(base_seed, index)
        try:
            check(case, seed, ctx)
        except AssertionError as exc:
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            failures.append(f"rank {ctx.rank} case #{index} {_describe(case)} seed={seed}:\n{text}")
            if len(failures) >= _MAX_REPORTED:
                failures.append(f"rank {ctx.rank}: stopped after case #{index} of {len(cases)}")
                break
        except Exception as exc:
            earlier = "".join(f"\n  earlier: {line}" for line in failures)
            raise BatchAborted(
                f"rank {ctx.rank} case #{index} {_describe(case)} seed={seed} (base seed "
                f"{base_seed}) raised {type(exc).__name__}: {exc}{earlier}"
            ) from exc
    return failures


def _run_batch_on_rank(
    check: FunctionRef, cases: Sequence[tuple], base_seed: int, ctx: RankContext
):
    return run_cases(check.resolve(), cases, base_seed, ctx)


def run_batch(
    rank_pool: RankPool,
    check: Callable[..., None],
    cases: Sequence[tuple],
    what: str,
    timeout: float = RUN_TIMEOUT,
) -> None:
    """The body of a table-driven test: runs check(case, seed, ctx) for every case on every
    rank in one pool.run (fresh base seed), then fails with every rank's failures and the seed
    to replay. `check` must be a module-level function of the test module."""
    seed = fresh_seed()
    results = rank_pool.run(
        _run_batch_on_rank, FunctionRef.from_callable(check), cases, seed, timeout=timeout
    )
    assert_ranks_passed(results, seed, what)


def _describe(case: tuple) -> str:
    return (
        "(" + ", ".join(dtype_id(x) if isinstance(x, torch.dtype) else repr(x) for x in case) + ")"
    )


def assert_ranks_passed(results: Sequence[list[str]], base_seed: int, what: str) -> None:
    """Raises one AssertionError listing every rank's failures (with the seed to replay)."""
    lines = [line for per_rank in results for line in per_rank]
    if lines:
        raise AssertionError(
            f"{what}: {len(lines)} failure(s); replay with SPYRECCL_TEST_SEED={base_seed}\n"
            + "\n".join(lines)
        )
