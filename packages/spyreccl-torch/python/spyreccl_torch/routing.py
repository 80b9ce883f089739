"""Completing a vendor's ``spyreccl`` backend: ``SPYRECCL_ROUTE_TO_VENDOR=1``.

IBM's torch-spyre registers a backend of its own as ``spyreccl`` (over its closed
``spyre_comms`` library). It implements send/recv, broadcast, barrier, gather, all_gather,
reduce and all_reduce, the reductions with SUM only, and raises "not supported" for the
rest (scatter, reduce_scatter, all_to_all, ``_allgather_base``, the coalesced forms).
Where its cards have a card-to-card DMA path, those operations should keep it.

With ``SPYRECCL_ROUTE_TO_VENDOR=1`` in the environment of every rank, a group created
through this package's backend (``spyreccl_shm``, or ``spyreccl`` under
``SPYRECCL_OVERRIDE_VENDOR=1``) while another package's ``spyreccl`` is registered is a
:class:`RoutingProcessGroup`: it builds the vendor's backend and ours side by side over one
store (the vendor's under a prefix of its own) and hands each operation to one of them:

* to the vendor's: :data:`VENDOR_OPS` on spyre tensors (all_reduce and reduce with SUM only);
* to ours: every other operation, reduce op and the coalesced forms;
* CPU tensors (a ``"cpu:gloo,spyre:spyreccl_shm"`` group hands them here too, since torch
  uses a Python group as the whole group): a gloo group of its own, made on first use.

``route_counts`` counts the calls per (operation, ``"vendor"`` | ``"spyreccl"`` | ``"gloo"``).
Multi-node groups do not route (the vendor's backend is on-node only).

Why a ``ProcessGroup`` written in Python: torch offers no Python subclass of its C++
``Backend`` (the constructor is not bound), and a creator may return a ``ProcessGroup``,
which torch then uses as the whole group (the multi-node group does the same). The cost:

* every call passes through torch's Python trampoline and this module, a few microseconds
  of Python per collective, with the GIL;
* functional collectives (``torch.distributed._functional_collectives``, DTensor, compiled
  graphs) reach it through torch's own implementation, not the lean C++ path this package
  has for plain spyreccl groups, and an inductor lowering of a vendor's own (torch-spyre
  lowers ``_c10d_functional`` ops to its async ops) sees a Python group, not its backend;
* the two backends are two channels: before an operation goes to one, every operation
  still in flight on the other is waited for, so that ``async_op=True`` calls issued back
  to back on the same tensors keep their order. Alternating asynchronous calls between the
  two channels therefore loses their overlap.
"""

from __future__ import annotations

import collections
import datetime
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from ._group_identity import BACKEND_NAME, SelfNamedGroup
from .multinode.gloo_groups import gloo_group
from .multinode.works import ThenWork

__all__ = ["ROUTE_ENV", "VENDOR_OPS", "RoutingProcessGroup", "requested"]

ROUTE_ENV = "SPYRECCL_ROUTE_TO_VENDOR"
# torch-spyre's backend (late 2026): the operations it implements, by the c10d method name.
VENDOR_OPS = frozenset(
    {"allreduce", "broadcast", "allgather", "gather", "reduce", "send", "recv", "barrier"}
)
# Of those, the reductions it runs with SUM only ("Allreduce only supports SUM operation").
_SUM_ONLY = frozenset({"allreduce", "reduce"})
_SUM = dist.ReduceOp.SUM
# Asynchronous works kept for ordering before the completed ones among them are dropped.
_PRUNE_IN_FLIGHT = 64
_VENDOR_STORE_PREFIX = "spyreccl-vendor/"
_CPU_STORE_PREFIX = "spyreccl-routing-cpu/"

VENDOR = "vendor"
OURS = BACKEND_NAME
GLOO = "gloo"


def requested() -> bool:
    """``SPYRECCL_ROUTE_TO_VENDOR=1``: groups of this package's backend route the vendor's
    operations to the vendor's backend when one is registered."""
    return os.environ.get(ROUTE_ENV, "").strip() == "1"


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an argument: a tensor, a list of them or a list of lists."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    if isinstance(value, (list, tuple)):
        for item in value:
            found.extend(_tensors(item))
    return found


class _BackendView:
    """What ``pg._get_backend(device)`` returns for a routing group: torch's Python code
    asks a group's backend for its name, options, sequence numbers and whether it splits
    or coalesces. Neither is offered (torch then builds sub-groups through the creator and
    sends coalesced work as the ``*_coalesced`` operations, which go to ours)."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, pg: RoutingProcessGroup) -> None:
        self._pg = pg

    def name(self) -> str:
        return OURS

    @property
    def options(self) -> Any:
        return self._pg._options

    def eager_connect_single_device(self, device: Any) -> None:
        pass  # both backends are connected when the group is built

    def _set_sequence_number_for_group(self) -> None:
        pass

    def _get_sequence_number_for_group(self) -> int:
        return sum(self._pg.route_counts.values())

    def rank(self) -> int:
        return self._pg.rank()

    def size(self) -> int:
        return self._pg.size()


def _create_vendor(dist_opts: Any, backend_opts: Any, plugin: Any) -> Any:
    store = dist.PrefixStore(_VENDOR_STORE_PREFIX, dist_opts.store)
    if not plugin.extended_api:
        return plugin.creator_fn(
            store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout
        )
    opts = c10d._DistributedBackendOptions()
    opts.store = store
    opts.group_rank = dist_opts.group_rank
    opts.group_size = dist_opts.group_size
    opts.timeout = dist_opts.timeout
    opts.group_id = dist_opts.group_id
    opts.global_ranks_in_group = dist_opts.global_ranks_in_group
    # Whatever the user passed as pg_options reaches the vendor's creator unchanged, as it
    # would without routing.
    return plugin.creator_fn(opts, backend_opts)


class RoutingProcessGroup(SelfNamedGroup, dist.ProcessGroup):
    """See the module docstring. Built by spyreccl_torch's backend creator."""

    @classmethod
    def create(
        cls, dist_opts: Any, backend_opts: Any, vendor_plugin: Any, options: Any
    ) -> RoutingProcessGroup:
        from . import _C

        # Ours on the group's store as without routing, the vendor's under a prefix.
        store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
        backend = _C.ProcessGroupSpyreccl(store, rank, size, options)
        # Inside a plain ProcessGroup: its bindings reach every operation of the backend
        # (the Backend binding lacks the tensor-coalesced ones functional collectives use).
        ours = dist.ProcessGroup(store, rank, size)
        backend_type = dist.ProcessGroup.BackendType.CUSTOM
        ours._register_backend(torch.device("spyre"), backend_type, backend)
        ours._set_default_backend(backend_type)
        ours._set_group_name(str(options.group_name))
        vendor = _create_vendor(dist_opts, backend_opts, vendor_plugin)
        return cls(store, ours, vendor, options)

    def __init__(self, store: dist.Store, ours: Any, vendor: Any, options: Any) -> None:
        super().__init__(ours.rank(), ours.size())
        self._store = store
        self._ours = ours
        self._vendor = vendor
        self._options = options
        self._timeout: datetime.timedelta = options.timeout
        self._name = str(options.group_name)
        self._desc = ""
        self._cpu: Any = None
        # Works that were not completed when issued, all on _in_flight_channel (see _drain).
        self._in_flight: list[Any] = []
        self._in_flight_channel = OURS
        self._coalesced: list[Any] | None = None
        self.route_counts: collections.Counter[tuple[str, str]] = collections.Counter()

    # -- identity (getBackendName, name, group name and description: SelfNamedGroup) ------

    def __repr__(self) -> str:
        return (
            f"RoutingProcessGroup(rank={self.rank()}, size={self.size()}, "
            f"vendor={type(self._vendor).__name__})"
        )

    def _get_backend(self, device: Any) -> _BackendView:
        return _BackendView(self)

    # -- routing ---------------------------------------------------------------------------

    # The routing of every call: kept to a few attribute reads and comparisons (it runs
    # under the GIL on top of torch's trampoline; bench: spyreccl-bench --mode overhead).

    def _channel(self, op: str, tensors: Sequence[torch.Tensor], opts: Any = None) -> str:
        cpu = 0
        for t in tensors:
            if t.is_cpu:  # a plain flag; t.device builds a torch.device per call
                cpu += 1
        if cpu:
            # All on the CPU: gloo. Mixed devices: ours raises its error naming the argument.
            return GLOO if cpu == len(tensors) else OURS
        if op not in VENDOR_OPS:
            return OURS
        # Read only here: opts.reduceOp builds a ReduceOp object on every access.
        if op in _SUM_ONLY and opts.reduceOp != _SUM:
            return OURS
        return VENDOR

    def _target(self, channel: str) -> Any:
        if channel == OURS:
            return self._ours
        if channel == VENDOR:
            return self._vendor
        if self._cpu is None:  # every rank makes the same first CPU call
            store = dist.PrefixStore(_CPU_STORE_PREFIX, self._store)
            self._cpu = gloo_group(store, self.rank(), self.size(), self._timeout, self)
        return self._cpu

    def _drain(self, channel: str) -> None:
        """Waits for the operations still in flight on another channel than `channel`.
        Only one channel has operations in flight at a time: every switch drains."""
        if self._in_flight and self._in_flight_channel != channel:
            works, self._in_flight = self._in_flight, []
            for work in works:
                work.wait()

    def _issue(
        self,
        op: str,
        tensors: Sequence[torch.Tensor],
        call: Callable[[Any], Any],
        opts: Any = None,
    ) -> Any:
        channel = self._channel(op, tensors, opts)
        self._drain(channel)
        work = call(self._target(channel))
        self.route_counts[(op, channel)] += 1
        if not work.is_completed():
            in_flight = self._in_flight
            in_flight.append(work)
            self._in_flight_channel = channel
            if len(in_flight) > _PRUNE_IN_FLIGHT:
                self._in_flight = [w for w in in_flight if not w.is_completed()]
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    # -- the operations --------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._issue("allreduce", tensors, lambda b: b.allreduce(tensors, opts), opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._issue("reduce", tensors, lambda b: b.reduce(tensors, opts), opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._issue("broadcast", tensors, lambda b: b.broadcast(tensors, opts))

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue(
            "allgather", _tensors([outputs, inputs]), lambda b: b.allgather(outputs, inputs, opts)
        )

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.GatherOptions()
        return self._issue(
            "gather", _tensors([outputs, inputs]), lambda b: b.gather(outputs, inputs, opts)
        )

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BarrierOptions()
        # No tensors: the vendor's backend, as a plain vendor group would do it.
        self._drain(VENDOR)
        work = self._vendor.barrier(opts)
        self.route_counts[("barrier", VENDOR)] += 1
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._issue("send", tensors, lambda b: b.send(tensors, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._issue("recv", tensors, lambda b: b.recv(tensors, src, tag))

    # Ours (and gloo for CPU tensors) only: not in the vendor's set.

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        return self._issue("recv_anysource", tensors, lambda b: b.recv_anysource(tensors, tag))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._issue(
            "allreduce_coalesced", tensors, lambda b: b.allreduce_coalesced(tensors, opts)
        )

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue(
            "_allgather_base", [output, inp], lambda b: b._allgather_base(output, inp, opts)
        )

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue(
            "allgather_coalesced",
            _tensors([outputs, inputs]),
            lambda b: b.allgather_coalesced(outputs, inputs, opts),
        )

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue(
            "allgather_into_tensor_coalesced",
            _tensors([outputs, inputs]),
            lambda b: b.allgather_into_tensor_coalesced(outputs, inputs, opts),
        )

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._issue(
            "scatter", _tensors([outputs, inputs]), lambda b: b.scatter(outputs, inputs, opts)
        )

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue(
            "reduce_scatter",
            _tensors([outputs, inputs]),
            lambda b: b.reduce_scatter(outputs, inputs, opts),
        )

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue(
            "_reduce_scatter_base",
            [output, inp],
            lambda b: b._reduce_scatter_base(output, inp, opts),
        )

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue(
            "reduce_scatter_tensor_coalesced",
            _tensors([outputs, inputs]),
            lambda b: b.reduce_scatter_tensor_coalesced(outputs, inputs, opts),
        )

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._issue(
            "alltoall", _tensors([outputs, inputs]), lambda b: b.alltoall(outputs, inputs, opts)
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._issue(
            "alltoall_base",
            [output, inp],
            lambda b: b.alltoall_base(output, inp, output_splits, input_splits, opts),
        )

    # torch 2.13's names for the single-tensor forms (dist.all_gather_single, ...), which its
    # Python code calls on the group object itself.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # -- coalescing (batch_isend_irecv and torch's coalescing manager) ---------------------

    def _start_coalescing(self, device: torch.device) -> None:
        if self._coalesced is not None:
            raise RuntimeError(f"spyreccl: coalescing already started on group {self._name}")
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> Any:
        works, self._coalesced = self._coalesced or [], None
        return ThenWork(works)

    # -- lifecycle -------------------------------------------------------------------------

    def _children(self) -> list[Any]:
        return [b for b in (self._vendor, self._ours, self._cpu) if b is not None]

    def abort(self) -> None:
        for child in self._children():
            abort = getattr(child, "abort", None)
            if abort is not None:
                try:
                    abort()
                except RuntimeError:
                    pass  # a backend without abort: shutdown below still releases it

    def shutdown(self) -> None:
        for child in self._children():
            shutdown = getattr(child, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError:
                    pass
        self._in_flight = []
        self._cpu = None

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout
        for child in self._children():
            set_timeout = getattr(child, "set_timeout", None)
            if set_timeout is not None:
                set_timeout(timeout)
