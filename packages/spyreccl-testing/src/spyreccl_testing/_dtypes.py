"""torch dtype <-> numerics.NumericFormat, and tensor <-> stored numpy buffer.

The facts about each format (bit layout, integer range, codecs) live in `numerics`, once, for
the torch-free and the torch tests alike; this module only names torch's dtypes there. It
imports torch and is therefore only used by `inputs` and `accuracy`.
"""

from __future__ import annotations

import numpy as np
import torch

from spyreccl_testing.numerics import NumericFormat, numeric_format

# Types whose reductions the backend accumulates in float32 and rounds once at the end.
LOW_PRECISION_FLOATS = frozenset(
    {torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
)
FLOAT8_TYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

# Same-width torch dtype holding the stored bits of types numpy has no dtype for.
_BIT_CARRIERS = {
    torch.bfloat16: torch.uint16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}


def format_of(dtype: torch.dtype, what: str = "format_of") -> NumericFormat:
    """The numerics format of a torch dtype; ValueError naming `what` if unsupported."""
    name = str(dtype).removeprefix("torch.")
    try:
        return numeric_format(name)
    except ValueError:
        raise ValueError(
            f"{what}: unsupported dtype {dtype}; expected a float (64/32/16, bfloat16, float8), "
            "an integer or bool type"
        ) from None


def check_supported(dtype: torch.dtype, what: str) -> None:
    format_of(dtype, what)


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype in _SUPPORTED


def is_bool(dtype: torch.dtype) -> bool:
    return dtype == torch.bool


def is_int(dtype: torch.dtype) -> bool:
    return dtype in _SUPPORTED and not dtype.is_floating_point and dtype != torch.bool


def to_stored(tensor: torch.Tensor) -> np.ndarray:
    """A CPU copy of `tensor` as its stored numpy buffer (bfloat16 -> uint16 bits...)."""
    cpu = tensor.detach().to("cpu").contiguous()
    carrier = _BIT_CARRIERS.get(cpu.dtype)
    if carrier is not None:
        # view() cannot reinterpret a 0-d tensor; go through a flat one.
        return cpu.reshape(-1).view(carrier).numpy().reshape(tuple(cpu.shape)).copy()
    return cpu.numpy().copy()


def from_stored(stored: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The CPU tensor of `dtype` whose bytes are `stored` (the inverse of to_stored)."""
    array = np.asarray(stored)  # not ascontiguousarray: that turns 0-d arrays into 1-d ones
    shape = tuple(array.shape)
    flat = torch.from_numpy(array.reshape(-1).copy())
    # A fresh tensor rather than the numpy-backed one: numpy gives empty arrays stride 0,
    # which torch keeps and which breaks dtype views (e.g. bytes) of the result.
    tensor = torch.empty(flat.shape, dtype=flat.dtype)
    if flat.numel():
        tensor.copy_(flat)
    if dtype in _BIT_CARRIERS:
        tensor = tensor.view(dtype)
    return tensor.to(dtype).reshape(shape)


_SUPPORTED = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.uint16,
        torch.int32,
        torch.uint32,
        torch.int64,
        torch.uint64,
        torch.bool,
    }
)
