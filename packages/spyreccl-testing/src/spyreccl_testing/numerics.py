"""Number formats, independent reduction references and tolerance checks, in numpy only.

This is the one implementation of the test references of the project: the torch-free tests of
spyreccl-core use it directly on numpy buffers, and `spyreccl_testing.accuracy` /
`spyreccl_testing.inputs` wrap it for torch tensors. It never imports torch.

Buffers are handled in their *stored* form: the numpy dtype of the bytes handed to the library.
bfloat16 and the float8 formats have no numpy dtype, so they are stored as uint16 / uint8 bit
patterns and converted by the codecs below, written from the format definitions (not from the
library under test, nor from ml_dtypes).

References never use the arithmetic under test: floats are reduced exactly enough in float64,
integers exactly (with two's-complement wrap-around for SUM/PROD as the C API defines), bools
with logic operations. Only the final result is rounded to the tested format, once, which is
the backend contract (float32 accumulation and a single rounding for 16/8-bit floats).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ------------------------------------------------------------------------------------------
# Codecs for the formats numpy lacks
# ------------------------------------------------------------------------------------------


def _float8_values(exp_bits: int, mant_bits: int, *, finite_only: bool) -> np.ndarray:
    """float64 value of each of the 256 codes of a sign/exponent/mantissa float8 format.

    finite_only: the "fn" variant (e4m3fn): no infinities, only the all-ones codes are NaN.
    """
    bias = (1 << (exp_bits - 1)) - 1
    max_exp = (1 << exp_bits) - 1
    mant_mask = (1 << mant_bits) - 1
    values = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> mant_bits) & max_exp
        mant = code & mant_mask
        if exp == max_exp and not finite_only:
            values[code] = sign * math.inf if mant == 0 else math.nan
        elif finite_only and exp == max_exp and mant == mant_mask:
            values[code] = math.nan
        elif exp == 0:  # subnormal
            values[code] = sign * mant * 2.0 ** (1 - bias - mant_bits)
        else:
            values[code] = sign * (1 + mant / (1 << mant_bits)) * 2.0 ** (exp - bias)
    return values


class _Float8Codec:
    def __init__(self, exp_bits: int, mant_bits: int, *, finite_only: bool) -> None:
        self.values = _float8_values(exp_bits, mant_bits, finite_only=finite_only)
        self.finite_only = finite_only
        positive = np.arange(128)
        finite = positive[np.isfinite(self.values[:128])]
        # For the positive half, ascending codes have ascending values.
        self._codes = finite.astype(np.uint8)
        self._magnitudes = self.values[finite]
        self.max_finite = float(self._magnitudes[-1])
        self._nan_code = 0x7F
        self._inf_code = None if finite_only else int(np.flatnonzero(self.values == math.inf)[0])

    def decode(self, bits: np.ndarray) -> np.ndarray:
        return self.values[np.asarray(bits).astype(np.intp)]

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Round to nearest, ties to even code, from float64. Beyond the largest finite value,
        as torch's conversions do: e5m2 rounds to inf from half a spacing above it, e4m3fn
        (which has no inf) saturates at 448."""
        x = np.asarray(x, dtype=np.float64)
        mag = np.abs(x)
        last = len(self._magnitudes) - 1
        hi = np.clip(np.searchsorted(self._magnitudes, mag, side="left"), 0, last)
        lo = np.clip(hi - 1, 0, None)
        d_lo = mag - self._magnitudes[lo]
        d_hi = self._magnitudes[hi] - mag
        pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (self._codes[hi] % 2 == 0))
        code = np.where(pick_hi, self._codes[hi], self._codes[lo]).astype(np.int64)
        half_step = (self._magnitudes[last] - self._magnitudes[last - 1]) / 2
        overflow = mag >= self.max_finite + half_step
        if self.finite_only:
            code = np.where(mag > self.max_finite, self._codes[last], code)
        else:
            code = np.where(overflow, self._inf_code, code)
        code = np.where(np.isnan(x), self._nan_code, code)
        return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


_E4M3FN = _Float8Codec(4, 3, finite_only=True)
_E5M2 = _Float8Codec(5, 2, finite_only=False)


def _bf16_decode(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _bf16_encode(x: np.ndarray) -> np.ndarray:
    """float64 -> bfloat16 bits, correctly rounded (nearest, ties to even) from the float64
    value: rounding through float32 first could round twice."""
    xd = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f32 = xd.astype(np.float32)
        # The two bfloat16 neighbours of the float32 value; pick by the float64 distances.
        u = f32.view(np.uint32).astype(np.uint64)
        lower = u & 0xFFFF0000
        upper = lower + 0x10000
        v_lower = lower.astype(np.uint32).view(np.float32).astype(np.float64)
        v_upper = upper.astype(np.uint32).view(np.float32).astype(np.float64)
        d_lower = np.abs(xd - v_lower)
        d_upper = np.abs(v_upper - xd)
    even_upper = ((upper >> 16) & 1) == 0
    pick_upper = (d_upper < d_lower) | ((d_upper == d_lower) & even_upper)
    bits = (np.where(pick_upper, upper, lower) >> 16).astype(np.uint16)
    bits = np.where(np.isinf(f32), (f32.view(np.uint32) >> 16).astype(np.uint16), bits)
    return np.where(np.isnan(xd), np.uint16(0x7FC0), bits).astype(np.uint16)


# ------------------------------------------------------------------------------------------
# Formats
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NumericFormat:
    """An element type under test, named like torch's dtype (float8_e4m3fn, uint16...).

    kind: "float", "int" or "bool". storage: numpy dtype of the stored bytes (uint16 for
    bfloat16, uint8 for float8). Floats also carry their binary layout (explicit mantissa
    bits, exponent of the smallest normal, largest finite value), enough for ulp().
    """

    name: str
    kind: str
    storage: np.dtype
    mantissa_bits: int = 0
    min_exponent: int = 0
    max_finite: float = 0.0
    _decode: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)
    _encode: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return self.name

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind == "int"

    @property
    def is_bool(self) -> bool:
        return self.kind == "bool"

    @property
    def is_unsigned(self) -> bool:
        return self.kind == "int" and self.storage.kind == "u"

    @property
    def low_precision(self) -> bool:
        """16- and 8-bit floats: the backend accumulates them in float32, rounds once."""
        return self.kind == "float" and self.storage.itemsize <= 2

    @property
    def eps(self) -> float:
        """Spacing of the format just above 1.0 (2**-mantissa_bits)."""
        if not self.is_float:
            raise ValueError(f"eps: {self.name} is not a floating format")
        return 2.0**-self.mantissa_bits

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    def decode(self, stored: np.ndarray) -> np.ndarray:
        """Stored elements -> float64 values (floats); integers and bools are returned as is."""
        stored = np.asarray(stored)
        if self._decode is not None:
            return self._decode(stored)
        if self.is_float:
            return stored.astype(np.float64)
        return stored

    def encode(self, values: Any) -> np.ndarray:
        """Values (float64 for floats) -> stored elements, rounded to nearest even; integer and
        bool values are cast (integers must already be in range or wrapped)."""
        if self._encode is not None:
            return self._encode(np.asarray(values, dtype=np.float64))
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(values).astype(self.storage)


def _float(name: str, storage: Any, mant: int, min_exp: int, max_finite: float, codec=None):
    return NumericFormat(
        name,
        "float",
        np.dtype(storage),
        mant,
        min_exp,
        max_finite,
        codec.decode if isinstance(codec, _Float8Codec) else (codec[0] if codec else None),
        codec.encode if isinstance(codec, _Float8Codec) else (codec[1] if codec else None),
    )


_FORMAT_LIST = [
    _float("float64", np.float64, 52, -1022, float(np.finfo(np.float64).max)),
    _float("float32", np.float32, 23, -126, float(np.finfo(np.float32).max)),
    _float("float16", np.float16, 10, -14, 65504.0),
    _float("bfloat16", np.uint16, 7, -126, (2 - 2.0**-7) * 2.0**127, (_bf16_decode, _bf16_encode)),
    _float("float8_e4m3fn", np.uint8, 3, -6, _E4M3FN.max_finite, _E4M3FN),
    _float("float8_e5m2", np.uint8, 2, -14, _E5M2.max_finite, _E5M2),
    *[
        NumericFormat(np.dtype(t).name, "int", np.dtype(t))
        for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)
    ],
    NumericFormat("bool", "bool", np.dtype(np.bool_)),
]
FORMATS: dict[str, NumericFormat] = {f.name: f for f in _FORMAT_LIST}


def numeric_format(name: str | NumericFormat) -> NumericFormat:
    """The format called `name` ("float32", "bfloat16", "float8_e4m3fn", "uint64", "bool"...)."""
    if isinstance(name, NumericFormat):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"numeric_format: unknown format {name!r}; expected one of {', '.join(FORMATS)}"
        ) from None


def int_limits(fmt: NumericFormat) -> tuple[int, int]:
    """Inclusive [min, max] of an integer format as Python ints."""
    if not fmt.is_int:
        raise ValueError(f"int_limits: {fmt.name} is not an integer format")
    info = np.iinfo(fmt.storage)
    return int(info.min), int(info.max)


# ------------------------------------------------------------------------------------------
# Inputs and poison
# ------------------------------------------------------------------------------------------

POISON_BYTE = 0xA5


def int_value_bound(fmt: NumericFormat, nranks: int) -> tuple[int, int]:
    """Inclusive range for random integers such that SUM and PROD over `nranks` ranks never
    overflow `fmt`: the magnitude b satisfies b**nranks <= max and nranks*b <= max. Signed
    formats also get negatives (which exercise truncation toward zero in integer AVG)."""
    if nranks < 1:
        raise ValueError(f"int_value_bound: nranks must be >= 1, got {nranks}")
    lo, hi = int_limits(fmt)
    # Capped at 2**62 so that the values are drawn exactly as int64.
    bound = min(1 << 62, max(1, int(hi ** (1.0 / nranks))))
    while bound > 1 and (bound**nranks > hi or bound * nranks > hi):
        bound -= 1
    return (0 if lo == 0 else -bound), bound


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)


def random_values(
    fmt: NumericFormat, shape: int | Sequence[int], rng: np.random.Generator, *, nranks: int = 4
) -> np.ndarray:
    """Stored values suited to reductions whose reference must not overflow:

    - floats: uniform in [-1, 1) drawn in float64 and rounded to the format (every element
      exactly representable; sums over a few ranks stay far from float8_e4m3fn's 448);
    - integers: uniform in int_value_bound(fmt, nranks) (SUM/PROD never overflow);
    - bool: fair coin flips.
    """
    shape = _shape(shape)
    if fmt.is_float:
        return fmt.encode(rng.random(shape) * 2.0 - 1.0)
    if fmt.is_bool:
        return rng.integers(0, 2, shape).astype(np.bool_)
    lo, hi = int_value_bound(fmt, nranks)
    return rng.integers(lo, hi, shape, dtype=np.int64, endpoint=True).astype(fmt.storage)


def random_full_range(
    fmt: NumericFormat, shape: int | Sequence[int], rng: np.random.Generator
) -> np.ndarray:
    """Stored values that stress the arithmetic rather than avoid overflow:

    - integers: the whole range (SUM/PROD wrap around, AVG needs more than 64 bits);
    - 16/8-bit floats: magnitudes in [1/8, 4) or exact zero (5%), rounded to the format, so
      that SUM/MIN/MAX over up to 3 ranks are exact in float32 accumulation;
    - float32/float64: uniform in [-4, 4); bool: coin flips.
    """
    shape = _shape(shape)
    if fmt.is_bool:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if fmt.is_int:
        lo, hi = int_limits(fmt)
        return rng.integers(lo, hi, shape, dtype=fmt.storage, endpoint=True)
    if fmt.low_precision:
        mags = rng.uniform(0.125, 4.0, shape) * rng.choice([-1.0, 1.0], shape)
        mags[rng.random(shape) < 0.05] = 0.0
        return fmt.encode(mags)
    return rng.uniform(-4.0, 4.0, shape).astype(fmt.storage)


def poisoned(fmt: NumericFormat, shape: int | Sequence[int]) -> np.ndarray:
    """A stored buffer that no correct write leaves behind: NaN for floats, the byte 0xA5 in
    every byte for integers and bools (0xA5 is not a valid bool byte)."""
    shape = _shape(shape)
    if fmt.is_float:
        return np.full(shape, fmt.encode(np.array([math.nan]))[0], dtype=fmt.storage)
    out = np.empty(shape, dtype=fmt.storage)
    out.reshape(-1).view(np.uint8)[:] = POISON_BYTE
    return out


def poisoned_mask(fmt: NumericFormat, stored: np.ndarray) -> np.ndarray:
    """Elements that still hold the poison (NaN for floats, 0xA5 bytes otherwise)."""
    stored = np.ascontiguousarray(stored)
    if fmt.is_float:
        return np.isnan(fmt.decode(stored))
    raw = stored.reshape(-1).view(np.uint8).reshape(*stored.shape, fmt.itemsize)
    return (raw == POISON_BYTE).all(axis=-1)


# ------------------------------------------------------------------------------------------
# Reduction references
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreMulSum:
    """PREMUL_SUM with its scalar: the result is sum over ranks of factor * x_r."""

    factor: float


def premul_sum(factor: float) -> PreMulSum:
    """The reference-side spelling of PREMUL_SUM, which needs its factor."""
    return PreMulSum(float(factor))


_OP_NAMES = {
    "sum": "sum",
    "prod": "prod",
    "product": "prod",
    "max": "max",
    "min": "min",
    "avg": "avg",
    "band": "band",
    "bor": "bor",
    "bxor": "bxor",
}
BITWISE_OPS = ("band", "bor", "bxor")


def normalize_op(op: Any) -> tuple[str, float | None]:
    """(name, premul factor) for a name ("sum", "PRODUCT"...), an enum-like member with a
    `name` (torch.distributed.ReduceOp.SUM, spyreccl_core.ReduceOp.MAX) or a PreMulSum."""
    if isinstance(op, PreMulSum):
        return "premul_sum", op.factor
    name = op if isinstance(op, str) else getattr(op, "name", None)
    if not isinstance(name, str):
        raise ValueError(
            f"reference_reduce: unsupported op {op!r}; expected a name ('sum', 'prod', 'max', "
            "'min', 'avg', 'band', 'bor', 'bxor'), a ReduceOp member, or premul_sum(factor)"
        )
    name = name.lower()
    if name == "premul_sum":
        raise ValueError(
            "reference_reduce: PREMUL_SUM needs its factor; pass premul_sum(factor) instead of "
            "the bare op"
        )
    try:
        return _OP_NAMES[name], None
    except KeyError:
        raise ValueError(f"reference_reduce: unknown reduction op {op!r}") from None


def valid_ops(fmt: NumericFormat) -> list[str]:
    """Reduce ops spyreccl.h defines for `fmt`: bitwise ops on integers and bool only, no AVG of
    bools, PREMUL_SUM on floats only."""
    ops = ["sum", "prod", "max", "min"]
    if not fmt.is_bool:
        ops.append("avg")
    if not fmt.is_float:
        ops += list(BITWISE_OPS)
    else:
        ops.append("premul_sum")
    return ops


def reduce_reference(inputs: Sequence[np.ndarray], op: Any, fmt: NumericFormat) -> np.ndarray:
    """Element-wise reduction of the per-rank stored `inputs` (arrays of equal shape), computed
    independently of any backend.

    Returns float64 values for floats (exact sum/product in float64, not yet rounded: round
    with fmt.encode or let assert_close do it), and stored values for integers (SUM/PROD wrap
    around, AVG divides the exact sum and truncates toward zero) and bools (SUM/MAX/BOR are
    OR, PROD/MIN/BAND are AND, BXOR is parity).
    """
    if len(inputs) == 0:
        raise ValueError("reference_reduce: expected at least one rank's input, got none")
    shape = np.shape(inputs[0])
    for rank, x in enumerate(inputs):
        if np.shape(x) != shape:
            raise ValueError(
                f"reference_reduce: input of rank {rank} has shape {np.shape(x)}, expected "
                f"{shape} like rank 0"
            )
    name, factor = normalize_op(op)
    if name not in valid_ops(fmt):
        kind = {"float": "floating types", "int": "integer types"}.get(fmt.kind, fmt.kind)
        raise ValueError(
            f"reference_reduce: {name.upper()} is not defined for {kind} (got {fmt.name})"
        )
    if fmt.is_float:
        stack = np.stack([fmt.decode(x).reshape(-1) for x in inputs])
        out = _reduce_float(stack, name, factor)
    elif fmt.is_bool:
        out = _reduce_bool(
            np.stack([np.asarray(x, dtype=np.bool_).reshape(-1) for x in inputs]), name
        )
    else:
        stack = np.stack([np.asarray(x).astype(fmt.storage).reshape(-1) for x in inputs])
        out = _reduce_int(stack, name)
    return np.ascontiguousarray(out).reshape(shape)


def _reduce_float(stack: np.ndarray, name: str, factor: float | None) -> np.ndarray:
    # `initial` keeps max/min defined for empty inputs; NaN inputs still propagate.
    if name == "sum":
        return stack.sum(axis=0)
    if name == "prod":
        return stack.prod(axis=0)
    if name == "max":
        return stack.max(axis=0, initial=-np.inf)
    if name == "min":
        return stack.min(axis=0, initial=np.inf)
    if name == "avg":
        return stack.sum(axis=0) / stack.shape[0]
    return (stack * factor).sum(axis=0)  # premul_sum


def _reduce_bool(stack: np.ndarray, name: str) -> np.ndarray:
    if name in ("sum", "max", "bor"):
        return stack.any(axis=0)
    if name in ("prod", "min", "band"):
        return stack.all(axis=0)
    return np.logical_xor.reduce(stack, axis=0)  # bxor


def _reduce_int(stack: np.ndarray, name: str) -> np.ndarray:
    dtype = stack.dtype
    # numpy integer arrays wrap modulo 2**bits, which is what the C API's SUM/PROD compute.
    with np.errstate(over="ignore"):
        if name == "sum":
            return stack.sum(axis=0, dtype=dtype)
        if name == "prod":
            return stack.prod(axis=0, dtype=dtype)
        if name == "max":
            return stack.max(axis=0) if stack.shape[1] else stack[0]
        if name == "min":
            return stack.min(axis=0) if stack.shape[1] else stack[0]
        if name == "band":
            return np.bitwise_and.reduce(stack, axis=0)
        if name == "bor":
            return np.bitwise_or.reduce(stack, axis=0)
        if name == "bxor":
            return np.bitwise_xor.reduce(stack, axis=0)
        return int_average(stack)


def int_average(stack: np.ndarray) -> np.ndarray:
    """Exact average over axis 0 of an integer array, truncated toward zero (C division), in
    vectorised numpy and without any float rounding, for every width up to (u)int64.

    Each x = n*q + r with q = floor(x / n) and 0 <= r < n, so sum(x) / n = Q + R / n with
    Q = sum(q) and R = sum(r) < n*n. The floor of the average is Q + R // n; it fits the
    type (an average of values of the type), so computing it with wrap-around arithmetic gives
    the exact result even when the intermediate Q wraps. Truncation toward zero then adds one
    to a negative floor whose division was inexact (R % n != 0).
    """
    n = stack.shape[0]
    dtype = stack.dtype
    with np.errstate(over="ignore"):
        q = stack // dtype.type(n)
        r = (stack - q * dtype.type(n)).astype(np.int64)
        floor = q.sum(axis=0, dtype=dtype) + (r.sum(axis=0) // n).astype(dtype)
        if dtype.kind == "u":
            return floor
        inexact = (r.sum(axis=0) % n) != 0
        return floor + ((floor < 0) & inexact).astype(dtype)


# ------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------


# Absolute error per accumulated term of magnitude < 2 in a float32 accumulator (2 * 2**-23).
FLOAT32_ACCUMULATION_ATOL = 2.0**-22


def default_tolerance(fmt: NumericFormat, world_size: int) -> dict[str, float]:
    """The tolerance assert_close uses for `fmt` when reducing over `world_size` ranks.

    - integers and bools: exact;
    - float64 / float32: rtol = atol = c * n (c = 1e-13 / 1e-5): the backend may sum in any
      order; inputs of magnitude ~1 (as random_values draws) make atol cover cancellation;
    - 16- and 8-bit floats: 2 ulps of the output format (the backend accumulates in float32
      and rounds once, the reference rounds once from float64: one rounding step apart, plus
      float32 accumulation error near ties), plus an absolute term FLOAT32_ACCUMULATION_ATOL
      * n = n * 2**-22. The absolute term matters only where the ranks' values cancel: the
      float32 accumulator (or a fused multiply-add contracting `acc + f * x`) then leaves a
      residue of up to one float32 rounding per term of magnitude < 2 (inputs in [-1, 1),
      PREMUL_SUM factors < 2), while the exact result is 0 or tiny and its ulp far smaller
      (bfloat16 keeps float32's exponent range, so such residues survive the final rounding).
      At magnitude ~1 the term is negligible (2**-22 is 1/32768 of a bfloat16 ulp), so the
      2-ulp budget stays as strict as before.
    """
    n = max(1, world_size)
    if not fmt.is_float:
        return {}
    if fmt.name == "float64":
        return {"rtol": 1e-13 * n, "atol": 1e-13 * n}
    if fmt.name == "float32":
        return {"rtol": 1e-5 * n, "atol": 1e-5 * n}
    return {"ulps": 2.0, "atol": n * FLOAT32_ACCUMULATION_ATOL}


def ulp(values: np.ndarray, fmt: NumericFormat) -> np.ndarray:
    """Spacing of `fmt` at each |value| (float64): 2**(exponent - mantissa bits), with the
    exponent clamped to the subnormal range."""
    mag = np.abs(
        np.nan_to_num(
            np.asarray(values, dtype=np.float64),
            nan=0.0,
            posinf=fmt.max_finite,
            neginf=fmt.max_finite,
        )
    )
    _, exp = np.frexp(mag)  # mag = m * 2**exp, m in [0.5, 1): floor(log2 mag) = exp - 1
    exponent = np.maximum(exp - 1, fmt.min_exponent)
    exponent = np.where(mag == 0, fmt.min_exponent, exponent)
    return np.ldexp(1.0, exponent - fmt.mantissa_bits)


def assert_close(
    actual: np.ndarray,
    expected: np.ndarray,
    fmt: NumericFormat,
    world_size: int = 1,
    *,
    seed: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    ulps: float | None = None,
    bound: np.ndarray | None = None,
    what: str = "result",
    max_report: int = 8,
) -> None:
    """Asserts that the stored `actual` matches `expected` within the tolerance of `fmt`.

    `expected`: float64 values (floats; rounded to the format here, once) or stored values.
    Floats pass where |actual - expected| <= atol + rtol*|expected| + ulps*ulp(expected)
    + bound (each term defaults to default_tolerance(fmt, world_size); `bound` is an optional
    per-element array for callers with a derived error bound), or where both are NaN or equal.
    Integers and bools must be equal; a bool byte other than 0/1 is always wrong. Elements
    still holding the poison are reported as never written. The message carries `what`, the
    format, the world size and `seed`, so a failure can be replayed.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    header = f"{what} (dtype={fmt.name}, world_size={world_size}" + (
        f", seed={seed})" if seed is not None else ")"
    )
    if actual.dtype != fmt.storage:
        raise AssertionError(f"{header}: stored as {actual.dtype}, expected {fmt.storage}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{header}: has shape {actual.shape}, expected {expected.shape}")
    if actual.size == 0:
        return
    poison = poisoned_mask(fmt, actual).reshape(-1)
    diff = allowed = None
    if fmt.is_float:
        a = fmt.decode(actual).reshape(-1)
        exp_stored = expected if expected.dtype == fmt.storage else fmt.encode(expected)
        e = fmt.decode(exp_stored).reshape(-1)
        tol = default_tolerance(fmt, world_size)
        r = rtol if rtol is not None else tol.get("rtol", 0.0)
        t = atol if atol is not None else tol.get("atol", 0.0)
        u = ulps if ulps is not None else tol.get("ulps", 0.0)
        with np.errstate(invalid="ignore", over="ignore"):
            allowed = t + r * np.abs(e) + (u * ulp(e, fmt) if u else 0.0)
            if bound is not None:
                allowed = allowed + np.broadcast_to(bound, actual.shape).reshape(-1)
            diff = np.abs(a - e)
            ok = (a == e) | (np.isnan(a) & np.isnan(e)) | (diff <= allowed)
        tol_text = (
            ", ".join(
                part
                for part, on in (
                    (f"rtol={r:g}", r),
                    (f"atol={t:g}", t),
                    (f"{u:g} ulp", u),
                    ("derived bound", bound is not None),
                )
                if on
            )
            or "exact"
        )
        never_written = poison & ~np.isnan(e)  # a NaN where a number belongs: never written
    else:
        a = actual.reshape(-1)
        e = expected.astype(fmt.storage).reshape(-1)
        ok = a == e
        if fmt.is_bool:
            ok &= a.view(np.uint8) <= 1
        tol_text = "exact"
        never_written = poison & ~ok
    bad = np.flatnonzero(~ok)
    if bad.size == 0:
        return
    lines = [f"{header}: {bad.size} of {a.size} elements differ from the reference ({tol_text})"]
    if never_written.any():
        lines.append(
            f"  {int(never_written.sum())} of them still hold the poison value: the output was "
            "never written there"
        )
    for flat in bad[:max_report]:
        index = (
            tuple(int(i) for i in np.unravel_index(int(flat), actual.shape)) if actual.shape else ()
        )
        entry = f"  at {index}: actual={_fmt(a[flat])}, expected={_fmt(e[flat])}"
        if diff is not None:
            entry += f", |diff|={_fmt(diff[flat])}, allowed={_fmt(allowed[flat])}"
        lines.append(entry)
    if bad.size > max_report:
        lines.append(f"  ... and {bad.size - max_report} more")
    raise AssertionError("\n".join(lines))


def assert_bytes_equal(actual: np.ndarray, expected: np.ndarray, what: str = "result") -> None:
    """Bit-exact comparison for data movement (NaN-safe: compares the stored bytes)."""
    actual = np.ascontiguousarray(actual)
    expected = np.ascontiguousarray(expected)
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: {actual.dtype}{list(actual.shape)} differs from the expected "
            f"{expected.dtype}{list(expected.shape)}"
        )
    got = actual.reshape(-1).view(np.uint8).reshape(actual.size, -1) if actual.size else actual
    want = (
        expected.reshape(-1).view(np.uint8).reshape(expected.size, -1)
        if expected.size
        else expected
    )
    if actual.size == 0:
        return
    bad = np.flatnonzero((got != want).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.size} of {actual.size} elements differ bytewise; first at flat index "
            f"{i}: got {actual.reshape(-1)[i]!r}, expected {expected.reshape(-1)[i]!r}"
        )


def _fmt(value: Any) -> str:
    if isinstance(value, float | np.floating):
        return f"{float(value):.9g}" if math.isfinite(float(value)) else str(float(value))
    return str(value)
