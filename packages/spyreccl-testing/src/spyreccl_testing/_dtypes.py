"""Facts about torch dtypes that the input generators and tolerance checks share.

Kept in one place so that `inputs` (which draws values) and `accuracy` (which judges results)
can never disagree about, say, how many mantissa bits bfloat16 has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """Binary layout of a floating type, enough to compute its ulp at any magnitude."""

    mantissa_bits: int  # explicit fraction bits (float32: 23)
    min_exponent: int  # exponent of the smallest normal number (float32: -126)
    max_finite: float


_FLOAT_FORMATS: dict[torch.dtype, FloatFormat] = {
    torch.float64: FloatFormat(52, -1022, torch.finfo(torch.float64).max),
    torch.float32: FloatFormat(23, -126, torch.finfo(torch.float32).max),
    torch.float16: FloatFormat(10, -14, 65504.0),
    torch.bfloat16: FloatFormat(7, -126, torch.finfo(torch.bfloat16).max),
    torch.float8_e4m3fn: FloatFormat(3, -6, 448.0),
    torch.float8_e5m2: FloatFormat(2, -14, 57344.0),
}

# Types whose reductions the backend accumulates in float32 and rounds once at the end.
LOW_PRECISION_FLOATS = frozenset(
    {torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
)
FLOAT8_TYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

_UNSIGNED = frozenset({torch.uint8, torch.uint16, torch.uint32, torch.uint64})
_SIGNED = frozenset({torch.int8, torch.int16, torch.int32, torch.int64})


def is_float(dtype: torch.dtype) -> bool:
    return dtype in _FLOAT_FORMATS


def is_int(dtype: torch.dtype) -> bool:
    return dtype in _SIGNED or dtype in _UNSIGNED


def is_unsigned(dtype: torch.dtype) -> bool:
    return dtype in _UNSIGNED


def is_bool(dtype: torch.dtype) -> bool:
    return dtype == torch.bool


def float_format(dtype: torch.dtype) -> FloatFormat:
    try:
        return _FLOAT_FORMATS[dtype]
    except KeyError:
        raise ValueError(f"float_format: {dtype} is not a supported floating type") from None


def int_bits(dtype: torch.dtype) -> int:
    if not is_int(dtype):
        raise ValueError(f"int_bits: {dtype} is not an integer type")
    return dtype.itemsize * 8


def int_limits(dtype: torch.dtype) -> tuple[int, int]:
    """Inclusive [min, max] of an integer dtype as Python ints (torch.iinfo lacks uint32/64)."""
    bits = int_bits(dtype)
    if is_unsigned(dtype):
        return 0, (1 << bits) - 1
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def check_supported(dtype: torch.dtype, what: str) -> None:
    if not (is_float(dtype) or is_int(dtype) or is_bool(dtype)):
        raise ValueError(
            f"{what}: unsupported dtype {dtype}; expected a float (64/32/16, bfloat16, float8), "
            "an integer or bool type"
        )
