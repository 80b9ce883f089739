"""The gloo groups of the multi-node layer, on one gloo device per process.

``dist.ProcessGroupGloo(store, rank, size, timeout)`` gives every group a transport device of
its own, and every device runs a TCP event loop thread that wakes every 10 ms whether or not
anything is in flight (gloo's ``tcp::Loop``). A hierarchical group holds three or four gloo
groups (between nodes, over every rank, the control group, the leaders' exchange), so a job
with a few multi-node groups (a 2-D DeviceMesh, sub-groups) ran dozens of such threads per
rank: with eight groups on 2 x 2 simulated nodes, 36 loop threads per leader woke 3600 times
a second and took 29 ms of CPU a second doing nothing (docs/notes/multinode-routes.md, "Gloo's event
loops"). A device serves any number of groups (gloo's contexts share its loop), so the
groups made here share one, created like torch's default for the same environment:
one device per interface listed in ``GLOO_SOCKET_IFNAME``, else the host's default, and two
worker threads per device for each group, as torch gives them.
"""

from __future__ import annotations

import datetime
import os
import threading
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["gloo_group"]

_lock = threading.Lock()
# (pid, the GLOO_SOCKET_IFNAME they were made for, devices): a forked child makes its own,
# since the parent's loop thread does not exist in it.
_devices: tuple[int, str, list[Any]] | None = None
# The objects whose groups use the shared devices, and how many of them are alive: when the
# last is gone the devices are dropped here, so that their listening sockets and loop threads
# end with the groups (no socket outlives destroy_process_group).
_owners: weakref.WeakSet[Any] = weakref.WeakSet()
_live_owners = 0


def _released() -> None:
    global _devices, _live_owners
    with _lock:
        _live_owners -= 1
        if _live_owners == 0:
            _devices = None


def _shared_devices(owner: Any) -> list[Any]:
    global _devices, _live_owners
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    with _lock:
        if _devices is None or _devices[:2] != (os.getpid(), ifname):
            gloo = dist.ProcessGroupGloo
            if len(ifname) > 1:  # torch's test, for the same variable
                made = [gloo.create_device(interface=name) for name in ifname.split(",")]
            else:
                made = [gloo.create_default_device()]
            _devices = (os.getpid(), ifname, made)
        if owner not in _owners:
            _owners.add(owner)
            _live_owners += 1
            weakref.finalize(owner, _released)
        return _devices[2]


def gloo_group(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, owner: Any
) -> dist.ProcessGroupGloo:
    """A gloo group of `size` ranks over `store`, on this process's shared gloo device(s),
    which stay shared while `owner` (the object that holds the group) is alive."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = _shared_devices(owner)
    options._timeout = timeout
    options._threads = 2 * len(options._devices)
    return dist.ProcessGroupGloo(store, rank, size, options)
