"""Independent references and dtype-aware comparisons for reduction collectives, on tensors.

A thin torch adapter over `spyreccl_testing.numerics`, which holds the one implementation of
the references and tolerances (shared with the torch-free spyreccl-core tests): floating inputs
are reduced in float64 with numpy, integers exactly (wrap-around SUM/PROD, exact AVG truncated
toward zero), bools with logic operations. Only the final result is rounded back to the tested
dtype, mirroring the backend contract (float32 accumulation and a single rounding for 16/8-bit
floats, see spyreccl.h).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from spyreccl_testing import _dtypes, numerics
from spyreccl_testing.numerics import PreMulSum, normalize_op, premul_sum

__all__ = [
    "PreMulSum",
    "assert_close_dtype",
    "compare_with_gloo",
    "default_tolerance",
    "gloo_tolerance",
    "normalize_op",
    "premul_sum",
    "reference_reduce",
    "ulp",
]


def _stored(x: Any, dtype: torch.dtype | None) -> tuple[np.ndarray, torch.dtype]:
    """(stored numpy buffer, dtype) of a tensor or array-like (converted to `dtype` if given)."""
    tensor = x.detach().to("cpu") if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return _dtypes.to_stored(tensor), tensor.dtype


def reference_reduce(
    inputs: Sequence[Any], op: Any, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Element-wise reduction of the per-rank `inputs` (tensors or arrays of equal shape),
    computed independently of any backend and returned as a CPU tensor of `dtype`.

    Semantics follow spyreccl.h: integer SUM/PROD wrap around, integer AVG divides the exact sum
    and truncates toward zero, bool SUM/MAX are OR and PROD/MIN are AND, AVG on bool and
    bitwise ops on floats are rejected, PREMUL_SUM (premul_sum(factor)) scales every input.
    `op` is a name, a torch.distributed.ReduceOp member or premul_sum(factor).
    """
    if len(inputs) == 0:
        raise ValueError("reference_reduce: expected at least one rank's input, got none")
    if dtype is None:
        dtype = _stored(inputs[0], None)[1]
    fmt = _dtypes.format_of(dtype, "reference_reduce")
    stored = [_stored(x, dtype)[0] for x in inputs]
    result = numerics.reduce_reference(stored, op, fmt)
    return _dtypes.from_stored(fmt.encode(result) if fmt.is_float else result, dtype)


def default_tolerance(dtype: torch.dtype, world_size: int) -> dict[str, float]:
    """Tolerances assert_close_dtype uses for `dtype` over `world_size` ranks: exact for
    integers and bools, rtol = atol = c*n for float64/float32, and for 16/8-bit floats 2 ulps
    plus an absolute n * 2**-22 (float32 accumulation residue, which matters where the
    ranks' values cancel); see numerics.default_tolerance."""
    return numerics.default_tolerance(_dtypes.format_of(dtype, "default_tolerance"), world_size)


def gloo_tolerance(dtype: torch.dtype, world_size: int, op: Any = "sum") -> dict[str, float]:
    """Budget for comparing a spyreccl result with gloo's on the same inputs.

    gloo reduces 16-bit floats in their own precision: each of the world_size - 1 partial sums
    (magnitude up to world_size for inputs in [-1, 1)) is rounded, so where the ranks' values
    cancel gloo's answer is off by up to (world_size - 1) roundings at that scale - many ulps of
    the small result. Hence an absolute term n*n*eps and a relative 2*eps. AVG additionally
    divides the already rounded sum and rounds again (bfloat16 at world size 3: the division
    by 3 is inexact), which costs one more rounding of the result: +1 eps relative. Other
    dtypes use the default tolerance (float32/float64: gloo sums in the dtype, within c*n).
    """
    fmt = _dtypes.format_of(dtype, "gloo_tolerance")
    if not (fmt.is_float and fmt.low_precision):
        return default_tolerance(dtype, world_size)
    name, _ = normalize_op(op)
    n = max(1, world_size)
    rtol = 2.0 * fmt.eps
    if name == "avg":
        rtol += fmt.eps
    return {"rtol": rtol, "atol": n * n * fmt.eps, "ulps": 0.0}


def ulp(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Spacing of `dtype` at each |value| (float64 array), subnormal range included."""
    return numerics.ulp(values, _dtypes.format_of(dtype, "ulp"))


def assert_close_dtype(
    actual: Any,
    expected: Any,
    dtype: torch.dtype | None = None,
    world_size: int = 1,
    *,
    seed: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    ulps: float | None = None,
    what: str = "result",
    max_report: int = 8,
) -> None:
    """Asserts that `actual` matches `expected` within the tolerance of `dtype`.

    `actual` must already have `dtype` (a backend that silently changes the dtype is a bug);
    `expected` is converted to it. Floats pass within atol + rtol*|expected| + ulps*ulp, each
    term defaulting to default_tolerance(dtype, world_size) (pass 0 to drop one). Elements
    still holding the poison are reported as such. Messages carry `what`, dtype, world size
    and `seed` so a failure can be replayed.
    """
    act_tensor = actual.detach().to("cpu") if isinstance(actual, torch.Tensor) else None
    act_dtype = act_tensor.dtype if act_tensor is not None else _stored(actual, None)[1]
    dtype = dtype if dtype is not None else act_dtype
    fmt = _dtypes.format_of(dtype, "assert_close_dtype")
    if act_dtype != dtype:
        header = f"{what} (dtype={dtype}, world_size={world_size}" + (
            f", seed={seed})" if seed is not None else ")"
        )
        raise AssertionError(f"{header}: has dtype {act_dtype}, expected {dtype}")
    act, _ = _stored(actual, dtype)
    exp, _ = _stored(expected, dtype)
    numerics.assert_close(
        act,
        exp,
        fmt,
        world_size,
        seed=seed,
        rtol=rtol,
        atol=atol,
        ulps=ulps,
        what=what,
        max_report=max_report,
    )


# ------------------------------------------------------------------------------------------
# Cross-checking against gloo
# ------------------------------------------------------------------------------------------


def compare_with_gloo(
    pool: Any,
    fn: Callable[..., Any],
    *args: Any,
    device: str = "spyre",
    timeout: float = 60.0,
    seed: int | None = None,
    ulps: float | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs: Any,
) -> tuple[list[Any], list[Any]]:
    """Runs `fn(*args, device=..., **kwargs)` on every rank of `pool` twice, once with tensors on
    `device` (reaching spyreccl) and once on "cpu" (reaching gloo), and asserts that every
    rank's results agree tensor by tensor. Returns (device results, gloo results).

    `fn` must build its inputs from its arguments (pass a seed so both runs see the same values)
    and return tensors, or lists/tuples/dicts of them, moved to the CPU. The pool needs a
    backend that serves both devices, e.g. "cpu:gloo,spyre:spyreccl". gloo reduces 16-bit
    floats in their own precision, so the default ulp budget grows with the world size.
    """
    backend = getattr(pool, "backend", None)
    if backend is None or "gloo" not in str(backend):
        raise ValueError(
            "compare_with_gloo: the pool's backend must route CPU tensors to gloo (e.g. "
            f"backend='cpu:gloo,spyre:spyreccl'), got backend={backend!r}"
        )
    world_size = pool.world_size
    tested = pool.run(fn, *args, device=device, timeout=timeout, **kwargs)
    reference = pool.run(fn, *args, device="cpu", timeout=timeout, **kwargs)
    if ulps is None:
        ulps = float(world_size + 1)
    for rank, (got, want) in enumerate(zip(tested, reference)):
        _compare_tree(
            got,
            want,
            f"rank {rank} result of {getattr(fn, '__qualname__', fn)} on {device} vs gloo",
            world_size=world_size,
            seed=seed,
            ulps=ulps,
            rtol=rtol,
            atol=atol,
        )
    return tested, reference


def _compare_tree(got: Any, want: Any, what: str, **tol: Any) -> None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a tensor, got {type(got).__name__}")
        low_precision = want.dtype in _dtypes.LOW_PRECISION_FLOATS
        assert_close_dtype(
            got,
            want,
            want.dtype,
            tol["world_size"],
            seed=tol["seed"],
            ulps=tol["ulps"] if low_precision else None,
            rtol=tol["rtol"],
            atol=tol["atol"],
            what=what,
        )
    elif isinstance(want, Mapping):
        if not isinstance(got, Mapping) or set(got) != set(want):
            raise AssertionError(f"{what}: keys {sorted(got)} differ from {sorted(want)}")
        for key in want:
            _compare_tree(got[key], want[key], f"{what}[{key!r}]", **tol)
    elif isinstance(want, list | tuple):
        if not isinstance(got, list | tuple) or len(got) != len(want):
            raise AssertionError(f"{what}: expected a sequence of {len(want)} items, got {got!r}")
        for i, (g, w) in enumerate(zip(got, want)):
            _compare_tree(g, w, f"{what}[{i}]", **tol)
    elif got != want:
        raise AssertionError(f"{what}: {got!r} != {want!r}")
