"""Registration of the spyreccl backend with torch.distributed, beside a vendor's.

Our backend is always registered as ``spyreccl_shm`` (:data:`OWN_BACKEND_NAME`, a name only
this package uses) and, unless another package holds it, as ``spyreccl``
(:data:`BACKEND_NAME`). IBM's torch-spyre registers its own backend under ``spyreccl`` too,
and torch 2.13's ``register_backend`` lets the last writer win without a word, so:

* a ``spyreccl`` registered by another package before ours is never replaced: we register
  ``spyreccl_shm`` only, and leave ``spyre``'s default backend as it was;
* a ``spyreccl`` registered by another package after ours wins (torch replaces ours) and we
  step aside: a watch on ``register_backend`` notices it, remembers the vendor's plugin
  (for :mod:`spyreccl_torch.routing`) and hands ``spyre``'s default backend to whoever
  claimed it, so nothing of ours keeps pointing at ours;
* ``SPYRECCL_OVERRIDE_VENDOR=1`` (:data:`OVERRIDE_ENV`) makes ours the backend behind
  ``spyreccl`` and ``spyre``'s default in either order (the vendor's plugin is still
  remembered, so routing can reach it).

Nothing here prints or warns at ``import torch``: what happened is logged at debug level
(logger ``spyreccl_torch._registration``). The creator :func:`_create` gets torch's extended
API: the group's store, rank, size, timeout, name and global ranks.
"""

from __future__ import annotations

import copy
import datetime
import functools
import inspect
import logging
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from . import _C, multinode, routing

BACKEND_NAME = "spyreccl"
OWN_BACKEND_NAME = "spyreccl_shm"
DEVICE_TYPE = "spyre"
OVERRIDE_ENV = "SPYRECCL_OVERRIDE_VENDOR"

_log = logging.getLogger(__name__)
# Reentrant: a watched register_backend may run while register() holds it (our own calls).
_lock = threading.RLock()
# The plugin another package registered under BACKEND_NAME (torch's _BackendPlugin:
# creator_fn, extended_api), whichever order the two registrations came in; None if none.
_vendor_plugin: Any = None
# torch's register_backend as it was before the watch wrapped it.
_register_backend_unwatched: Any = None


def _register_device() -> None:
    """Loads the emulated spyre device when no real one is registered (see
    spyreccl_torch.device). A vendor build without the subpackage relies on its runtime."""
    try:
        from . import device
    except ModuleNotFoundError as error:
        if error.name == f"{__package__}.device":
            return
        raise
    device.register()


def _make_options(dist_opts, backend_opts) -> _C.ProcessGroupSpyreccl.Options:
    options_type = _C.ProcessGroupSpyreccl.Options
    # Never mutate the caller's object: torch reuses pg_options for every group. Anything
    # else (None, or another backend's options in a mixed "cpu:gloo,spyre:spyreccl" group,
    # where torch hands the same pg_options to every backend) means our defaults.
    options = copy.copy(backend_opts) if isinstance(backend_opts, options_type) else options_type()
    timeout = dist_opts.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    # Like NCCL: the group's timeout is the one given to init_process_group / new_group.
    options.timeout = timeout
    options.group_name = str(dist_opts.group_id)
    options.global_ranks_in_group = [int(r) for r in dist_opts.global_ranks_in_group]
    return options


def _create(dist_opts, backend_opts):
    """Backend creator called by torch.distributed (extended API).

    Ranks on one node (the usual case) get the C++ ``ProcessGroupSpyreccl``. Ranks on several
    nodes get a :class:`~spyreccl_torch.multinode.HierarchicalProcessGroup` (spyreccl on each
    node, gloo between nodes); torch accepts a ``ProcessGroup`` subclass from a creator and
    uses it as the whole group.
    """
    options = _make_options(dist_opts, backend_opts)
    if not dist.is_initialized():
        # A new default group: the job may have been re-launched on other nodes.
        multinode.topology.forget()
    topology = multinode.discover(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        options.global_ranks_in_group,
        options.timeout,
    )
    if topology.single_node:
        vendor = _vendor_plugin
        if vendor is not None and routing.requested():
            return routing.RoutingProcessGroup.create(dist_opts, backend_opts, vendor, options)
        return _C.ProcessGroupSpyreccl(
            dist_opts.store, dist_opts.group_rank, dist_opts.group_size, options
        )
    return multinode.HierarchicalProcessGroup(
        dist_opts.store,
        topology,
        options,
        options.group_name,
        options.global_ranks_in_group,
        options.timeout,
    )


def _is_ours(plugin: Any) -> bool:
    return plugin is not None and plugin.creator_fn is _create


def is_registered() -> bool:
    """Whether this package's backend is registered in this process: always under
    :data:`OWN_BACKEND_NAME` once :func:`register` ran (and under :data:`BACKEND_NAME` too
    unless another package holds that name, see :func:`backend_name`)."""
    return _is_ours(dist.Backend._plugins.get(OWN_BACKEND_NAME.upper()))


def backend_name() -> str:
    """The name to give torch for this package's backend: :data:`BACKEND_NAME` while ours is
    the backend behind it, else :data:`OWN_BACKEND_NAME` (another package holds it)."""
    if _is_ours(dist.Backend._plugins.get(BACKEND_NAME.upper())):
        return BACKEND_NAME
    return OWN_BACKEND_NAME


def vendor_plugin() -> Any:
    """The backend another package registered as :data:`BACKEND_NAME` (torch's plugin
    record: ``creator_fn``, ``extended_api``), or None when no other package did."""
    return _vendor_plugin


def override_requested() -> bool:
    """``SPYRECCL_OVERRIDE_VENDOR=1``: ours is the backend behind ``spyreccl`` and the
    default for ``spyre`` even when another package registered them."""
    return os.environ.get(OVERRIDE_ENV, "").strip() == "1"


def _register_ours(name: str) -> None:
    _register_backend_unwatched(name, _create, extended_api=True, devices=[DEVICE_TYPE])


def _on_registration(name: str, func: Any, devices: Any) -> None:
    """Runs after every register_backend call made by anyone once we registered: another
    package taking BACKEND_NAME, or claiming the spyre device, wins unless overridden."""
    global _vendor_plugin
    if func is _create:
        return
    if isinstance(devices, str):
        devices = [devices]
    with _lock:
        if name.upper() == BACKEND_NAME.upper():
            _vendor_plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
            if override_requested():
                _log.debug(
                    "another package registered %r after spyreccl_torch; %s=1 keeps ours "
                    "behind it (theirs stays reachable through spyreccl_torch.routing)",
                    BACKEND_NAME,
                    OVERRIDE_ENV,
                )
                _register_ours(BACKEND_NAME)
                dist.Backend.default_device_backend_map[DEVICE_TYPE] = BACKEND_NAME
                return
            _log.debug(
                "another package registered %r after spyreccl_torch: stepping aside (ours "
                "stays available as %r)",
                BACKEND_NAME,
                OWN_BACKEND_NAME,
            )
        claims = DEVICE_TYPE in (devices or ()) and name.lower() != "fake"
        if claims and not override_requested():
            # torch keeps the first backend registered for a device as its default; a
            # package registering for spyre after us gets the default we took first (not
            # torch's "fake" test backend, which torch never lets claim a device either).
            dist.Backend.default_device_backend_map[DEVICE_TYPE] = name.lower()


def _install_registration_watch() -> None:
    """Wraps ``dist.Backend.register_backend`` so that registrations made after ours (a
    vendor's autoload running after ours) are seen: torch has no notification of its own.
    The wrapper calls torch's function first, unchanged, and never raises on its own."""
    global _register_backend_unwatched
    current = dist.Backend.register_backend
    if getattr(current, "_spyreccl_watch", False):
        # Installed by an earlier import of this package (a failed autoload is retried by
        # re-importing it): keep that wrapper, which calls the live module's hook.
        if _register_backend_unwatched is None:
            _register_backend_unwatched = current.__wrapped__
        return
    _register_backend_unwatched = current

    # Every argument goes through as given: torch's signature grows between releases (2.15
    # passes `_backend_type` for its built-in backends).
    signature = inspect.signature(current)

    @functools.wraps(current)
    def register_backend(*args, **kwargs):
        result = current(*args, **kwargs)
        try:
            arguments = signature.bind(*args, **kwargs).arguments
            # The live module: a re-import of the package replaces this one's state.
            hook = getattr(sys.modules.get(__name__), "_on_registration", None)
            if hook is not None:
                hook(str(arguments["name"]), arguments["func"], arguments.get("devices"))
        except Exception as error:  # never break another package's registration
            _log.debug("spyreccl_torch: registration watch failed: %r", error)
        return result

    register_backend._spyreccl_watch = True  # type: ignore[attr-defined]
    # A staticmethod in place of the classmethod: every caller writes
    # dist.Backend.register_backend(name, func, ...), which reaches it with the same arguments.
    dist.Backend.register_backend = staticmethod(register_backend)  # type: ignore[method-assign]


def _repair_default_backend(pg) -> None:
    """Makes spyreccl the default backend of groups that have no other one.

    ``init_process_group()`` without a backend builds a group holding only
    ``spyre:spyreccl``, yet torch 2.13 declares GLOO (never created) as that group's
    default backend type; DDP and ``destroy_process_group`` then fail or warn ("Could not
    find backend type 1"). A group whose spyre backend is ours and whose CPU side has no
    backend at all gets CUSTOM, the type torch gives plugins in multi-backend groups.
    """
    if not isinstance(pg, dist.ProcessGroup):
        return
    try:
        backend = pg._get_backend(torch.device(DEVICE_TYPE))
    except RuntimeError:
        return
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend in torch's consistency checker.
    backend = getattr(backend, "wrapped_pg", backend)
    # By type, not by name: a vendor's backend may call itself "spyreccl" too, and its
    # groups are not ours to change.
    if not isinstance(backend, _C.ProcessGroupSpyreccl):
        return
    try:
        pg._get_backend(torch.device("cpu"))
        return  # a CPU backend exists (e.g. "cpu:gloo,spyre:spyreccl"): torch's choice holds
    except RuntimeError:
        pass
    pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)


def _install_default_backend_repair() -> None:
    helper = getattr(distributed_c10d, "_new_process_group_helper", None)
    if helper is None or getattr(helper, "_spyreccl_wrapped", False):
        return

    try:
        signature = inspect.signature(helper)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(helper)
    def wrapped(*args, **kwargs):
        result = helper(*args, **kwargs)
        pg = result[0] if isinstance(result, tuple) else result
        _repair_default_backend(pg)
        if isinstance(pg, multinode.HierarchicalProcessGroup) and signature is not None:
            # torch binds device_id to the ProcessGroup it made before our creator replaced
            # it with the hierarchical group: bind it to the one it returns (split_group
            # and eager init read it there).
            try:
                device_id = signature.bind_partial(*args, **kwargs).arguments.get("device_id")
            except TypeError:  # another torch's helper signature: leave the group as is
                device_id = None
            if device_id is not None and pg.bound_device_id is None:
                pg.bound_device_id = device_id
        return result

    wrapped._spyreccl_wrapped = True  # type: ignore[attr-defined]
    # c10d calls the helper through its module globals, so replacing the attribute reaches
    # init_process_group, new_group and split_group alike.
    distributed_c10d._new_process_group_helper = wrapped


def register() -> None:
    """Registers the spyre device (if needed) and the spyreccl backend (see the module
    docstring for the names). Idempotent."""
    global _vendor_plugin
    with _lock:
        _register_device()
        _install_default_backend_repair()
        _install_registration_watch()
        plugins = dist.Backend._plugins
        taken = plugins.get(BACKEND_NAME.upper())
        if taken is not None and not _is_ours(taken):
            _vendor_plugin = taken
        default_before = dist.Backend.default_device_backend_map.get(DEVICE_TYPE)
        if taken is None or (_vendor_plugin is not None and override_requested()):
            if not _is_ours(taken):
                _register_ours(BACKEND_NAME)
        elif not _is_ours(taken):
            _log.debug(
                "another package registered %r before spyreccl_torch: leaving it in place; "
                "ours is %r (%s=1 makes ours the one behind %r)",
                BACKEND_NAME,
                OWN_BACKEND_NAME,
                OVERRIDE_ENV,
                BACKEND_NAME,
            )
        if not is_registered():
            _register_ours(OWN_BACKEND_NAME)
        device_map = dist.Backend.default_device_backend_map
        if _vendor_plugin is not None and override_requested():
            device_map[DEVICE_TYPE] = BACKEND_NAME
        elif _vendor_plugin is not None and device_map.get(DEVICE_TYPE) != default_before:
            # Our second name must not become spyre's default beside a vendor's backend.
            if default_before is None:
                device_map.pop(DEVICE_TYPE, None)
            else:
                device_map[DEVICE_TYPE] = default_before
