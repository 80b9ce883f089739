"""Reproducible random inputs and output poisoning.

Every test draws *fresh* inputs (a seed from os.urandom) so that repeated CI runs explore new
values, and reports that seed in its failure messages so a failure can be replayed exactly:
pass the printed seed back to `random_tensor` (or set SPYRECCL_TEST_SEED to pin every fresh seed).

Outputs are poisoned before a collective writes them so that an element the backend forgot to
write can never pass as correct: floats hold NaN, integers and bools hold the byte 0xA5 in every
byte (a bool byte of 0xA5 is not a valid 0/1 value, so it is detectable too).
"""

from __future__ import annotations

import os

import torch

from spyreccl_testing import _dtypes

POISON_BYTE = 0xA5

_SEED_ENV = "SPYRECCL_TEST_SEED"


def fresh_seed() -> int:
    """A new 63-bit seed from os.urandom, or SPYRECCL_TEST_SEED when set (to replay a failure)."""
    pinned = os.environ.get(_SEED_ENV)
    if pinned:
        try:
            return int(pinned, 0)
        except ValueError:
            raise ValueError(
                f"{_SEED_ENV}={pinned!r} is not an integer; expected the seed printed by a failure"
            ) from None
    return int.from_bytes(os.urandom(8), "little") >> 1


def rank_seed(seed: int, rank: int) -> int:
    """Derives the seed rank `rank` uses from a test's base seed (distinct, reproducible)."""
    if rank < 0:
        raise ValueError(f"rank_seed: rank must be >= 0, got {rank}")
    # A large odd multiplier spreads consecutive ranks over the 63-bit space so that rank r of
    # seed s never collides with rank r+1 of seed s-1.
    return (seed + (rank + 1) * 0x9E3779B97F4A7C15) % (1 << 63)


def int_value_bound(dtype: torch.dtype, nranks: int) -> tuple[int, int]:
    """Inclusive range for random integers such that SUM and PROD over `nranks` ranks never
    overflow `dtype`.

    The magnitude b satisfies b**nranks <= max and nranks*b <= max, so reference results are
    exact without relying on wrap-around; signed types also draw negatives (this exercises
    truncation toward zero in integer AVG).
    """
    if nranks < 1:
        raise ValueError(f"int_value_bound: nranks must be >= 1, got {nranks}")
    lo, hi = _dtypes.int_limits(dtype)
    # Capped at 2**62 so that values are drawn exactly in int64 (torch.randint's range).
    bound = min(1 << 62, max(1, int(hi ** (1.0 / nranks))))
    while bound > 1 and (bound**nranks > hi or bound * nranks > hi):
        bound -= 1
    return (0 if lo == 0 else -bound), bound


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
    _dtypes.check_supported(dtype, "random_tensor")
    if isinstance(shape, int):
        shape = (shape,)
    if seed is None:
        seed = fresh_seed()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    if _dtypes.is_float(dtype):
        values = torch.rand(shape, generator=gen, dtype=torch.float64) * 2.0 - 1.0
        cpu = values.to(dtype)
    elif _dtypes.is_bool(dtype):
        cpu = torch.randint(0, 2, shape, generator=gen, dtype=torch.int64).to(torch.bool)
    else:
        lo, hi = int_value_bound(dtype, nranks)
        # Drawn as int64 (randint lacks the unsigned 16/32/64-bit types); every bound fits.
        cpu = torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64).to(dtype)
    return cpu.to(device)


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
    bits = _dtypes.int_bits(dtype)
    raw = int.from_bytes(bytes([POISON_BYTE]) * (bits // 8), "little")
    if not _dtypes.is_unsigned(dtype) and raw >= 1 << (bits - 1):
        raw -= 1 << bits
    return raw


def poisoned_mask(tensor: torch.Tensor) -> torch.Tensor:
    """Boolean CPU tensor marking the elements that still hold the poison (NaN for floats,
    0xA5 in every byte for integers and bools)."""
    cpu = tensor.detach().to("cpu")
    if _dtypes.is_float(cpu.dtype):
        return torch.isnan(cpu.to(torch.float32))
    # Byte-wise comparison: exact for every integer width, unsigned 64-bit included, without
    # any signed/unsigned conversion.
    raw = _byte_view(cpu.contiguous()).reshape(*cpu.shape, cpu.dtype.itemsize)
    return (raw == POISON_BYTE).all(dim=-1)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(
            "poison_: expected a contiguous tensor (the poison is written byte-wise), got "
            f"strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}"
        )
    # Flattened first: viewing a 0-d tensor as a narrower dtype is not allowed.
    return tensor.reshape(-1).view(torch.uint8)
