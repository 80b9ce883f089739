"""Element types under test and their independent numpy models.

bfloat16 and float8 have no numpy dtype: the tests store them as uint16/uint8 bit patterns
and convert with the bit-level codecs below (written from the format definitions, not from
the library), so the references do not depend on ml_dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spyreccl_core import DataType

# --------------------------------------------------------------------------------------
# Codecs for formats numpy lacks
# --------------------------------------------------------------------------------------


def _float8_table(exp_bits: int, mant_bits: int, *, fn: bool) -> np.ndarray:
    """Value of each of the 256 codes of a sign/exponent/mantissa float8 format.

    fn=True is the "finite" variant (e4m3fn): no infinities, only all-ones is NaN.
    """
    bias = (1 << (exp_bits - 1)) - 1
    max_exp = (1 << exp_bits) - 1
    values = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> mant_bits) & max_exp
        mant = code & ((1 << mant_bits) - 1)
        if exp == max_exp and not fn:
            values[code] = sign * np.inf if mant == 0 else np.nan
        elif fn and exp == max_exp and mant == (1 << mant_bits) - 1:
            values[code] = np.nan
        elif exp == 0:
            values[code] = sign * mant * 2.0 ** (1 - bias - mant_bits)
        else:
            values[code] = sign * (1 + mant / (1 << mant_bits)) * 2.0 ** (exp - bias)
    return values


class _Float8Codec:
    def __init__(self, exp_bits: int, mant_bits: int, *, fn: bool) -> None:
        self.table = _float8_table(exp_bits, mant_bits, fn=fn)
        positive = np.arange(128)
        finite = positive[np.isfinite(self.table[:128])]
        self._codes = finite  # ascending codes == ascending values for the positive half
        self._values = self.table[finite]
        self.max = float(self._values[-1])

    def decode(self, bits: np.ndarray) -> np.ndarray:
        return self.table[bits.astype(np.intp)]

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Round-to-nearest-even from float64; inputs must be finite and within +-max."""
        x = np.asarray(x, dtype=np.float64)
        mag = np.abs(x)
        assert np.all(mag <= self.max), "test inputs must stay inside the float8 range"
        hi = np.clip(np.searchsorted(self._values, mag, side="left"), 0, len(self._values) - 1)
        lo = np.clip(hi - 1, 0, None)
        d_lo = mag - self._values[lo]
        d_hi = self._values[hi] - mag
        pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (self._codes[hi] % 2 == 0))
        code = np.where(pick_hi, self._codes[hi], self._codes[lo])
        return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


E4M3 = _Float8Codec(4, 3, fn=True)
E5M2 = _Float8Codec(5, 2, fn=False)


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_encode(x: np.ndarray) -> np.ndarray:
    """float64 -> bfloat16 bits with round-to-nearest-even (via exact float32 when possible)."""
    f32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    # float64 -> float32 may round; redo the rounding from the float64 residual so that the
    # result is the correctly rounded bfloat16 of the float64 value.
    u = f32.view(np.uint32).astype(np.uint64)
    lower = u & 0xFFFF0000
    upper = lower + 0x10000
    v_lower = (lower.astype(np.uint32)).view(np.float32).astype(np.float64)
    v_upper = (upper.astype(np.uint32)).view(np.float32).astype(np.float64)
    xd = np.asarray(x, dtype=np.float64)
    d_lower = np.abs(xd - v_lower)
    d_upper = np.abs(v_upper - xd)
    even_upper = ((upper >> 16) & 1) == 0
    pick_upper = (d_upper < d_lower) | ((d_upper == d_lower) & even_upper)
    return (np.where(pick_upper, upper, lower) >> 16).astype(np.uint16)


# --------------------------------------------------------------------------------------
# Type descriptions
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TType:
    name: str
    storage: np.dtype  # numpy dtype of the buffers handed to spyreccl
    override: DataType | None  # dtype= passed to spyreccl (None: inferred from the buffer)
    kind: str  # "float", "lowp" (16/8-bit float via float32 accumulation), "int", "bool"
    mant_bits: int = 0  # explicit mantissa bits of float formats

    def __repr__(self) -> str:
        return self.name

    @property
    def kwargs(self) -> dict:
        return {} if self.override is None else {"dtype": self.override}

    def decode(self, a: np.ndarray) -> np.ndarray:
        """Stored elements -> float64 (floats) or the array itself (ints, bools)."""
        if self.name == "bfloat16":
            return bf16_decode(a)
        if self.name == "float8_e4m3":
            return E4M3.decode(a)
        if self.name == "float8_e5m2":
            return E5M2.decode(a)
        if self.kind in ("float", "lowp"):
            return a.astype(np.float64)
        return a

    def encode(self, x: np.ndarray) -> np.ndarray:
        """float64 values -> stored elements, rounding to nearest even."""
        if self.name == "bfloat16":
            return bf16_encode(x)
        if self.name == "float8_e4m3":
            return E4M3.encode(x)
        if self.name == "float8_e5m2":
            return E5M2.encode(x)
        return np.asarray(x).astype(self.storage)

    def random(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Fresh inputs whose reductions over <= 3 ranks are exact in float32 accumulation
        (low-precision floats) and stay inside every format's range."""
        if self.kind == "bool":
            return rng.integers(0, 2, n).astype(np.bool_)
        if self.kind == "int":
            info = np.iinfo(self.storage)
            return rng.integers(info.min, info.max, n, dtype=self.storage, endpoint=True)
        if self.kind == "lowp":
            # Magnitudes in [1/8, 4) or exact zero, on the format's own grid.
            mags = rng.uniform(0.125, 4.0, n) * rng.choice([-1.0, 1.0], n)
            mags[rng.random(n) < 0.05] = 0.0
            return self.encode(mags)
        return rng.uniform(-4.0, 4.0, n).astype(self.storage)

    def poison(self, n: int) -> np.ndarray:
        """An output buffer filled with a pattern that no correct result leaves behind."""
        if self.kind == "float":
            return np.full(n, np.nan, dtype=self.storage)
        out = np.empty(n, dtype=self.storage)
        out.view(np.uint8)[:] = 0xA5
        return out


FLOATS = [
    TType("float32", np.dtype(np.float32), None, "float", 23),
    TType("float64", np.dtype(np.float64), None, "float", 52),
]
LOWP = [
    TType("float16", np.dtype(np.float16), None, "lowp", 10),
    TType("bfloat16", np.dtype(np.uint16), DataType.BFLOAT16, "lowp", 7),
    TType("float8_e4m3", np.dtype(np.uint8), DataType.FLOAT8_E4M3, "lowp", 3),
    TType("float8_e5m2", np.dtype(np.uint8), DataType.FLOAT8_E5M2, "lowp", 2),
]
INTS = [
    TType(np.dtype(t).name, np.dtype(t), None, "int")
    for t in (np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64)
]
BOOL = TType("bool", np.dtype(np.bool_), None, "bool")
ALL_TYPES = FLOATS + LOWP + INTS + [BOOL]
TYPES_BY_NAME = {t.name: t for t in ALL_TYPES}
