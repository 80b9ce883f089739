"""The host-emulated ``spyre`` device (torch PrivateUse1).

:func:`register` makes ``torch.device("spyre")`` usable on machines without Spyre cards:
tensors live in host memory (64-byte aligned, directly readable by spyreccl-core), every
operator runs its CPU kernel in place on that memory, and ``torch.spyre`` provides the
device module torch expects (device management, random state, inductor hooks).

The emulation steps aside whenever a real spyre device may be present: when
``torch_spyre`` is installed, when PrivateUse1 is already claimed, or when
``SPYRECCL_EMULATE_SPYRE=0``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEVICE_NAME",
    "EMULATE_ENV",
    "MEMORY_ENV",
    "host_view",
    "is_registered",
    "memory_mode",
    "register",
]

DEVICE_NAME = "spyre"
EMULATE_ENV = "SPYRECCL_EMULATE_SPYRE"
# Selects the emulated device's memory model: "host" (default) or "discrete" (see memory_mode).
MEMORY_ENV = "SPYRECCL_SPYRE_MEMORY"

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_active: bool | None = None
# Set once this process has loaded the _device library (its registrations are permanent).
_loaded_library: Path | None = None


def _torch_spyre_installed() -> bool:
    if importlib.util.find_spec("torch_spyre") is not None:
        return True
    # A distribution without an importable top-level module (e.g. only C++ parts) still
    # means a real runtime is meant to own the device. Names are normalised, so one
    # spelling covers torch-spyre and torch_spyre.
    try:
        importlib.metadata.distribution("torch-spyre")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _reason_to_step_aside() -> str | None:
    """Why the emulated device must not register, or None if it may."""
    if os.environ.get(EMULATE_ENV, "1").strip() == "0":
        return f"{EMULATE_ENV}=0"
    if _torch_spyre_installed():
        return "torch_spyre is installed and provides the real spyre device"

    import torch

    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", DEVICE_NAME):
        return f"PrivateUse1 is already renamed to {current!r}"
    if hasattr(torch, DEVICE_NAME) or "torch.spyre" in sys.modules:
        return "torch.spyre is already registered by another module"
    if _loaded_library is not None:
        # A previous attempt loaded our library (and maybe renamed PrivateUse1) and then
        # failed: what PrivateUse1 holds now is ours, so finish the registration.
        return None
    if current == DEVICE_NAME:
        return "PrivateUse1 is already renamed to 'spyre' by another module"
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::empty.memory_format", "PrivateUse1"):
        return "another library already registered PrivateUse1 kernels"
    return None


def _registered_by_us() -> bool:
    """True if this process already registered our torch.spyre (e.g. before a reload
    of this package reset the module state)."""
    torch = sys.modules.get("torch")
    module = getattr(torch, DEVICE_NAME, None) if torch is not None else None
    return getattr(module, "__name__", None) == f"{__name__}.spyre_module"


def _register_locked() -> bool:
    if _registered_by_us():
        return True
    reason = _reason_to_step_aside()
    if reason is not None:
        _log.debug("spyreccl_torch.device: not registering the emulated spyre device: %s", reason)
        return False

    import torch
    import torch.utils.backend_registration as backend_registration

    from . import _loader, _memory_mode, spyre_module

    global _loaded_library
    # Hooks must exist before the rename, or torch._C._get_accelerator() raises.
    path = _loaded_library = _loader.load()
    # The memory model (SPYRECCL_SPYRE_MEMORY): a value naming no mode warns and means host
    # memory; discrete memory the system refuses fails the registration here, by name.
    _memory_mode.check_env()
    _memory_mode.memory_mode()
    torch.utils.rename_privateuse1_backend(DEVICE_NAME)
    torch._register_device_module(DEVICE_NAME, spyre_module)
    # generate_methods_for_privateuse1_backend raises when run twice.
    if not hasattr(torch.Tensor, "is_spyre"):
        backend_registration.generate_methods_for_privateuse1_backend(for_storage=True)
    spyre_module._install_integrations()
    _declare_host_addressable()
    _log.debug("spyreccl_torch.device: emulated spyre device registered from %s", path)
    return True


def _declare_host_addressable() -> None:
    """Tells the spyreccl backend whether spyre memory is host memory it may use in place:
    yes in the ``host`` memory mode, no in ``discrete`` mode (see _memory_mode). Without this
    declaration the backend treats spyre memory as not host-addressable, as it must for a real
    runtime's. Also that its copies to and from the host are memcpys on the host's CPUs (no
    DMA engine), which decides where the staged pipeline pays (the backend's staging.h)."""
    from .. import _C
    from ._memory_mode import memory_mode

    _C._set_host_addressable(DEVICE_NAME, memory_mode() == "host")
    _C._set_copies_use_host_cpu(DEVICE_NAME, True)


def register() -> bool:
    """Registers the emulated ``spyre`` device unless a real one may exist.

    Idempotent and thread-safe. Returns whether the emulated device is active. Raises
    if registration was attempted and failed (library missing, malformed
    ``SPYRECCL_SPYRE_DEVICE_COUNT``); a later call retries.
    """
    global _active
    with _lock:
        if _active is None:
            _active = _register_locked()
        return _active


def is_registered() -> bool:
    """Whether :func:`register` activated the emulated device in this process."""
    return bool(_active)


def memory_mode() -> str | None:
    """The memory model of the emulated spyre device, or None when it is not active.

    ``"host"``: a spyre tensor's ``data_ptr()`` is host memory that any code may read (the
    default). ``"discrete"`` (``SPYRECCL_SPYRE_MEMORY=discrete``): as on real Spyre cards,
    ``data_ptr()`` is a device address that faults when the host dereferences it; spyre data
    reaches the host only through the device's copies (``copy_``, ``.cpu()``) and
    :func:`host_view`. None: the device in this process is not the emulation (a real Spyre
    runtime, or none), whose memory must be assumed not host-addressable.
    """
    if not is_registered():
        return None
    from . import _memory_mode

    return _memory_mode.memory_mode()


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the memory of the emulated-spyre tensor `tensor`, without copying.

    Same data pointer, sizes, strides, storage offset, dtype (and conjugate/negative bits):
    writes through either are seen by the other. For CPU-only libraries (gloo) that cannot
    take a spyre tensor. The view holds a reference to the spyre storage, so its memory
    stays allocated while the view exists; resizing the spyre storage meanwhile moves the
    spyre tensor to new memory, away from the view. Like ``detach()``, the view is outside
    autograd (``requires_grad=False``) and shares the version counter (an inference tensor
    gives an inference tensor).

    Only while the emulated device is active (:func:`is_registered`): a real Spyre runtime's
    memory is not host memory, so this raises there instead of returning a view of it.

    In discrete memory mode (:func:`memory_mode`) the view is the device's own door to its
    memory: it reads the block's accessible mapping, so its ``data_ptr()`` differs from the
    spyre tensor's (which faults when read) while the two still share every byte. Code that
    must behave as on real cards asks :func:`memory_mode` and copies instead.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            "host_view: argument 'tensor' must be a spyre torch.Tensor, got "
            f"{type(tensor).__name__}"
        )
    if not is_registered():
        raise RuntimeError(
            "host_view: the emulated spyre device is not active in this process (it stepped "
            "aside, or register() was not called): spyre memory may not be host memory"
        )
    return torch.ops.spyreccl_device.host_view(tensor)
