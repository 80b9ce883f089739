"""Automatic mixed precision on the emulated spyre device (part of ``torch.spyre``).

``torch.autocast("spyre", ...)`` asks the device module for the dtypes autocast may use
(``get_amp_supported_dtype``); the casting itself happens in the ``AutocastPrivateUse1``
kernels of the ``_device`` library (src/device/autocast.cc), whose operator lists follow
CPU's, because every spyre operator runs its CPU kernel.

The other functions are the per-device autocast accessors that torch's PrivateUse1 guide
asks a device module to provide; they forward to torch's device-generic API. Autocast
state is thread-local, like every device's. With no dtype given, autocast on spyre uses
torch's default for PrivateUse1 devices, ``torch.float16``.
"""

from __future__ import annotations

import torch

__all__ = [
    "get_amp_supported_dtype",
    "get_autocast_dtype",
    "is_autocast_enabled",
    "set_autocast_dtype",
    "set_autocast_enabled",
]

_DEVICE = "spyre"


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The lower-precision dtypes autocast may cast to: CPU kernels, which execute every
    spyre operator, support both half types."""
    return [torch.float16, torch.bfloat16]


def is_autocast_enabled() -> bool:
    """Whether autocast is enabled for spyre on the calling thread."""
    return torch.is_autocast_enabled(_DEVICE)


def set_autocast_enabled(enabled: bool) -> None:
    """Enables or disables autocast for spyre on the calling thread (prefer the
    ``torch.autocast("spyre")`` context manager, which also manages the cast cache)."""
    torch.set_autocast_enabled(_DEVICE, enabled)


def get_autocast_dtype() -> torch.dtype:
    """The dtype that autocast casts to on spyre (calling thread)."""
    return torch.get_autocast_dtype(_DEVICE)


def set_autocast_dtype(dtype: torch.dtype) -> None:
    """Sets the dtype autocast casts to on spyre (calling thread); it must be one of
    :func:`get_amp_supported_dtype`."""
    if dtype not in get_amp_supported_dtype():
        raise ValueError(f"spyre autocast supports {get_amp_supported_dtype()}, got {dtype}")
    torch.set_autocast_dtype(_DEVICE, dtype)
