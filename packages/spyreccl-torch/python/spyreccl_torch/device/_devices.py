"""Device indices of ``torch.spyre``: the count, the current device, argument parsing.

The lowest layer of the device module: ``spyre_module``, ``_memory`` and ``_random`` all
resolve their ``device`` arguments here, and this module imports none of them.

The count and the current device are read through torch's accelerator API, which asks the
spyre hooks and device guard in C++ directly, as ``torch.cuda`` asks its runtime: no torch
operator is dispatched, so an active dispatch mode (``FakeTensorMode``, ``LocalTensorMode``,
a logging mode) never sees these calls and ``torch.compile`` does not trace them as
operators.
"""

from __future__ import annotations

import torch

from ._local_rank import _lazy_init

_DeviceLike = int | str | torch.device | None

_device_count: int | None = None


def device_count() -> int:
    """Number of emulated devices (``SPYRECCL_SPYRE_DEVICE_COUNT``, default 8)."""
    # Fixed for the life of the process (the C++ side reads the variable once), so one
    # query is enough; device validation runs on hot paths such as synchronize().
    global _device_count
    if _device_count is None:
        _device_count = int(torch._C._accelerator_hooks_device_count())
    return _device_count


def current_device() -> int:
    """Index of the calling thread's current spyre device (``LOCAL_RANK``'s until the
    thread selects one)."""
    _lazy_init()
    return int(torch._C._accelerator_getDeviceIndex())


def _device_index(device: _DeviceLike, *, optional: bool = True) -> int:
    """Index of ``device`` (int, "spyre[:i]", torch.device). ``None`` or an index-less
    spyre device means the current device when ``optional`` is true."""
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "spyre":
            raise ValueError(f"expected a spyre device, got {device}")
        device = device.index
    if device is None:
        if not optional:
            raise ValueError("expected a spyre device index, got None")
        return current_device()
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"expected a spyre device (int, str or torch.device), got {device!r}")
    if device < 0:
        if optional and device == -1:
            return current_device()
        raise ValueError(f"invalid spyre device index {device}")
    if device >= device_count():
        raise ValueError(
            f"invalid spyre device index {device}: only {device_count()} emulated devices "
            "(set SPYRECCL_SPYRE_DEVICE_COUNT to change)"
        )
    return device
