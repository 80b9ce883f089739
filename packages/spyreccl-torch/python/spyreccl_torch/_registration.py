"""Registration of the ``spyreccl`` backend with torch.distributed.

``register()`` maps the ``spyre`` device to ``spyreccl`` (so ``init_process_group()``
without a backend uses it for spyre tensors) and installs :func:`_create` as the backend
creator with torch's extended API, which hands it the group's store, rank, size, timeout,
name and global ranks.
"""

from __future__ import annotations

import copy
import datetime
import functools
import inspect
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from . import _C, multinode

BACKEND_NAME = "spyreccl"
DEVICE_TYPE = "spyre"

_lock = threading.Lock()


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


def is_registered() -> bool:
    """Whether torch.distributed knows the spyreccl backend in this process."""
    plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
    return plugin is not None and plugin.creator_fn is _create


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
        if pg._get_backend(torch.device(DEVICE_TYPE)).name() != BACKEND_NAME:
            return
    except RuntimeError:
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
    """Registers the spyre device (if needed) and the spyreccl backend. Idempotent."""
    with _lock:
        _register_device()
        _install_default_backend_repair()
        if is_registered():
            return
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=[DEVICE_TYPE]
        )
