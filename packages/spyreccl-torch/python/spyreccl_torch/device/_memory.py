"""Memory and device-property API of ``torch.spyre`` (the names of ``torch.cuda``'s).

The statistics come from the spyre allocator, a ``c10::DeviceAllocator`` (so
``torch.accelerator.memory_stats`` and friends work too). It does not cache: a freed block
goes straight back to the system, so ``memory_reserved`` exceeds ``memory_allocated`` only
by the page rounding of blocks in spyreccl's shareable arena (tensors of 64 KiB and more,
reported as the "large pool"; ordinary host memory is the "small pool"), and
:func:`empty_cache` has nothing to release.

Every emulated device is backed by the same host memory: ``total_memory`` and
:func:`mem_get_info` describe the host.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ._devices import _device_index, _DeviceLike

__all__ = [
    "SpyreDeviceProperties",
    "empty_cache",
    "get_device_name",
    "get_device_properties",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
]

DEVICE_NAME = "Spyre (emulated in host memory)"


@dataclass(frozen=True)
class SpyreDeviceProperties:
    """What :func:`get_device_properties` reports (a subset of CUDA's properties)."""

    name: str
    index: int
    total_memory: int  # bytes of host memory (shared by every emulated device)
    multi_processor_count: int  # host CPUs this process may run kernels on
    type: str = "spyre"


def get_device_properties(device: _DeviceLike = None) -> SpyreDeviceProperties:
    """Properties of ``device`` (default: the current spyre device)."""
    index = _device_index(device)
    _free, total = torch._C._accelerator_getMemoryInfo(index)
    return SpyreDeviceProperties(
        name=DEVICE_NAME,
        index=index,
        total_memory=int(total),
        multi_processor_count=len(os.sched_getaffinity(0)),
    )


def get_device_name(device: _DeviceLike = None) -> str:
    """Name of ``device`` (default: the current spyre device)."""
    return get_device_properties(device).name


def memory_stats(device: _DeviceLike = None) -> OrderedDict[str, Any]:
    """The allocator's statistics for ``device``, keyed as ``torch.cuda.memory_stats``."""
    return torch.accelerator.memory_stats(_device_index(device))


def memory_allocated(device: _DeviceLike = None) -> int:
    """Bytes of spyre memory held by live tensors on ``device``."""
    return int(memory_stats(device).get("allocated_bytes.all.current", 0))


def max_memory_allocated(device: _DeviceLike = None) -> int:
    """Peak of :func:`memory_allocated` since start or :func:`reset_peak_memory_stats`."""
    return int(memory_stats(device).get("allocated_bytes.all.peak", 0))


def memory_reserved(device: _DeviceLike = None) -> int:
    """Bytes the allocator holds from the system for ``device``."""
    return int(memory_stats(device).get("reserved_bytes.all.current", 0))


def max_memory_reserved(device: _DeviceLike = None) -> int:
    """Peak of :func:`memory_reserved` since start or :func:`reset_peak_memory_stats`."""
    return int(memory_stats(device).get("reserved_bytes.all.peak", 0))


def reset_peak_memory_stats(device: _DeviceLike = None) -> None:
    """Makes every peak statistic of ``device`` equal to its current value."""
    torch.accelerator.reset_peak_memory_stats(_device_index(device))


def reset_accumulated_memory_stats(device: _DeviceLike = None) -> None:
    """Zeroes the cumulative (allocated/freed totals and event) statistics of ``device``."""
    torch.accelerator.reset_accumulated_memory_stats(_device_index(device))


def empty_cache() -> None:
    """Releases cached memory: the spyre allocator caches none, so this does nothing."""
    torch.accelerator.empty_cache()


def mem_get_info(device: _DeviceLike = None) -> tuple[int, int]:
    """(free, total) bytes of the host memory behind ``device``."""
    free, total = torch.accelerator.get_memory_info(_device_index(device))
    return int(free), int(total)
