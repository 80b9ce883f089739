"""Independent numpy references for reductions and the checks that compare against them."""

from __future__ import annotations

import numpy as np
from dtypes import TType

from spyreccl_core import ReduceOp

BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def valid_ops(tt: TType) -> list[ReduceOp]:
    """Reduce ops the C API defines for `tt` (see spyrecclRedOp_t)."""
    ops = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN]
    if tt.kind != "bool":
        ops.append(ReduceOp.AVG)
    if tt.kind in ("int", "bool"):
        ops += list(BITWISE)
    if tt.kind in ("float", "lowp"):
        ops.append(ReduceOp.PREMUL_SUM)
    return ops


def invalid_ops(tt: TType) -> list[ReduceOp]:
    return [op for op in ReduceOp if op not in valid_ops(tt)]


def inputs_for(tt: TType, seed: int, tag: int, rank: int, n: int) -> np.ndarray:
    """Rank `rank`'s input of a case; workers and the checking parent derive the same."""
    return tt.random(np.random.default_rng([seed, tag, rank, n]), n)


def _int_reference(op: ReduceOp, xs: list[np.ndarray]) -> np.ndarray:
    dtype = xs[0].dtype
    if op == ReduceOp.AVG:
        # Exact sum (Python integers), then C division: truncation toward zero.
        exact = sum(x.astype(object) for x in xs)
        n = len(xs)
        quotient = [(abs(v) // n) * (1 if v >= 0 else -1) for v in exact]
        return np.array(quotient, dtype=object).astype(dtype)
    acc = xs[0].copy()
    with np.errstate(over="ignore"):
        for x in xs[1:]:
            if op == ReduceOp.SUM:
                acc = acc + x  # numpy wraps modulo 2**bits, like the C API
            elif op == ReduceOp.PROD:
                acc = acc * x
            elif op == ReduceOp.MAX:
                acc = np.maximum(acc, x)
            elif op == ReduceOp.MIN:
                acc = np.minimum(acc, x)
            elif op == ReduceOp.BAND:
                acc = acc & x
            elif op == ReduceOp.BOR:
                acc = acc | x
            elif op == ReduceOp.BXOR:
                acc = acc ^ x
    return acc.astype(dtype)


def _bool_reference(op: ReduceOp, xs: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack(xs)
    if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
        return stacked.any(axis=0)
    if op in (ReduceOp.PROD, ReduceOp.MIN, ReduceOp.BAND):
        return stacked.all(axis=0)
    if op == ReduceOp.BXOR:
        return (stacked.sum(axis=0) % 2).astype(np.bool_)
    raise AssertionError(f"no bool reference for {op!r}")


def _float_reference(op: ReduceOp, xs: list[np.ndarray], scalar: float | None) -> np.ndarray:
    stacked = np.stack(xs)  # float64
    if op == ReduceOp.SUM:
        return stacked.sum(axis=0)
    if op == ReduceOp.PROD:
        return stacked.prod(axis=0)
    if op == ReduceOp.MAX:
        return stacked.max(axis=0)
    if op == ReduceOp.MIN:
        return stacked.min(axis=0)
    if op == ReduceOp.AVG:
        return stacked.sum(axis=0) / len(xs)
    if op == ReduceOp.PREMUL_SUM:
        return (scalar * stacked).sum(axis=0)
    raise AssertionError(f"no float reference for {op!r}")


def _ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """Sign-magnitude float codes -> integers that are monotonic in the value."""
    b = bits.astype(np.int64)
    sign = 1 << (width - 1)
    return np.where(b & sign, -(b & (sign - 1)), b)


def check_reduction(
    tt: TType,
    op: ReduceOp,
    got: np.ndarray,
    raw_inputs: list[np.ndarray],
    scalar: float | None = None,
    what: str = "",
) -> None:
    """Asserts that `got` is `op` over `raw_inputs`, within the API's rounding rules."""
    assert got.dtype == tt.storage and got.shape == raw_inputs[0].shape, what
    if got.size == 0:
        return
    if tt.kind == "int":
        expected = _int_reference(op, raw_inputs)
        _assert_equal(got, expected, what)
        return
    if tt.kind == "bool":
        # Outputs must be canonical bools (byte 0 or 1), which also catches unwritten 0xA5.
        assert np.all(got.view(np.uint8) <= 1), f"{what}: non-canonical bool bytes"
        _assert_equal(got, _bool_reference(op, raw_inputs), what)
        return
    xs = [tt.decode(x) for x in raw_inputs]
    exact = _float_reference(op, xs, scalar)
    if tt.kind == "lowp":
        # float32 accumulation, one rounding at the end: the test inputs make SUM/MIN/MAX
        # exact in float32; PROD/AVG/PREMUL_SUM may round twice -> one unit in the last place.
        width = tt.storage.itemsize * 8
        expected_bits = tt.encode(exact).view(f"u{tt.storage.itemsize}")
        got_bits = got.view(f"u{tt.storage.itemsize}")
        tolerance = 0 if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN) else 1
        distance = np.abs(_ordered(got_bits, width) - _ordered(expected_bits, width))
        nan = np.isnan(tt.decode(got))
        bad = np.nonzero(nan | (distance > tolerance))[0]
        if bad.size:
            i = bad[0]
            raise AssertionError(
                f"{what}: {bad.size} of {got.size} elements wrong; first at [{i}]: got "
                f"{tt.decode(got[i : i + 1])[0]!r} (bits {int(got_bits[i]):#x}), expected "
                f"{tt.decode(expected_bits[i : i + 1].view(tt.storage))[0]!r} "
                f"(bits {int(expected_bits[i]):#x}), inputs "
                f"{[float(x[i]) for x in xs]} (tolerance {tolerance} ulp)"
            )
        return
    # float32/float64: the library may sum in any order; bound the rounding error by
    # (number of ranks + 1) roundings of the magnitudes involved.
    eps = np.finfo(tt.storage).eps
    n = len(xs)
    magnitude = {
        ReduceOp.SUM: lambda: np.abs(np.stack(xs)).sum(axis=0),
        ReduceOp.AVG: lambda: np.abs(np.stack(xs)).sum(axis=0) / n,
        ReduceOp.PREMUL_SUM: lambda: np.abs(scalar * np.stack(xs)).sum(axis=0) * 2,
        ReduceOp.PROD: lambda: np.abs(exact),
    }.get(op, lambda: np.zeros_like(exact))()
    tolerance = (n + 1) * eps * magnitude
    got64 = got.astype(np.float64)
    bad = np.nonzero(~(np.abs(got64 - exact) <= tolerance))[0]
    if bad.size:
        i = bad[0]
        raise AssertionError(
            f"{what}: {bad.size} of {got.size} elements wrong; first at [{i}]: got "
            f"{got64[i]!r}, expected {exact[i]!r} +- {tolerance[i]:.3g}, inputs "
            f"{[float(x[i]) for x in xs]}"
        )


def _assert_equal(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    bad = np.nonzero(got != expected)[0]
    if bad.size:
        i = bad[0]
        raise AssertionError(
            f"{what}: {bad.size} of {got.size} elements wrong; first at [{i}]: got "
            f"{got[i]!r}, expected {expected[i]!r}"
        )


def assert_bytes_equal(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Exact comparison for data movement (bit patterns, NaN-safe)."""
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    _assert_equal(got.view(np.uint8), expected.view(np.uint8), what)
