"""Locating and loading the ``_device`` shared library."""

from __future__ import annotations

import os
from pathlib import Path

import torch

LIBRARY_ENV = "SPYRECCL_DEVICE_LIB"
DEVICE_COUNT_ENV = "SPYRECCL_SPYRE_DEVICE_COUNT"
# torch.DeviceIndex is an int8 in C++.
_MAX_DEVICE_COUNT = 127


def library_path() -> Path:
    """Path of the ``_device`` library: ``$SPYRECCL_DEVICE_LIB`` if set (development
    builds), else ``_device*.so`` installed next to the ``spyreccl_torch`` package."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"{LIBRARY_ENV}={override!r} does not name a file")
        return path
    # Not resolve(): the library sits next to the package as imported, even when the
    # package directory is assembled from symlinks (editable and development layouts).
    package_dir = Path(__file__).absolute().parent.parent
    candidates = sorted(package_dir.glob("_device*.so"))
    if not candidates:
        raise FileNotFoundError(
            f"spyreccl_torch: the emulated spyre device library _device*.so is not in "
            f"{package_dir}; reinstall spyreccl-torch or point {LIBRARY_ENV} at a build"
        )
    return candidates[0]


def validate_device_count_env() -> None:
    """Rejects a malformed ``SPYRECCL_SPYRE_DEVICE_COUNT`` before the C++ side reads it."""
    text = os.environ.get(DEVICE_COUNT_ENV)
    if text is None or text == "":
        return
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= _MAX_DEVICE_COUNT:
        raise ValueError(
            f"{DEVICE_COUNT_ENV}={text!r}: expected an integer in [1, {_MAX_DEVICE_COUNT}]"
        )


def load() -> Path:
    """Loads the library once; its static initialisers register the spyre allocator,
    device guard, PrivateUse1 hooks, kernels and ``torch.ops.spyreccl_device``."""
    validate_device_count_env()
    path = library_path()
    # load_library is idempotent per path (dlopen returns the same handle).
    torch.ops.load_library(str(path))
    # Now that all of the library's kernels are registered: operators that CPU runs with
    # its own kernel run that kernel on spyre too, not a composite (idempotent).
    torch.ops.spyreccl_device.route_to_cpu_kernels()
    return path
