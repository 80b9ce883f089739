"""``torch.spyre``: the device module of the host-emulated spyre device.

Registered with ``torch._register_device_module("spyre", ...)`` by
:func:`spyreccl_torch.device.register`. It provides what torch looks up on a
PrivateUse1 device module (availability, device management, random state, the
``device`` context manager) and, lazily, what inductor asks for.

The emulated device executes every operator synchronously on the calling thread: there is
one (default) stream per device and :func:`synchronize` has nothing to wait for.

Importing this module is cheap; inductor is only imported when it asks for ``Scheduling``,
``PythonWrapperCodegen``, ``CppWrapperCodegen`` or ``WrapperFxCodegen`` (see
:mod:`._inductor`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "Event",
    "Stream",
    "StreamContext",
    "current_device",
    "current_stream",
    "default_stream",
    "device",
    "device_count",
    "device_of",
    "is_available",
    "is_initialized",
    "memory_mode",
    "set_device",
    "set_stream",
    "stream",
    "synchronize",
]

# Device count, current device and argument parsing, shared with _memory and _random.
from ._devices import _device_index, _DeviceLike, current_device, device_count

# torch calls torch.spyre._lazy_init() before the first spyre tensor (see _local_rank).
from ._local_rank import _lazy_init

# Memory statistics and device properties (torch.spyre.memory_allocated, ...).
from ._memory import *  # noqa: F403
from ._memory import __all__ as _memory_all

__all__ += _memory_all

# torch.utils.checkpoint stashes and replays a device's random state only when its module
# says the device is initialized (as torch.cuda._initialized does); the emulated device always
# is. Without it, recomputed dropout would draw new masks from the spyre generator.
_initialized = True

# Random state and default generators (see _random); _install_integrations() runs once the
# device is named.
from . import _attention, _fsdp, _memory_mode, _random  # noqa: E402
from ._import_hooks import after_import  # noqa: E402
from ._memory_mode import memory_mode  # noqa: E402
from ._random import *  # noqa: E402, F403
from ._random import __all__ as _random_all  # noqa: E402
from ._random import _get_generator  # noqa: E402, F401

__all__ += _random_all


def _install_integrations() -> None:
    """Hooks into torch modules that ``import torch`` does not load (or loads before the
    device is named): DTensor's handlers for tensor-parallel attention, compile's graph-safe
    RNG, inductor's backend for spyre, FSDP2's move of CPU-built modules. Called by
    :func:`spyreccl_torch.device.register` after the rename."""
    _attention.install()
    _fsdp.install()
    _random.install()
    _memory_mode.install_inductor_translation()
    after_import(
        "torch._inductor.compile_fx",
        _register_inductor,
        "spyre's identity in inductor's compile caches",
    )


def _register_inductor() -> None:
    # Registered before inductor's first init_backend_registration(): that function
    # registers a PrivateUse1 device it does not know yet from the device module's classes
    # (__getattr__ below) with no device pass, which would replace spyre's own
    # registration and its cache identity (_inductor.CodegenIdentity). compile_fx is
    # imported before any compile; every call of init_backend_registration is inside one.
    from . import _inductor

    _inductor.register()


# --- device management --------------------------------------------------------------------


def is_available() -> bool:
    """Always true once registered: the emulated device needs no hardware."""
    return device_count() > 0


def is_initialized() -> bool:
    """True: the emulated device has no runtime context to create (torch code such as
    DeviceMesh reads this to decide whether to pick a device for the process; ``LOCAL_RANK``
    already did). ``LOCAL_RANK`` itself is validated on first use (see ``_local_rank``)."""
    return True


def _is_in_bad_fork() -> bool:
    """Host memory and host threads survive ``fork``: a forked child may use the device."""
    return False


def set_device(device: _DeviceLike) -> None:
    """Sets the calling thread's current spyre device."""
    _lazy_init()
    _set_current(_device_index(device, optional=False))


def _set_current(index: int) -> None:
    # Through torch's accelerator API to the spyre device guard, as torch.cuda calls its
    # runtime: no torch operator for a dispatch mode to intercept.
    torch._C._accelerator_setDeviceIndex(index)


def synchronize(device: _DeviceLike = None) -> None:
    """Waits for all work on ``device``: a no-op, since every spyre operator has completed
    when it returns. The device is still validated."""
    # Called around every timed step: the common no-argument call (the current device,
    # always valid) returns without asking the C++ side anything.
    if device is not None:
        _device_index(device)


class device:
    """Context manager that makes ``device`` the current spyre device, restoring the
    previous one on exit. ``None`` or -1 leaves the current device unchanged."""

    def __init__(self, device: _DeviceLike) -> None:
        self.idx = -1 if device is None else _device_index(device)
        self.prev_idx = -1

    def __enter__(self) -> device:
        self.prev_idx = current_device()
        if self.idx != -1 and self.idx != self.prev_idx:
            _set_current(self.idx)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.idx != -1 and self.idx != self.prev_idx:
            _set_current(self.prev_idx)


class device_of(device):
    """Context manager selecting the device of tensor ``obj`` (no-op for non-spyre tensors)."""

    def __init__(self, obj: torch.Tensor) -> None:
        super().__init__(obj.get_device() if obj.device.type == "spyre" else -1)


# --- streams and events ------------------------------------------------------------------
# Every device has one in-order stream, the default stream: operators run to completion on
# the calling thread. These classes exist because torch code written for accelerators (FSDP2,
# DDP, checkpointing) creates and synchronises streams and events; on spyre all of that is
# trivially satisfied. Events still record host timestamps, so elapsed_time works.


class Stream(torch.Stream):
    """A spyre stream: always the device's single default stream."""

    def __new__(cls, device: _DeviceLike = None, priority: int = 0, **kwargs: Any) -> Stream:
        if kwargs:  # (stream_id=, device_index=, device_type=) form used by torch internals
            return super().__new__(cls, priority=priority, **kwargs)
        return super().__new__(
            cls, device=torch.device("spyre", _device_index(device)), priority=priority
        )


class Event:
    """A spyre event: complete as soon as it is recorded; keeps a host timestamp.

    Constructing one returns a plain ``torch.Event`` on the current spyre device: torch's
    event methods (``elapsed_time``, ``wait``) accept only exact ``torch.Event`` objects.
    """

    def __new__(  # type: ignore[misc]
        cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> torch.Event:
        if interprocess:
            raise ValueError("spyre events cannot be shared between processes")
        return torch.Event(
            device=torch.device("spyre", current_device()),
            enable_timing=enable_timing,
            blocking=blocking,
        )


def current_stream(device: _DeviceLike = None) -> Stream:
    """The current (that is, the default) stream of ``device``."""
    raw = torch._C._accelerator_getStream(_device_index(device))
    return Stream(
        stream_id=raw.stream_id, device_index=raw.device_index, device_type=raw.device_type
    )


def default_stream(device: _DeviceLike = None) -> Stream:
    """The default stream of ``device``."""
    return current_stream(device)


def set_stream(stream: torch.Stream) -> None:
    """Makes ``stream`` current; every spyre stream is the default stream already."""
    _check_stream(stream)


class StreamContext:
    """Context manager selecting ``stream``: validates it (every spyre stream is the
    default stream, so there is nothing to switch)."""

    def __init__(self, stream: torch.Stream | None) -> None:
        if stream is not None:
            _check_stream(stream)
        self.stream = stream

    def __enter__(self) -> StreamContext:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None


def stream(stream: torch.Stream | None) -> StreamContext:
    """Context manager selecting ``stream`` (see :class:`StreamContext`)."""
    return StreamContext(stream)


def _check_stream(stream: torch.Stream) -> None:
    if not isinstance(stream, torch.Stream) or stream.device.type != "spyre":
        raise ValueError(f"expected a spyre stream, got {stream!r}")


# --- automatic mixed precision (see _amp) --------------------------------------------------

from ._amp import *  # noqa: E402, F403
from ._amp import __all__ as _amp_all  # noqa: E402

__all__ += _amp_all

# --- inductor (lazy) ----------------------------------------------------------------------

_INDUCTOR_ATTRIBUTES = frozenset(
    {"Scheduling", "PythonWrapperCodegen", "CppWrapperCodegen", "WrapperFxCodegen"}
)


def __getattr__(name: str) -> Any:
    # Inductor looks these up on the device module when it compiles for spyre; importing
    # inductor costs seconds, so registration waits until that first lookup.
    if name in _INDUCTOR_ATTRIBUTES:
        from . import _inductor

        return _inductor.attribute(name)
    raise AttributeError(f"module 'torch.spyre' has no attribute {name!r}")
