"""What torch's Python code asks of a hierarchical group's backend (_BackendView), and
split_group: the groups split from a hierarchical group (hierarchical.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .settings import _timeout_of
from .stages import _SPYRE
from .topology import Topology

if TYPE_CHECKING:  # for annotations only: hierarchical.py imports this module
    from .hierarchical import HierarchicalProcessGroup


class _BackendView:
    """What ``pg._get_backend(device)`` returns for a hierarchical group. torch's Python code
    asks a group's backend whether it can split (init_process_group(device_id=...) then
    connects eagerly, and split_group is allowed), for its options and sequence numbers.
    Everything is connected when the group is built, so eager connection is a no-op."""

    supports_splitting = True
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, pg: HierarchicalProcessGroup) -> None:
        self._pg = pg

    def name(self) -> str:
        return "spyreccl"

    @property
    def options(self) -> Any:
        return self._pg._options

    def eager_connect_single_device(self, device: Any) -> None:
        pass

    def perform_nocolor_split(self, device: Any) -> None:
        pass

    def _set_sequence_number_for_group(self) -> None:
        pass

    def _get_sequence_number_for_group(self) -> int:
        return self._pg._seq

    def rank(self) -> int:
        return self._pg.rank()

    def size(self) -> int:
        return self._pg.size()


class Splitting:
    """split_group and _get_backend of HierarchicalProcessGroup (a mixin of it)."""

    def _get_backend(self, device: Any) -> _BackendView:
        return _BackendView(self)

    def split_group(
        self,
        ranks: Sequence[int],
        timeout: Any = None,
        opts: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
        device_types: Any = None,
    ) -> dist.ProcessGroup | None:
        """dist.split_group: collective over this group. Members get a plain spyreccl group
        when their ranks are on one node, else a hierarchical one; both are built from this
        group's topology (no exchange) in a store namespace of their own."""
        from .. import _C

        self._splits += 1
        ranks = sorted(int(r) for r in ranks)
        me = self._topo.rank
        if me not in ranks:
            return None
        name = group_name or f"{self._name}/split{self._splits}"
        # The split count and the members key the store: torch names splits after their
        # ranks only, so a re-split of the same ranks would meet the previous one's keys,
        # and the sibling groups of one split must not meet each other's.
        members = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        store = dist.PrefixStore(f"spyreccl/split{self._splits}/{members}/", self._store)
        node_ids = [self._topo.node_ids[self._topo.node_of[r]] for r in ranks]
        topo = Topology.from_node_ids(ranks.index(me), node_ids)
        global_ranks = [self._global_ranks[r] for r in ranks]
        options = (
            opts.__copy__()
            if isinstance(opts, _C.ProcessGroupSpyreccl.Options)
            else self._options.__copy__()
        )
        options.timeout = _timeout_of(timeout) if timeout is not None else self._timeout
        options.group_name = name
        options.global_ranks_in_group = global_ranks
        if not topo.single_node:
            return type(self)(store, topo, options, name, global_ranks, options.timeout)
        backend = _C.ProcessGroupSpyreccl(store, topo.rank, topo.size, options)
        pg = dist.ProcessGroup(store, topo.rank, topo.size)
        backend_type = dist.ProcessGroup.BackendType.CUSTOM
        pg._register_backend(torch.device(_SPYRE), backend_type, backend)
        pg._set_default_backend(backend_type)
        pg._set_group_name(name)
        return pg
