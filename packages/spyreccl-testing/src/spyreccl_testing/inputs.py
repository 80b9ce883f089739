"""Reproducible random inputs and output poisoning.

Every test draws *fresh* inputs (a seed from os.urandom) so that repeated CI runs explore new
values, and reports that seed in its failure messages so a failure can be replayed exactly:
pass the printed seed back to `random_tensor` (or set SPYRECCL_TEST_SEED to pin every fresh seed).

Outputs are poisoned before a collective writes them so that an element the backend forgot to
write can never pass as correct: floats hold NaN, integers and bools hold the byte 0xA5 in every
byte (a bool byte of 0xA5 is not a valid 0/1 value, so it is detectable too).
"""

from __future__ import annotations

import numpy as np
import torch

from spyreccl_testing import _dtypes, numerics
from spyreccl_testing.numerics import POISON_BYTE
from spyreccl_testing.seeds import fresh_seed, rank_seed

__all__ = [
    "POISON_BYTE",
    "fresh_seed",
    "int_value_bound",
    "poison_",
    "poison_value",
    "poisoned_mask",
    "random_tensor",
    "rank_seed",
]


def int_value_bound(dtype: torch.dtype, nranks: int) -> tuple[int, int]:
    """Inclusive range for random integers such that SUM and PROD over `nranks` ranks never
    overflow `dtype` (see numerics.int_value_bound)."""
    return numerics.int_value_bound(_dtypes.format_of(dtype, "int_value_bound"), nranks)


def random_tensor(
    shape: int | tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int | None = None,
    *,
    nranks: int = 4,
) -> torch.Tensor:
    """A tensor of `shape` and `dtype` filled with values suited to reduction tests.

    - floating types: uniform in [-1, 1) drawn in float64 and rounded to `dtype`, so every
      element is exactly representable and sums over a few ranks stay far from overflow
      (float8_e4m3fn tops out at 448);
    - integers: uniform in `int_value_bound(dtype, nranks)` (no overflow for SUM/PROD);
    - bool: fair coin flips.

    `seed` None draws a fresh one; the same (shape, dtype, seed, nranks) always gives the same
    values on every machine (the values are drawn on the CPU and then copied to `device`).
    """
    fmt = _dtypes.format_of(dtype, "random_tensor")
    if isinstance(shape, int):
        shape = (shape,)
    if seed is None:
        seed = fresh_seed()
    values = numerics.random_values(fmt, tuple(shape), np.random.default_rng(seed), nranks=nranks)
    return _dtypes.from_stored(values, dtype).to(device)


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Overwrites `tensor` in place with a recognisable invalid value and returns it.

    Floats (float8 included) become NaN; integer and bool tensors get 0xA5 in every byte.
    """
    _dtypes.check_supported(tensor.dtype, "poison_")
    if tensor.numel() == 0:
        return tensor
    if _dtypes.is_float(tensor.dtype):
        tensor.fill_(float("nan"))
    else:
        # Byte-level fill: works for every width and leaves bools in a state (0xA5) that no
        # correct write can produce.
        _byte_view(tensor).fill_(POISON_BYTE)
    return tensor


def poison_value(dtype: torch.dtype) -> float | int | None:
    """The value an element of `dtype` holds after poison_ (None for bool, whose poison is a
    byte pattern, and NaN for floats)."""
    if _dtypes.is_float(dtype):
        return float("nan")
    if _dtypes.is_bool(dtype):
        return None
    fmt = _dtypes.format_of(dtype, "poison_value")
    bits = fmt.itemsize * 8
    raw = int.from_bytes(bytes([POISON_BYTE]) * (bits // 8), "little")
    if not fmt.is_unsigned and raw >= 1 << (bits - 1):
        raw -= 1 << bits
    return raw


def poisoned_mask(tensor: torch.Tensor) -> torch.Tensor:
    """Boolean CPU tensor marking the elements that still hold the poison (NaN for floats,
    0xA5 in every byte for integers and bools)."""
    fmt = _dtypes.format_of(tensor.dtype, "poisoned_mask")
    return torch.from_numpy(numerics.poisoned_mask(fmt, _dtypes.to_stored(tensor)))


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(
            "poison_: expected a contiguous tensor (the poison is written byte-wise), got "
            f"strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}"
        )
    # Flattened first: viewing a 0-d tensor as a narrower dtype is not allowed.
    return tensor.reshape(-1).view(torch.uint8)
