"""Which node every rank of a group runs on.

spyreccl moves data through shared memory, so it can only connect ranks of one host. When a
group is created, every rank publishes the identity of its node in the group's c10d store
(one key per rank, then one multi-get): ``hostname/boot id`` by default — the boot id tells
apart containers or machines that happen to share a hostname — or ``SPYRECCL_NODE_ID`` when
set (tests simulate several nodes on one machine with it).

The node of each *global* rank is remembered per process, so groups created later (new_group,
DeviceMesh dimensions) whose members are all known need no exchange at all.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

NODE_ID_ENV = "SPYRECCL_NODE_ID"
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_KEY_PREFIX = "spyreccl/topology/"

# global rank -> node id, learnt from earlier exchanges (the world group's, normally).
_known_nodes: dict[int, str] = {}
_known_lock = threading.Lock()


def local_node_id() -> str:
    """This process's node identity (see the module docstring)."""
    override = os.environ.get(NODE_ID_ENV, "").strip()
    if override:
        return override
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{socket.gethostname()}/{boot_id}"


@dataclass(frozen=True)
class Topology:
    """Placement of a group's ranks on nodes. Ranks are group ranks.

    nodes: every node's ranks in ascending order; nodes are ordered by their lowest rank, so
    node 0 holds rank 0. A rank's local rank is its index in its node's list.
    """

    rank: int
    nodes: tuple[tuple[int, ...], ...]
    node_ids: tuple[str, ...]
    node_of: tuple[int, ...] = field(repr=False)  # group rank -> node index
    local_rank_of: tuple[int, ...] = field(repr=False)  # group rank -> local rank

    @classmethod
    def from_node_ids(cls, rank: int, ids: Sequence[str]) -> Topology:
        order: dict[str, list[int]] = {}
        for r, node_id in enumerate(ids):
            order.setdefault(node_id, []).append(r)
        nodes = tuple(tuple(members) for members in order.values())
        node_of = [0] * len(ids)
        local_rank_of = [0] * len(ids)
        for n, members in enumerate(nodes):
            for i, r in enumerate(members):
                node_of[r] = n
                local_rank_of[r] = i
        return cls(rank, nodes, tuple(order), tuple(node_of), tuple(local_rank_of))

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def single_node(self) -> bool:
        return len(self.nodes) == 1

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def local_rank(self) -> int:
        return self.local_rank_of[self.rank]

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The group ranks on this rank's node."""
        return self.nodes[self.node]

    @property
    def uniform(self) -> bool:
        """Whether every node holds the same number of ranks."""
        return len({len(n) for n in self.nodes}) == 1

    def cross_ranks(self, local_index: int) -> tuple[int, ...]:
        """The ranks with local rank `local_index`, one per node that has one, by node."""
        return tuple(n[local_index] for n in self.nodes if len(n) > local_index)

    def describe(self) -> str:
        return ", ".join(
            f"node {i} ({nid}): ranks {list(m)}"
            for i, (nid, m) in enumerate(zip(self.node_ids, self.nodes, strict=True))
        )


def _timeout_seconds(timeout) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def discover(store, rank: int, size: int, global_ranks: Sequence[int], timeout) -> Topology:
    """The group's topology: from what this process already knows when it knows every
    member's node, else through one exchange over `store` (collective over the group).

    Raises RuntimeError naming the missing ranks when some rank does not publish its node
    within `timeout` (e.g. a node that never joined).
    """
    global_ranks = list(global_ranks) if global_ranks else list(range(size))
    with _known_lock:
        known = [_known_nodes.get(g) for g in global_ranks]
    if len(global_ranks) == size and all(k is not None for k in known):
        return Topology.from_node_ids(rank, known)  # type: ignore[arg-type]

    keys = [f"{_KEY_PREFIX}{r}" for r in range(size)]
    store.set(keys[rank], local_node_id())
    seconds = _timeout_seconds(timeout)
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except Exception as error:  # the store's timeout error type varies between stores
        missing = _missing_ranks(store, keys)
        raise RuntimeError(
            f"spyreccl: rank {rank} of {size} could not learn the node of every rank within "
            f"{seconds:g} s: ranks {missing or '?'} never published theirs (did a node fail "
            f"to start or join the rendezvous?); store error: {error}"
        ) from error
    ids = [v.decode() if isinstance(v, bytes) else str(v) for v in store.multi_get(keys)]
    if len(global_ranks) == size:
        with _known_lock:
            _known_nodes.update(zip(global_ranks, ids, strict=True))
    return Topology.from_node_ids(rank, ids)


def _missing_ranks(store, keys: list[str]) -> list[int]:
    missing = []
    deadline = time.monotonic() + 1.0
    for r, key in enumerate(keys):
        try:
            if not store.check([key]):
                missing.append(r)
        except Exception:
            missing.append(r)
        if time.monotonic() > deadline:
            break
    return missing


def forget() -> None:
    """Drops what this process learnt (tests; a re-initialised job may move ranks)."""
    with _known_lock:
        _known_nodes.clear()
