"""A stand-in for IBM's torch-spyre, registering itself as torch-spyre does (test fixture).

torch-spyre (the package ``torch_spyre``) is autoloaded through the ``torch.backends`` entry
point ``torch_spyre = torch_spyre:_autoload``; it registers the PrivateUse1 device ``spyre``
(its C++ runtime, the ``torch.spyre`` device module) and, in its ``__init__.py``,
``dist.Backend.register_backend("spyreccl", <creator>, devices=["spyre"])``. This stand-in
does the same steps in the same order, with two substitutes, since no Spyre card is here:

* **the device**: its runtime is the C++ library of spyreccl's emulated device
  (``_device*.so``, found next to the installed ``spyreccl_torch`` without importing that
  package, so that nothing of spyreccl runs before its own entry point does), loaded, named
  and given a device module *by this package*, as torch-spyre loads its own. spyreccl's
  emulation then sees a real runtime installed and steps aside, as it would beside
  torch-spyre. (Its memory is host memory, unlike real Spyre memory: that difference is
  not what these tests are about.)
* **the backend**: torch-spyre's is a C++ ``c10d::Backend`` over ``spyre_comms``; this one is a
  Python ``ProcessGroup`` (torch binds no Python ``Backend`` subclass) that implements only
  what torch-spyre's implements -- send/recv, broadcast, barrier, gather, all_gather, reduce
  and all_reduce, the reductions with SUM only -- staged through host copies and gloo, and
  raises "not supported" for the rest, as torch-spyre's does. It records every call it
  serves in :data:`CALLS`.

Installed for a test by putting this directory and a ``torch_spyre-*.dist-info`` folder
(METADATA, entry_points.txt) on ``sys.path`` (tests/test_vendor_coexistence.py).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DISTRIBUTED_BACKEND_NAME = "spyreccl"

# (operation, device type) of every call this backend served, in order.
CALLS: list[tuple[str, str]] = []
# What this package saw when torch loaded its entry point: was spyreccl_torch loaded yet?
AUTOLOAD_SAW: dict[str, Any] = {"spyreccl_torch_loaded": "spyreccl_torch" in sys.modules}

_lock = threading.Lock()


# --- the device (what torch-spyre's runtime provides) ----------------------------------------


def _runtime_library() -> Path:
    spec = importlib.util.find_spec("spyreccl_torch")  # locates it, runs nothing
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the stand-in's device runtime needs spyreccl_torch's _device library")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("_device*.so"))
        if found:
            return found[0]
    raise ImportError("spyreccl_torch's _device library was not found")


def _device_module() -> types.ModuleType:
    ops = torch.ops.spyreccl_device
    module = types.ModuleType("torch.spyre")
    state = {"initialized": False}

    def _lazy_init() -> None:
        if not state["initialized"]:
            ops.init()
            state["initialized"] = True

    def device_count() -> int:
        return int(ops.device_count())

    def current_device() -> int:
        _lazy_init()
        return int(ops.current_device())

    def set_device(device: Any) -> None:
        _lazy_init()
        index = torch.device(device).index if not isinstance(device, int) else device
        ops.set_device(index)

    module.__dict__.update(
        _lazy_init=_lazy_init,
        _is_in_bad_fork=lambda: False,
        is_available=lambda: device_count() > 0,
        is_initialized=lambda: True,
        device_count=device_count,
        current_device=current_device,
        set_device=set_device,
        synchronize=lambda device=None: None,
    )
    return module


def _register_device() -> None:
    torch.ops.load_library(str(_runtime_library()))
    torch.ops.spyreccl_device.route_to_cpu_kernels()
    torch.utils.rename_privateuse1_backend("spyre")
    torch._register_device_module("spyre", _device_module())
    if not hasattr(torch.Tensor, "is_spyre"):
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)


# --- the backend (what torch-spyre's spyre_ccl provides) -------------------------------------


def _not_supported(op: str) -> RuntimeError:
    return RuntimeError(f"SpyreCCL: {op} is not supported")


def _done(result: list[torch.Tensor]) -> Any:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


class _View:
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, pg: StandinSpyreCCL) -> None:
        self._pg = pg

    def name(self) -> str:
        return DISTRIBUTED_BACKEND_NAME

    def _set_sequence_number_for_group(self) -> None:
        pass

    def eager_connect_single_device(self, device: Any) -> None:
        pass


class StandinSpyreCCL(dist.ProcessGroup):
    """torch-spyre's operation set, staged through host copies (its documented fallback
    when no card-to-card path exists) and a gloo group."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: Any) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._name = ""

    def getBackendName(self) -> str:
        return DISTRIBUTED_BACKEND_NAME

    def name(self) -> str:
        return DISTRIBUTED_BACKEND_NAME

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def _get_backend(self, device: Any) -> _View:
        return _View(self)

    def _staged(self, op: str, tensors: list[torch.Tensor], run: Any) -> Any:
        """Copies `tensors` to host, runs `run(host copies)` on gloo, copies back."""
        with _lock:
            CALLS.append((op, tensors[0].device.type if tensors else "none"))
        host = [t.detach().to("cpu", copy=True) for t in tensors]
        run(host).wait()
        for t, h in zip(tensors, host, strict=True):
            t.copy_(h)
        return _done(tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.AllreduceOptions()
        if opts.reduceOp != dist.ReduceOp.SUM:
            raise RuntimeError("SpyreCCL: Allreduce only supports SUM operation")
        return self._staged("allreduce", tensors, lambda h: self._gloo.allreduce(h, opts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.ReduceOptions()
        if opts.reduceOp != dist.ReduceOp.SUM:
            raise RuntimeError("SpyreCCL: Reduce only supports SUM operation")
        return self._staged("reduce", tensors, lambda h: self._gloo.reduce(h, opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.BroadcastOptions()
        return self._staged("broadcast", tensors, lambda h: self._gloo.broadcast(h, opts))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        opts = opts or dist.AllgatherOptions()
        flat = [t for row in outputs for t in row]
        n = len(flat)

        def run(host: list[torch.Tensor]) -> Any:
            return self._gloo.allgather([host[:n]], host[n:], opts)

        return self._staged("allgather", flat + list(inputs), run)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        opts = opts or dist.GatherOptions()
        flat = [t for row in outputs for t in row]
        n = len(flat)

        def run(host: list[torch.Tensor]) -> Any:
            return self._gloo.gather([host[:n]] if n else [], host[n:], opts)

        return self._staged("gather", flat + list(inputs), run)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._staged("send", tensors, lambda h: self._gloo.send(h, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._staged("recv", tensors, lambda h: self._gloo.recv(h, src, tag))

    def barrier(self, opts: Any = None) -> Any:
        with _lock:
            CALLS.append(("barrier", "none"))
        self._gloo.barrier(dist.BarrierOptions()).wait()
        return _done([])

    # torch-spyre raises for these.

    def scatter(self, *args: Any) -> Any:
        raise _not_supported("scatter")

    def reduce_scatter(self, *args: Any) -> Any:
        raise _not_supported("reduce_scatter")

    def _reduce_scatter_base(self, *args: Any) -> Any:
        raise _not_supported("reduce_scatter")

    def alltoall(self, *args: Any) -> Any:
        raise _not_supported("alltoall")

    def alltoall_base(self, *args: Any) -> Any:
        raise _not_supported("alltoall_base")

    def _allgather_base(self, *args: Any) -> Any:
        raise _not_supported("_allgather_base")

    def allreduce_coalesced(self, *args: Any) -> Any:
        raise _not_supported("allreduce_coalesced")

    def shutdown(self) -> None:
        self._gloo.shutdown()


def _create(store: dist.Store, rank: int, size: int, timeout: Any) -> StandinSpyreCCL:
    return StandinSpyreCCL(store, rank, size, timeout)


# --- registration, as torch-spyre's __init__.py does it ---------------------------------------

_register_device()
dist.Backend.register_backend(DISTRIBUTED_BACKEND_NAME, _create, devices=["spyre"])


def _autoload() -> None:
    """The ``torch.backends`` entry point: importing this package did the work."""
