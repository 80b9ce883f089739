"""The emulated device's memory model, chosen by ``SPYRECCL_SPYRE_MEMORY``.

``host`` (default): a spyre tensor's ``data_ptr()`` is host memory, readable by anyone.
``discrete``: as on real Spyre cards, ``data_ptr()`` is a device address that only the
device's own kernels and copies can use; reading it from the host faults (SIGSEGV). The
device's code reaches the memory through a second, accessible mapping of the same pages
(``src/device/device_memory.h``), so nothing is copied. Code that must run on real cards
moves spyre data with ``copy_`` (to a pinned CPU tensor, say) and asks :func:`memory_mode`
rather than guessing from pointers.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

MEMORY_ENV = "SPYRECCL_SPYRE_MEMORY"
MEMORY_MODES = ("host", "discrete")


def check_env() -> None:
    """Warns once about a value of ``SPYRECCL_SPYRE_MEMORY`` that names no mode (the device
    then uses host memory). Never raises: it runs inside ``import torch``."""
    raw = os.environ.get(MEMORY_ENV)
    if raw is None:
        return
    value = "".join(raw.split()).lower()
    if value and value not in MEMORY_MODES:
        warnings.warn(
            f"{MEMORY_ENV}={raw!r} is not one of {', '.join(MEMORY_MODES)}: the emulated spyre "
            "device uses host memory",
            RuntimeWarning,
            stacklevel=2,
        )


@functools.cache
def memory_mode() -> str:
    """``"host"`` or ``"discrete"``: the memory model of the emulated spyre device in this
    process (read once from ``SPYRECCL_SPYRE_MEMORY``). In discrete mode the first call sets
    up the device memory and raises if the system refuses it."""
    return str(torch.ops.spyreccl_device.memory_mode())


def install_inductor_translation() -> None:
    """In discrete mode, gives inductor's Python bindings of C++ kernels host addresses.

    The bindings (``CppPythonBindingsCodeCache``) convert every tensor argument to a pointer
    through one function of torch, whose address they read from
    ``torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr`` when they are loaded.
    Replaced by the device's function that translates torch's pointer (the identity for
    anything but discrete device memory), every C++ kernel on spyre tensors reads and writes
    the accessible mapping, and CPU tensors are unaffected. Nothing is done in host mode."""
    if memory_mode() != "discrete":
        return
    guards = torch._C._dynamo.guards
    name = "_torchinductor_pyobject_tensor_data_ptr"
    current = getattr(guards, name, None)
    if not isinstance(current, int) or current == 0:
        warnings.warn(
            f"{MEMORY_ENV}=discrete: torch has no {name}; inductor's C++ kernels cannot be "
            "given host addresses of spyre memory (compiled spyre graphs will fault)",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    setattr(guards, name, int(torch.ops.spyreccl_device.translating_tensor_data_ptr(current)))
