"""A process group whose ranks span several nodes: spyreccl on each node, gloo between them.

spyreccl's communicators live in shared memory, so one can only hold ranks of one host.
A group whose ranks are on several nodes is therefore built from:

- ``local``: a ``ProcessGroupSpyreccl`` over this node's ranks (shared memory);
- ``cross``: a gloo group over the ranks that have this rank's local index, one per node
  that has one (the "leaders" group for local index 0 exists on every node);
- ``flat``: a gloo group over every rank, for what has no useful hierarchy here: CPU tensors,
  all_to_all, gather, scatter, send/recv between nodes and the flat route below;
- ``control``: a gloo group over every rank for barriers without checking and for naming
  the calls of a mismatch (fingerprint.py);
- with checking on, ``check_local`` (spyreccl, the node's ranks) and ``check_leaders`` (gloo,
  the leaders), which compare every operation's fingerprints node by node (node_check.py).

gloo moves host memory: on the emulated spyre device (host memory) its stages read and write
the spyre tensors in place through CPU views, elsewhere through host copies (staging.py). Data
moves as raw bytes, so gloo's dtype coverage does not matter; reductions are widened to a
dtype gloo reduces. Reductions take one of three routes, by size:

- *flat* (up to SPYRECCL_MULTINODE_FLAT_MAX_BYTES, off by default): one gloo all_reduce
  over every rank. Fewest stages, but every rank's message crosses between nodes.
- *leader* (the default below the sharded bound): reduce on each node to local rank 0,
  all_reduce among the leaders, broadcast on each node. Any layout, one message per node
  between nodes: small and mid sizes, uneven nodes.

Between nodes, parts of at most SPYRECCL_MULTINODE_EXCHANGE_MAX_BYTES are reduced by an
exchange (one gloo all_to_all, then every rank combines the parts in rank order), larger
ones by gloo's ring all_reduce.
- *sharded*: reduce-scatter on each node, all_reduce of every shard between the ranks of the
  same local index (all nodes in parallel), all-gather on each node. Every rank moves 1/L of
  the data between nodes: large messages on nodes of equal size. all_gather and
  reduce_scatter have sharded routes of the same shape (the ranks of each local index
  exchange between nodes in parallel, the node gathers / reduce-scatters).

reduce sends each node's partial result once towards the root's node; gather and scatter
send each block once, between the root and its owner.

16- and 8-bit floats are reduced in float32 and rounded once at the end, and AVG divides the
exact total once, so the results match the single-node path's (which also accumulates in
wider types and rounds once) within its tolerances, whatever the number of stages.

Operations on spyre tensors run on the group's executor (executor.py): one thread per group
that runs them in issue order, so ``async_op=True`` returns at once and the caller computes
while the stages run; a blocking call with nothing queued runs on the caller's thread. Every
collective's fingerprint is checked across all ranks while its on-node stages run, and
before its first gloo stage (node_check.py, fingerprint.py, _gloo).

torch lets a Python class act as a whole process group
(``ProcessGroup`` subclasses, see torch's PyProcessGroup), not as a backend, so this class is
what the backend creator returns for multi-node groups; single-node groups keep the plain C++
``ProcessGroupSpyreccl``.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .executor import OrderedExecutor
from .failure_handling import FailureHandling
from .failures import ABORT_OP, FailureBoard
from .fingerprint import CallChecker, MismatchError, PendingCheck
from .fingerprint import signature as _sig
from .gloo_groups import gloo_group
from .node_check import CARRY_MAX_BYTES, EXCHANGE_MAX_LEADERS, NodeChecker
from .pipeline import agree_chunk_bytes, chunk_bounds, proposed_chunk_bytes
from .reduction import Plan as _Plan
from .reduction import combine_in_order as _combine_in_order
from .reduction import exchange_ok as _exchange_ok
from .reduction import op_kind as _op_kind
from .stages import _SIGN_BIT, _SPYRE, Stages, _gloo_view, _RedOp, _Stage
from .staging import HostStaging, same_memory, zero_copy_available
from .topology import Topology
from .works import AsyncWork, ThenWork

# Operations of at least this many bytes (a reduction's buffer after widening, a gather's
# output) take the sharded route when the nodes hold the same number of ranks; smaller ones
# the leader route.
SHARDED_MIN_BYTES_ENV = "SPYRECCL_MULTINODE_SHARDED_MIN_BYTES"
DEFAULT_SHARDED_MIN_BYTES = 256 * 1024

# Reductions of at most this many bytes (after widening) skip the hierarchy: one gloo
# all_reduce (or reduce, reduce_scatter) over every rank on host copies (the "flat" route).
# 0, the default, turns it off: reductions below the sharded bound take the leader route.
# Measured (docs/performance.md, "Multiple nodes: small-message routes and the check"): on
# an idle 16-core machine (a core per rank) the leader route took less time than the flat
# one at every size from 8 B to 64 KiB, with the mismatch check and without it (8 B: 711
# vs 830 us with it); with 4 ranks on this project's 2-CPU VM, spyreccl-bench --nodes 2
# --nproc 2 gave the leader route 1.4-1.7 ms (once 3.8) against the flat one's 2.3-9.2 ms
# from 8 B to 32 KiB (two interleaved runs each, load 4), and the interleaved latency
# harness gave mixed results within its noise. On real servers the leader route sends one
# message per node between nodes, the flat route one per rank. The flat route used to be
# the default up to 64 KiB (from the 2-CPU latency runs, and) because the leader route
# failed slowly: a leader that failed in an on-node stage left the other node's leader
# waiting in the cross-node stage until gloo's timeout. Failures now reach every stage
# within moments (failures.py), on every route.
FLAT_MAX_BYTES_ENV = "SPYRECCL_MULTINODE_FLAT_MAX_BYTES"
DEFAULT_FLAT_MAX_BYTES = 0

# Reductions between nodes of at most this many bytes (each rank's part; 0 turns it off)
# are done by an exchange: one gloo all_to_all gives every rank every part, which it
# combines in order (a direct exchange instead of gloo's ring all_reduce), between at most 8
# nodes. Read when a group is created.
EXCHANGE_MAX_BYTES_ENV = "SPYRECCL_MULTINODE_EXCHANGE_MAX_BYTES"
DEFAULT_EXCHANGE_MAX_BYTES = 64 * 1024

# "0" turns off the check that all ranks called the same collective (fingerprint.py); on by
# default. Read when a group is created.
CHECK_ENV = "SPYRECCL_MULTINODE_CHECK"

# How long a rank that saw an operation fail waits for the other ranks to say they saw it
# too, to name the ones that did not (see _who_failed).
FAILURE_WINDOW_ENV = "SPYRECCL_MULTINODE_FAILURE_WINDOW_S"

# How long a rank other than the leader yields the CPU before it sleeps (ns, the core's
# yield phase) while it waits for the outcome of the leaders' exchange before its own gloo
# stage (node_check.py): the leader may not have it before the leaders' whole round trip
# over gloo and the network, and yielding all that time keeps CPUs busy that gloo's threads
# and the leaders need when ranks share CPUs. Only that wait: the node's other waits are
# short rendezvous, where yielding hands a shared CPU to the peer about to arrive (a short
# phase for the whole control group made small leader-route operations up to 1.6x slower).
# With 2 x 2 ranks on 2 CPUs, 50000 made all_to_all with split sizes 1.3-1.5x faster and
# the sharded all_gather of 512 KiB 1.7x slower (the woken rank's gloo stage is on the
# critical path), so the default stays the group's own (the core's 2 ms): -1.
# docs/performance.md, "Ranks that wait for the outcome". Read when a group is created.
YIELD_NS_ENV = "SPYRECCL_MULTINODE_YIELD_NS"
DEFAULT_YIELD_NS = -1


# The groups of this process that are still alive, for shut_down_live_groups.
_LIVE: weakref.WeakSet[HierarchicalProcessGroup] = weakref.WeakSet()


def shut_down_live_groups() -> None:
    """Shuts down every live group at interpreter exit (spyreccl_torch._lifecycle): the
    group's thread finishes the operations it queued, so that it is not inside gloo or
    spyreccl (with the GIL released) when the interpreter finalizes. A thread that asks for
    the GIL then is ended with pthread_exit, which aborts the process from C++ frames."""
    for group in list(_LIVE):
        if group._pid != os.getpid():
            continue  # inherited through fork(): its threads are not in this process
        try:
            group.shutdown()
        except Exception:
            pass  # exit goes on; the operations have reported their errors


def _release_later(held: list[Any], seconds: float) -> None:
    """Drops the last references to gloo groups and their abandoned Works once those have
    timed out (see HierarchicalProcessGroup.shutdown); a daemon thread, so exit does not
    wait."""
    time.sleep(seconds)
    held.clear()


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


class _A2ALayout:
    """The block layout of a carried all_to_all_single (_carried_all_to_all), from a topology:

    - remote_of_mine: the ranks outside this rank's node, in rank order (the receivers of
      what the node sends in the leaders' exchange, after each local sender's blocks);
    - other_nodes: the other nodes, in order (their parts, concatenated, are what the leader
      broadcasts on its node);
    - local_senders: this node's ranks (their blocks come from the node's all-gather);
    - remote_senders / remote_slots: every rank on another node, and where its block for this
      rank sits in the broadcast buffer, counted in blocks."""

    def __init__(self, topo: Topology) -> None:
        world, me = topo.size, topo.rank
        self.remote_of_mine = [r for r in range(world) if topo.node_of[r] != topo.node]
        self.other_nodes = [k for k in range(len(topo.nodes)) if k != topo.node]
        self.local_senders = list(topo.local_ranks)
        self.remote_senders: list[int] = []
        self.remote_slots: list[int] = []
        offset = 0
        for k in self.other_nodes:
            members = topo.nodes[k]
            receivers = [r for r in range(world) if topo.node_of[r] != k]
            where = receivers.index(me)
            for i, sender in enumerate(members):
                self.remote_senders.append(sender)
                self.remote_slots.append(offset + i * len(receivers) + where)
            offset += len(members) * len(receivers)
        self.received_blocks = offset


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of contiguous `a` and `b` overlaps."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _own_slice(
    part: torch.Tensor, local_rank: int, local_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(part, this rank's slice of it): the in-place layout of an on-node reduce-scatter
    and all-gather of `part` (numel a multiple of local_size)."""
    size = part.numel() // local_size
    return part, part[local_rank * size : (local_rank + 1) * size]


def _block_group_slices(
    flat: torch.Tensor, members: Sequence[int], n: int, start: int, end: int
) -> list[torch.Tensor]:
    """Elements [start, end) of the blocks of `members` (n elements each, rank r's at r * n
    in `flat`) laid one after the other: the slices of `flat` that hold them."""
    pieces = []
    for k in range(start // n if n else 0, len(members)):
        lo, hi = max(start, k * n), min(end, (k + 1) * n)
        if lo >= hi:
            break
        r = members[k]
        pieces.append(flat[r * n + lo - k * n : r * n + hi - k * n])
    return pieces


def _without_grad(body: Callable[[], Any]) -> Any:
    """body() with autograd off (grad mode is per thread: the caller's does not apply);
    torch.no_grad() as a context manager costs microseconds per small operation."""
    if not torch.is_grad_enabled():
        return body()
    torch._C._set_grad_enabled(False)
    try:
        return body()
    finally:
        torch._C._set_grad_enabled(True)


def _yield_ns_from_env() -> int:
    """SPYRECCL_MULTINODE_YIELD_NS as a number of ns (or -1), checked when a group is
    created rather than at the first wait it applies to."""
    text = os.environ.get(YIELD_NS_ENV, "").strip()
    if not text:
        return DEFAULT_YIELD_NS
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < -1:
        raise ValueError(
            f"spyreccl: {YIELD_NS_ENV}={text!r}: expected a number of nanoseconds (>= 0), or "
            "-1 for the core's default"
        )
    return value


def _timeout_of(timeout: Any) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


class HierarchicalProcessGroup(Stages, FailureHandling, dist.ProcessGroup):
    """See the module docstring. Built by spyreccl_torch's backend creator when a group's
    ranks are on more than one node."""

    def __init__(
        self,
        store: dist.Store,
        topology: Topology,
        options: Any,
        group_name: str,
        global_ranks: Sequence[int],
        timeout: Any,
    ) -> None:
        super().__init__(topology.rank, topology.size)
        from .. import _C

        self._topo = topology
        self._timeout = _timeout_of(timeout)
        self._name = group_name
        self._desc = ""
        self._global_ranks = list(global_ranks) or list(range(topology.size))
        self._seq = 0  # collectives (every rank counts the same ones)
        self._plans: dict[tuple[Any, torch.dtype], _Plan] = {}  # see _plan
        self._broadcast_opts: dict[int, Any] = {}  # see _local_broadcast
        self._carried_calls: dict[tuple[int, torch.dtype, Any], bool] = {}  # see _carries
        self._a2a_plan: _A2ALayout | None = None  # see _a2a_layout
        self._p2p_seq = 0  # sends and receives (only the two ranks involved count them)
        self._failed: str | None = None
        self._coalesced: list[Any] | None = None
        self._store = store
        self._check_calls = os.environ.get(CHECK_ENV, "1").strip() not in ("0", "false", "no")
        # How many operations took each route (tests and the benchmark read it).
        self.route_counts = {"leader": 0, "sharded": 0, "flat": 0}
        # How the reductions between nodes (the cross stages) were done: "exchange" (gloo
        # all_to_all and an in-order combine), "ring" (gloo's all_reduce) or "carried" (in the
        # leaders' check exchange, node_check.py).
        self.cross_counts = {"exchange": 0, "ring": 0, "carried": 0}
        # The gloo stages' host buffers (staging.py): spyre memory itself where the
        # emulated device is active; staging_counts counts the copies made otherwise.
        self._staging = HostStaging(zero_copy_available())
        self.staging_counts = self._staging.counts
        self._flat_max_bytes = int(os.environ.get(FLAT_MAX_BYTES_ENV, DEFAULT_FLAT_MAX_BYTES))
        self._exchange_max_bytes = int(
            os.environ.get(EXCHANGE_MAX_BYTES_ENV, DEFAULT_EXCHANGE_MAX_BYTES)
        )
        self._executor = OrderedExecutor(f"group '{group_name}'")
        self._mismatch: PendingCheck | None = None  # set by the checker's gloo callback
        self._stopped: str | None = None
        self._gate: PendingCheck | None = None  # the running operation's unverified check
        self._exchange: PendingCheck | None = None  # the running operation's exchange
        self._failure_window_s = float(os.environ.get(FAILURE_WINDOW_ENV, "2"))
        outcome_yield_ns = _yield_ns_from_env()  # before any sub-group is created
        self._board = FailureBoard(store, topology.rank, topology.node_of)
        self._board.clear()  # before the gloo groups connect (see clear)
        # gloo Works this rank stopped waiting for (still pending: see shutdown).
        self._abandoned: list[Any] = []
        self._sharded_min_bytes = int(
            os.environ.get(SHARDED_MIN_BYTES_ENV, DEFAULT_SHARDED_MIN_BYTES)
        )
        # Nodes of equal size holding consecutive ranks (the usual launch): a node's ranks'
        # blocks are then contiguous in rank-ordered buffers (in-place all-gather,
        # reduce_scatter by node).
        width = len(topology.local_ranks)
        self._nodes_in_order = topology.uniform and all(
            members == tuple(range(k * width, (k + 1) * width))
            for k, members in enumerate(topology.nodes)
        )
        node = topology.node
        local_ranks = topology.local_ranks
        # Chunk size of the sharded routes' overlapped stages (pipeline.py), the same on
        # every rank: the stages' order depends on it.
        self._chunk_bytes = agree_chunk_bytes(
            store,
            topology.rank,
            topology.size,
            lambda: proposed_chunk_bytes(len(local_ranks)),
            self._timeout,
        )
        # Sharded reductions cut into chunks, and the chunks (tests and the benchmark read it).
        self.pipeline_counts = {"operations": 0, "chunks": 0}

        # One store namespace per sub-group: the node's spyreccl rendezvous and every gloo
        # group's connection setup must not see each other's keys.
        self._options = options
        self._splits = 0
        # The node's only rank: its on-node reduce and broadcast have nothing to do (about
        # 10 us of Python and a core call each, per operation, on the leader route).
        self._alone = len(local_ranks) == 1
        local_options = options.__copy__()
        local_options.timeout = self._timeout
        local_options.group_name = f"{group_name}/node{node}"
        local_options.global_ranks_in_group = [self._global_ranks[r] for r in local_ranks]
        self._local = _C.ProcessGroupSpyreccl(
            dist.PrefixStore(f"spyreccl/node{node}/", store),
            topology.local_rank,
            len(local_ranks),
            local_options,
        )
        cross_ranks = topology.cross_ranks(topology.local_rank)
        self._cross_ranks = cross_ranks
        self._cross = None
        if len(cross_ranks) > 1:
            self._cross = gloo_group(
                dist.PrefixStore(f"spyreccl/cross{topology.local_rank}/", store),
                cross_ranks.index(topology.rank),
                len(cross_ranks),
                self._timeout,
                self,
            )
        self._flat = gloo_group(
            dist.PrefixStore("spyreccl/flat/", store),
            topology.rank,
            topology.size,
            self._timeout,
            self,
        )
        # The control group: barriers without checking, and gathering the calls of a
        # mismatch (see fingerprint.py); a gloo group of its own, so that the data groups'
        # operation order does not depend on whether checking is on.
        self._check_group = gloo_group(
            dist.PrefixStore("spyreccl/control/", store),
            topology.rank,
            topology.size,
            self._timeout,
            self,
        )
        self._checker: CallChecker | NodeChecker = CallChecker(
            self._check_group,
            topology.size,
            self._label,
            self._on_mismatch,
            self._on_exchange_error,
            self._wait_gloo_work,
        )
        # With checking on, fingerprints are compared node by node (node_check.py): within a
        # node over a spyreccl group of its own, between nodes among the leaders only.
        self._check_local = None
        self._check_leaders = None
        if self._check_calls:
            if len(local_ranks) > 1:
                check_options = options.__copy__()
                check_options.timeout = self._timeout
                check_options.group_name = f"{group_name}/node{node}/control"
                check_options.global_ranks_in_group = local_options.global_ranks_in_group
                self._check_local = _C.ProcessGroupSpyreccl(
                    dist.PrefixStore(f"spyreccl/control-node{node}/", store),
                    topology.local_rank,
                    len(local_ranks),
                    check_options,
                )
            leaders = topology.cross_ranks(0)
            if topology.local_rank == 0:
                self._check_leaders = gloo_group(
                    dist.PrefixStore("spyreccl/control-leaders/", store),
                    leaders.index(topology.rank),
                    len(leaders),
                    self._timeout,
                    self,
                )
            self._checker = NodeChecker(
                self._checker,
                self._check_local,
                self._check_leaders,
                topology.local_rank,
                len(local_ranks),
                torch.device(_SPYRE),
                self._on_mismatch,
                self._on_exchange_error,
                self._wait_gloo_work,
                self._published_cause,
            )
            self._checker.outcome_yield_ns = outcome_yield_ns
        self._shut_down = False
        self._pid = os.getpid()  # a child forked later inherits the group, not its threads
        _LIVE.add(self)

    # -- identity ------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return "spyreccl"

    def name(self) -> str:
        return "spyreccl"

    # c10d keeps a group's name and description in its backends; this group registers none
    # (it dispatches itself), so it keeps them and answers the C++ getters (DeviceMesh,
    # functional collectives and the group registry ask for group_name).
    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    @property
    def topology(self) -> Topology:
        return self._topo

    def __repr__(self) -> str:
        return (
            f"HierarchicalProcessGroup('{self._name}', rank {self._topo.rank} of "
            f"{self._topo.size}, {len(self._topo.nodes)} nodes)"
        )

    # -- plumbing ------------------------------------------------------------------------

    def _label(self) -> str:
        return (
            f"process group '{self._name}' (rank {self._topo.rank} of {self._topo.size}, "
            f"node {self._topo.node} of {len(self._topo.nodes)})"
        )

    def _run(
        self,
        op_name: str,
        body: Callable[[], list[torch.Tensor] | None],
        signature: Sequence[int] = (),
        opts: Any = None,
        exchange: bool = False,
        carry: bool = False,
    ) -> dist.Work:
        """Queues one operation with its sequence number on the group's executor and returns
        its Work. A failure names both and leaves the group unusable (its sub-groups are
        aborted, so that ranks of this node that wait for this one in an on-node stage fail
        too instead of waiting for the timeout).

        ValueError is an argument rejected before anything was communicated (every rank
        rejects the same call): the Work carries it as is (a blocking call raises it) and the
        group stays usable. With checking on, `signature` (sizes, dtype, root, op: what every
        rank must agree on) travels to every rank alongside the operation. `exchange`: post the
        control exchange even with checking off (barriers: the exchange is the barrier);
        `body` finds it in self._exchange. `carry`: a leader's check exchange waits for the
        reduction between the nodes, which travels in it (_carry_cross)."""
        if self._failed is not None:
            raise dist.DistBackendError(
                f"spyreccl: {op_name} on {self._label()}: the group failed earlier "
                f"({self._failed}); create a new one"
            )
        self._seq += 1
        seq = self._seq
        work = AsyncWork(op_name, seq, self._timeout, self._timed_out)
        checker = self._checker

        def job() -> None:
            if self._failed is not None:
                work.fail(
                    dist.DistBackendError(
                        f"spyreccl: {op_name} seq {seq} on {self._label()}: the group failed "
                        f"earlier ({self._failed}); create a new one"
                    )
                )
                return
            pending = None
            try:
                if carry:
                    pending = checker.post(op_name, seq, signature, carry=True)
                elif self._check_calls or exchange:
                    pending = checker.post(op_name, seq, signature, self._check_calls)
                self._gate = self._exchange = pending  # _gate: see _gloo
                result = _without_grad(body)
                if pending is not None and self._gate is not None:
                    # No gloo stage on this rank: the result is only final once every rank
                    # was seen to call the same collective.
                    self._gate = None
                    checker.verify(pending)
            except Exception as error:
                # A stage failed (spyreccl's own mismatch detection on a node, a peer that
                # gave up, arguments this rank rejected): when the fingerprints disagree,
                # that is the cause to report, on every rank alike (each rank that sees the
                # disagreement takes part in gathering the calls). They arrive within
                # moments: a short wait here, and again after _fail's wait for the other
                # ranks' reports (so a dead peer costs no extra wait).
                rejected = isinstance(error, ValueError)
                if pending is not None:
                    if rejected:
                        checker.finish(pending)  # the group stays usable: keep it in step
                    self._abandon(pending.work)
                cause = self._mismatch_behind(pending, error, None if rejected else 0.2)
                if isinstance(cause, ValueError):
                    work.fail(cause)  # rejected arguments: the group stays usable
                    return
                failure = self._fail(op_name, seq, cause)
                if not isinstance(cause, MismatchError):
                    late = self._mismatch_behind(pending, error, 0.0)
                    failure = late if isinstance(late, MismatchError) else failure
                failure.__cause__ = error
                work.fail(failure)
                return
            finally:
                # The exchange's gloo future holds callbacks that reach this group: a
                # reference kept here would be a cycle through C++ that gc cannot free.
                self._gate = self._exchange = None
            work.complete(result)

        # A blocking call (async_op=False) with nothing queued runs on this thread.
        self._executor.submit(job, inline_ok=not getattr(opts, "asyncOp", True))
        if self._coalesced is not None:
            self._coalesced.append(work)
        if work.is_completed() and isinstance(work.exception(), ValueError):
            work.wait()  # rejected arguments: raised on the calling thread
        return work

    def _is_local(self, peer: int) -> bool:
        return self._topo.node_of[peer] == self._topo.node

    def _plan(self, op: Any, dtype: torch.dtype) -> _Plan:
        """The reduction plan of `op` on `dtype` (reduction.Plan; raises ValueError for what
        spyreccl does not define). Plans depend on the op's kind and the dtype only, except
        PREMUL_SUM's (its factor), so the others are made once per group."""
        kind = _op_kind(op)
        if kind == _RedOp.PREMUL_SUM:
            return _Plan(op, dtype, self._topo.size)
        plan = self._plans.get((kind, dtype))
        if plan is None:
            plan = self._plans[(kind, dtype)] = _Plan(op, dtype, self._topo.size)
        return plan

    def _flat_ok(self, nbytes: int, plan: _Plan) -> bool:
        """Whether a reduction of `nbytes` takes the flat route (one gloo all_reduce over
        every rank). Not for PREMUL_SUM: gloo has no kernel for it."""
        return nbytes <= self._flat_max_bytes and plan.kind != _RedOp.PREMUL_SUM

    def _reduction_route(self, nbytes: int, plan: _Plan) -> str:
        """The route of an all_reduce of `nbytes` (after widening): flat, sharded or leader."""
        if self._flat_ok(nbytes, plan):
            return "flat"
        return "sharded" if self._sharded_ok(nbytes) else "leader"

    def _all_reduce_work(self, work: torch.Tensor, plan: _Plan) -> None:
        """All-reduces `work` (contiguous, the plan's work dtype) in place over the group."""
        topo = self._topo
        local_size = len(topo.local_ranks)
        nbytes = work.numel() * work.element_size()
        route = self._reduction_route(nbytes, plan)
        if route == "flat":
            self.route_counts["flat"] += 1
            self._host_reduce(self._flat, work, plan.local_op)
            return
        if route == "sharded":
            self.route_counts["sharded"] += 1
            flat, padded = self._padded_for_node(work)
            bounds = chunk_bounds(
                padded.numel(), local_size, padded.element_size(), self._chunk_bytes
            )
            # In place: each chunk is reduce-scattered into this rank's slice of it, and
            # all-gathered from there (the core's in-place layouts), so no shard buffer is
            # allocated per call (memory traffic, and page faults for blocks beyond what
            # the device's arena keeps resident: docs/performance.md, "In-place sharded
            # stages").
            chunks = [
                _own_slice(padded[a:b], topo.local_rank, local_size)
                for a, b in itertools.pairwise(bounds)
            ]
            self._sharded_stages(chunks, plan, gather=True)
            if padded is not flat:
                flat.copy_(padded[: flat.numel()])
            return
        self.route_counts["leader"] += 1
        self._local_reduce_to_leader(work, plan.local_op)
        if topo.local_rank == 0 and not self._carry_cross(work, plan.cross_op):
            self._cross_all_reduce(work, plan.cross_op)
        self._local_broadcast(work, 0)

    def _carries(self, tensors: Sequence[torch.Tensor], op: Any = None) -> bool:
        """Whether this leader's stage between the nodes of an all_reduce (`op` given) or a
        broadcast of `tensors` travels in the check's exchange (node_check.py,
        NodeChecker.carry): an all_reduce on the leader route, or a broadcast, of at most
        CARRY_MAX_BYTES between the nodes. The same answer on every leader for the same call:
        it depends on the call and the group's settings only."""
        if not self._carry_capable(tensors):
            return False
        t = tensors[0]
        if op is None:
            return 0 < t.numel() * t.element_size() <= CARRY_MAX_BYTES
        kind = _op_kind(op)
        key = (t.numel(), t.dtype, kind)
        carried = self._carried_calls.get(key)
        if carried is None:
            try:
                plan = self._plan(op, t.dtype)
            except ValueError:
                return False  # rejected in the operation itself
            nbytes = t.numel() * plan.work_dtype.itemsize
            carried = (
                0 < nbytes <= min(CARRY_MAX_BYTES, self._exchange_max_bytes)
                and self._reduction_route(nbytes, plan) == "leader"
                and _exchange_ok(plan.work_dtype, plan.cross_op)
            )
            if len(self._carried_calls) < 256:  # a training loop repeats a few shapes
                self._carried_calls[key] = carried
        return carried

    def _carry_cross(self, work: torch.Tensor, op: Any) -> bool:
        """The leaders' reduction of `work` in this operation's check exchange (_carry),
        reduced in node order on every leader (the same bits everywhere); False: nothing
        done."""
        if not self._carrying():
            return False
        host = self._staging.host(work)
        flat = host.reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        parts = self._carry(flat.view(torch.uint8), "all_reduce", [nbytes] * len(self._topo.nodes))
        _combine_in_order([part.view(flat.dtype) for part in parts], op, out=flat)
        self._staging.commit(work, host)
        return True

    def _padded_for_node(self, work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`work` flattened, and the same zero-padded to a multiple of the node's size (the
        same tensor when no padding is needed), for an on-node reduce-scatter."""
        local_size = len(self._topo.local_ranks)
        flat = work.reshape(-1)
        shard = -(-flat.numel() // local_size)
        padded = flat
        if shard * local_size != flat.numel():
            padded = torch.zeros(shard * local_size, dtype=work.dtype, device=work.device)
            padded[: flat.numel()].copy_(flat)
        return flat, padded

    def _reduce_scatter_on_node(
        self, work: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sharded routes' first stage: `work` (zero-padded to a multiple of the node's
        size when needed) is reduce-scattered on the node. Returns `work` flattened, the
        padded buffer (the same tensor when no padding was needed) and this rank's reduced
        shard."""
        flat, padded = self._padded_for_node(work)
        mine = torch.empty(
            padded.numel() // len(self._topo.local_ranks), dtype=work.dtype, device=work.device
        )
        rs = self._rs_opts(plan.local_op, blocking=True)
        self._wait(self._local._reduce_scatter_base(mine, padded, rs))
        return flat, padded, mine

    def _sharded_stages(
        self, chunks: list[tuple[torch.Tensor, torch.Tensor]], plan: _Plan, gather: bool
    ) -> None:
        """For each (part, shard): reduce-scatters `part` on the node into this rank's
        `shard` (a buffer of its own, or this rank's slice of `part`: in place), all-reduces
        `shard` between the nodes and, with `gather`, all-gathers the node's shards back
        into `part`. One chunk: one stage after the other. Several: the stages of different
        chunks overlap (pipeline.py); every rank issues them in the same order: every
        reduce-scatter, then per chunk, as its exchange between nodes completes, its
        all-gather."""
        if len(chunks) == 1:
            part, shard = chunks[0]
            self._wait(
                self._local._reduce_scatter_base(
                    shard, part, self._rs_opts(plan.local_op, blocking=True)
                )
            )
            self._cross_all_reduce(shard, plan.cross_op)
            if gather:
                self._wait(self._local._allgather_base(part, shard, self._ag_opts(blocking=True)))
            return
        self.pipeline_counts["operations"] += 1
        self.pipeline_counts["chunks"] += len(chunks)
        scatters = [
            self._local._reduce_scatter_base(shard, part, self._rs_opts(plan.local_op, False))
            for part, shard in chunks
        ]
        stages: list[_Stage] = []
        try:
            for (_, shard), scattered in zip(chunks, scatters, strict=True):
                self._wait(scattered)
                stages.append(self._start_cross_all_reduce(shard, plan.cross_op))
            gathers = []
            for (part, shard), stage in zip(chunks, stages, strict=True):
                self._finish_stage(stage)
                if gather:
                    gathers.append(self._local._allgather_base(part, shard, self._ag_opts(False)))
            for gathered in gathers:
                self._wait(gathered)
        except BaseException:
            self._abandon_stages(stages)
            raise

    def _reduce_work(self, work: torch.Tensor, plan: _Plan, root: int) -> None:
        """Reduces `work` (contiguous, the plan's work dtype) to group rank `root`; only the
        root's `work` holds the result. Each node's partial result crosses to the root's node
        once (an all_reduce would also send the total back to every node)."""
        topo = self._topo
        root_node, root_local = topo.node_of[root], topo.local_rank_of[root]
        nbytes = work.numel() * work.element_size()
        if self._flat_ok(nbytes, plan):
            self.route_counts["flat"] += 1
            self._host_reduce(self._flat, work, plan.local_op, root=root)
            return
        if self._sharded_ok(nbytes):
            # Reduce-scatter on each node; local index j's shards are reduced between nodes
            # to the root's node (all indexes at once); the root's node gathers them.
            self.route_counts["sharded"] += 1
            flat, padded, mine = self._reduce_scatter_on_node(work, plan)
            self._host_reduce(self._cross, mine, plan.cross_op, root=root_node)
            if topo.node == root_node:
                self._wait(self._local._allgather_base(padded, mine, self._ag_opts(blocking=True)))
                if padded is not flat and topo.rank == root:
                    flat.copy_(padded[: flat.numel()])
            return
        self.route_counts["leader"] += 1
        # Reduce on every node to the root's local index when every node has one (then
        # that index's cross group reduces straight to the root), else to the leaders, and
        # the root's node passes the total on.
        via = root_local if len(topo.cross_ranks(root_local)) == len(topo.nodes) else 0
        self._local_reduce_to_leader(work, plan.local_op, via)
        if topo.local_rank == via and self._cross is not None:
            self._host_reduce(self._cross, work, plan.cross_op, root=root_node)
        if via != root_local and topo.node == root_node:
            self._local_broadcast(work, via)

    def _all_reduce_into(self, t: torch.Tensor, op: Any) -> None:
        plan = self._plan(op, t.dtype)
        work = plan.prepare(t, always_copy=not t.is_contiguous())
        self._all_reduce_work(work, plan)
        result = plan.finish(work)
        if result is not t:
            t.copy_(result)

    def _broadcast_into(self, t: torch.Tensor, root: int) -> None:
        """Hierarchical broadcast of `t` from group rank `root`."""
        topo = self._topo
        root_node = topo.node_of[root]
        buf = t if t.is_contiguous() else t.contiguous()
        if topo.node == root_node:
            self._local_broadcast(buf, topo.local_rank_of[root])
        if topo.local_rank == 0 and self._cross is not None:
            host = self._staging.host_bytes(buf, fill=topo.node == root_node)
            if self._carrying():
                # The leaders' exchange lists the nodes in order.
                parts = self._carry(host if topo.node == root_node else None, "broadcast")
                if topo.node != root_node:
                    host.copy_(parts[root_node])
            else:
                opts = c10d.BroadcastOptions()
                opts.rootRank = root_node  # the leaders' group lists the nodes in order
                opts.rootTensor = 0
                self._gloo(lambda: self._cross.broadcast([host], opts))
            if topo.node != root_node:
                self._staging.commit(buf, host)
        if topo.node != root_node:
            self._local_broadcast(buf, 0)
        if buf is not t:
            t.copy_(buf)

    def _all_gather_blocks(
        self, inp: torch.Tensor, into: torch.Tensor | None = None
    ) -> Callable[[int], torch.Tensor]:
        """All-gathers `inp` (same numel and dtype on every rank); returns block(r), rank r's
        elements as a flat tensor on `inp`'s device. `into` (flat, contiguous, world size
        times `inp`'s elements on its device, or None): where the leader route gathers, so
        that its blocks need no copy; it may hold `inp` (read before `into` is written)."""
        topo = self._topo
        n = inp.numel()
        flat_in = inp.detach().contiguous().reshape(-1)
        local_size = len(topo.local_ranks)
        if self._sharded_ok(topo.size * n * inp.element_size()):
            return self._all_gather_sharded(flat_in)
        self.route_counts["leader"] += 1
        node_buf = torch.empty(local_size * n, dtype=inp.dtype, device=inp.device)
        self._wait(self._local._allgather_base(node_buf, flat_in, self._ag_opts(blocking=True)))
        full = (
            into
            if into is not None
            else torch.empty(topo.size * n, dtype=inp.dtype, device=inp.device)
        )
        if topo.local_rank == 0:
            # Leaders exchange whole nodes, padded to the largest node (gloo gathers equal
            # sizes), then place every rank's block at its position. Nodes of equal size
            # holding consecutive ranks in order (the usual launch) need neither step: gloo
            # reads the node's blocks and writes the gathered ones in place.
            widest = max(len(m) for m in topo.nodes)
            block = n * inp.element_size()
            full_bytes = self._staging.host_bytes(full, fill=False)
            if self._carry_gather(node_buf, block, full_bytes):
                self._staging.commit(full, full_bytes)
                self._local_broadcast(full, 0)
                return lambda r: full[r * n : (r + 1) * n]
            mine = self._staging.padded_bytes(node_buf, widest * block)
            gathered = (
                full_bytes
                if self._nodes_in_order
                else torch.empty(len(topo.nodes) * widest * block, dtype=torch.uint8)
            )
            self._gloo(lambda: self._cross._allgather_base(gathered, mine, c10d.AllgatherOptions()))
            if gathered is not full_bytes:
                for node, members in enumerate(topo.nodes):
                    for i, r in enumerate(members):
                        start = (node * widest + i) * block
                        full_bytes[r * block : (r + 1) * block].copy_(
                            gathered[start : start + block]
                        )
            self._staging.commit(full, full_bytes)
        self._local_broadcast(full, 0)
        return lambda r: full[r * n : (r + 1) * n]

    def _carry_gather(self, node_buf: torch.Tensor, block: int, full_bytes: torch.Tensor) -> bool:
        """The leaders' all-gather of whole nodes in this operation's check exchange (_carry):
        every rank's `block` bytes to its place in `full_bytes`; False: nothing done (the
        exchange was not deferred for it)."""
        if not self._carrying():
            return False
        nodes = self._topo.nodes
        expected = [len(members) * block for members in nodes]
        parts = self._carry(self._staging.host_bytes(node_buf), "all_gather", expected)
        for node, members in enumerate(nodes):
            for i, r in enumerate(members):
                full_bytes[r * block : (r + 1) * block].copy_(
                    parts[node][i * block : (i + 1) * block]
                )
        return True

    def _carries_gather(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether this leader's stage between the nodes of an all_gather of `inputs` travels
        in the check's exchange (node_check.py): the leader route, the widest node's blocks
        at most CARRY_MAX_BYTES. The same answer on every leader for the same call."""
        if not self._carry_capable(inputs):
            return False
        block = inputs[0].numel() * inputs[0].element_size()
        widest = max(len(m) for m in self._topo.nodes)
        return 0 < widest * block <= CARRY_MAX_BYTES and not self._sharded_ok(
            self._topo.size * block
        )

    def _all_gather_into(
        self, inp: torch.Tensor, outs: Sequence[torch.Tensor], into: torch.Tensor | None = None
    ) -> None:
        """All-gathers `inp` into one output per rank (`into`: see _all_gather_blocks; the
        outputs that are already its blocks are not copied)."""
        block = self._all_gather_blocks(inp, into)
        for r, out in enumerate(outs):
            got = block(r)
            if got.data_ptr() != out.data_ptr() or got.numel() != out.numel():
                out.copy_(got.reshape(out.shape))

    def _all_gather_into_tensor(self, inp: torch.Tensor, output: torch.Tensor) -> None:
        """All-gathers `inp` into `output` (world size times its elements, rank order)."""
        n = inp.numel()
        if self._all_gather_in_place(inp, output):
            return
        direct = output.is_contiguous()
        flat = (
            output.view(-1)
            if direct
            else torch.empty(output.numel(), dtype=output.dtype, device=output.device)
        )
        # The leader route gathers straight into `flat` (the output itself when contiguous,
        # as the sharded route does): no gathered buffer of its own, no copy of each block.
        same = output.dtype == inp.dtype and output.device == inp.device
        self._all_gather_into(
            inp,
            [flat[r * n : (r + 1) * n] for r in range(self._topo.size)],
            into=flat if same else None,
        )
        if not direct:
            output.copy_(flat.reshape(output.shape))

    # -- collectives ---------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllreduceOptions()
        if not self._on_spyre(tensors):
            return self._flat.allreduce(tensors, opts)

        def body() -> list[torch.Tensor]:
            for t in tensors:
                self._all_reduce_into(t, opts.reduceOp)
            return tensors

        carry = self._carries(tensors, opts.reduceOp)
        return self._run("all_reduce", body, _sig(tensors, opts.reduceOp), opts, carry=carry)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        if not self._on_spyre(tensors):
            return self._flat.allreduce_coalesced(tensors, opts)

        def body() -> list[torch.Tensor]:
            # One reduction per dtype over the concatenation: one pass through every stage.
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self._all_reduce_into(flat, opts.reduceOp)
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].reshape(t.shape))
                    offset += t.numel()
            return tensors

        return self._run("all_reduce_coalesced", body, _sig(tensors, opts.reduceOp), opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceOptions()
        if not self._on_spyre(tensors):
            return self._flat.reduce(tensors, opts)

        def body() -> list[torch.Tensor]:
            t = tensors[0]
            plan = self._plan(opts.reduceOp, t.dtype)
            # Only the root's tensor changes: everyone reduces a copy.
            work = plan.prepare(t, always_copy=True).contiguous()
            self._reduce_work(work, plan, opts.rootRank)
            if self._topo.rank == opts.rootRank:
                t.copy_(plan.finish(work))
            return tensors

        return self._run("reduce", body, _sig(tensors, opts.reduceOp, opts.rootRank), opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.BroadcastOptions()
        if not self._on_spyre(tensors):
            return self._flat.broadcast(tensors, opts)

        def body() -> list[torch.Tensor]:
            self._broadcast_into(tensors[0], opts.rootRank)
            return tensors

        carry = self._carries(tensors)
        return self._run("broadcast", body, _sig(tensors, None, opts.rootRank), opts, carry=carry)

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._on_spyre(inputs):
            return self._flat.allgather(output_lists, inputs, opts)

        def body() -> list[torch.Tensor]:
            outs = output_lists[0]
            inp = inputs[0]
            self._check_list("all_gather", "tensor_list", outs, inp)
            self._all_gather_into(inp, outs)
            return outs

        carry = self._carries_gather(inputs)
        return self._run("all_gather", body, _sig(inputs), opts, carry=carry)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()

        def body() -> list[torch.Tensor]:
            for outs, inp in zip(output_lists, inputs, strict=True):
                self._check_list("all_gather_coalesced", "output_tensor_lists", outs, inp)
                self._all_gather_into(inp, outs)
            return [t for outs in output_lists for t in outs]

        return self._run("all_gather_coalesced", body, _sig(inputs), opts)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._on_spyre([inp]):
            return self._flat._allgather_base(output, inp, opts)

        def body() -> list[torch.Tensor]:
            self._check_numel("all_gather_into_tensor", output, inp.numel() * self._topo.size)
            self._all_gather_into_tensor(inp, output)
            return [output]

        carry = self._carries_gather([inp])
        return self._run("all_gather_into_tensor", body, _sig([inp]), opts, carry=carry)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._on_spyre(inputs):
            return self._flat.allgather_into_tensor_coalesced(outputs, inputs, opts)

        def body() -> list[torch.Tensor]:
            for out, inp in zip(outputs, inputs, strict=True):
                self._check_numel("all_gather_into_tensor", out, inp.numel() * self._topo.size)
                self._all_gather_into_tensor(inp, out)
            return outputs

        return self._run("all_gather_into_tensor_coalesced", body, _sig(inputs), opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _sharded_ok(self, nbytes: int) -> bool:
        """Whether an operation of `nbytes` takes the sharded route (see the module doc)."""
        topo = self._topo
        return topo.uniform and len(topo.local_ranks) > 1 and nbytes >= self._sharded_min_bytes

    def _all_gather_in_place(self, inp: torch.Tensor, output: torch.Tensor) -> bool:
        """The sharded all-gather written straight into a contiguous `output`, for nodes of
        equal size that hold consecutive ranks (the usual launch); False (nothing done)
        otherwise. This rank's block goes to its place in `output` (unless `inp` is already
        there, FSDP's layout); then, at the same time, the node all-gathers its ranks'
        blocks in place (spyreccl) and the ranks of this local index gather theirs between
        the nodes (gloo), each straight into its place; last, for every other node, the
        node all-gathers in place the blocks that crossed. No gathered buffer, and no copy
        of the result into `output` (the general path below makes both)."""
        topo = self._topo
        n, local_size = inp.numel(), len(topo.local_ranks)
        out = output.view(-1) if output.is_contiguous() else None
        if (
            out is None
            or self._cross is None
            or not self._nodes_in_order
            or not self._sharded_ok(output.numel() * output.element_size())
            or not inp.is_contiguous()
        ):
            return False
        j = topo.local_rank
        own = out[topo.rank * n : (topo.rank + 1) * n]
        src = inp.detach().reshape(-1)
        if src.dtype != own.dtype or not same_memory(own, src):
            if _overlaps(src, out):
                return False  # another rank's place: the general path reads it first
            own.copy_(src)
        self.route_counts["sharded"] += 1
        places = [
            out[(k * local_size + j) * n : (k * local_size + j + 1) * n]
            for k in range(len(topo.nodes))
        ]
        # As bytes: gloo's all-gather moves any dtype so (complex, float8, unsigned).
        hosts = [self._staging.host_bytes(p, fill=k == topo.node) for k, p in enumerate(places)]
        sent = hosts[topo.node]

        def after() -> None:
            for k, (place, host) in enumerate(zip(places, hosts, strict=True)):
                if k != topo.node:
                    self._staging.commit(place, host)

        gloo_opts = c10d.AllgatherOptions()
        stage = _Stage(
            self._post_gloo(lambda: self._cross.allgather([hosts], [sent], gloo_opts)), after
        )
        node_blocks = [
            out[k * local_size * n : (k + 1) * local_size * n] for k in range(len(topo.nodes))
        ]
        # The on-node stages run on this thread (blocking calls) while gloo's thread moves
        # the blocks between the nodes: 5-22 % less time at 1-16 MiB than handing them to
        # spyreccl's progress thread, on the 2-CPU VM (two alternated runs).
        opts = self._ag_opts(blocking=True)
        try:
            self._wait(self._local._allgather_base(node_blocks[topo.node], own, opts))
            self._finish_stage(stage)
        except BaseException:
            self._abandon_stages([stage])
            raise
        for k in range(len(topo.nodes)):
            if k != topo.node:
                self._wait(self._local._allgather_base(node_blocks[k], places[k], opts))
        return True

    def _all_gather_sharded(self, flat_in: torch.Tensor) -> Callable[[int], torch.Tensor]:
        """All-gather on nodes of equal size: the ranks of each local index gather their
        blocks between the nodes (all local indexes at once, each rank sending its block
        once), then every node all-gathers those; blocks are then put in rank order."""
        topo = self._topo
        self.route_counts["sharded"] += 1
        n, nodes = flat_in.numel(), len(topo.nodes)
        across_dev = torch.empty(nodes * n, dtype=flat_in.dtype, device=flat_in.device)
        across = self._staging.host_bytes(across_dev, fill=False)
        sent = self._staging.host_bytes(flat_in)
        self._gloo(lambda: self._cross._allgather_base(across, sent, c10d.AllgatherOptions()))
        self._staging.commit(across_dev, across)
        node_buf = torch.empty(
            len(topo.local_ranks) * nodes * n, dtype=flat_in.dtype, device=flat_in.device
        )
        self._wait(self._local._allgather_base(node_buf, across_dev, self._ag_opts(blocking=True)))

        # node_buf holds, for local index j and node k, the block of rank nodes[k][j]: the
        # callers copy each block to its destination (no reordering pass).
        def block(r: int) -> torch.Tensor:
            src = (topo.local_rank_of[r] * nodes + topo.node_of[r]) * n
            return node_buf[src : src + n]

        return block

    def _reduce_scatter_flat(
        self, flat: torch.Tensor, op: Any, out: torch.Tensor, owned: bool
    ) -> None:
        """`flat` (contiguous) holds world_size equal blocks; `out` receives the reduction of
        this rank's. `owned`: `flat` is this call's own buffer, which the routes that reduce
        in place may overwrite (else they copy it first; the sharded routes only read it)."""
        topo = self._topo
        n = out.numel()
        plan = self._plan(op, flat.dtype)
        if self._sharded_ok(flat.numel() * flat.element_size()):
            if self._reduce_scatter_by_node(flat, plan, out):
                return
            # Nodes of equal size in another order: local rank j reduces, on its node, the
            # blocks of the ranks with local index j on every node; those ranks then
            # all-reduce them between the nodes (all local indexes at once), and each keeps
            # its own block.
            self.route_counts["sharded"] += 1
            nodes, local_size = len(topo.nodes), len(topo.local_ranks)
            # Chunk c of `mine` (elements [s, e) of this rank's nodes * n) is reduce-scattered
            # from elements [s, e) of every local index's group of blocks: `grouped` holds
            # those chunk after chunk (one chunk: the groups one after the other).
            bounds = chunk_bounds(
                nodes * n,
                1,
                flat.element_size() * local_size,
                self._chunk_bytes,
            )
            pieces = []
            for s, e in itertools.pairwise(bounds):
                for j in range(local_size):
                    members = [m[j] for m in topo.nodes]
                    pieces.extend(_block_group_slices(flat, members, n, s, e))
            grouped = torch.cat(pieces) if pieces else flat[:0]
            work = plan.prepare(grouped, always_copy=False)
            # In place (see _all_reduce_work): chunk c's result, elements [s, e) of this
            # rank's nodes * n, lands in this rank's slice of the chunk.
            chunks = [
                _own_slice(work[s * local_size : e * local_size], topo.local_rank, local_size)
                for s, e in itertools.pairwise(bounds)
            ]
            self._sharded_stages(chunks, plan, gather=False)
            # This rank's block is elements [k n, (k + 1) n) of its nodes * n: the pieces of
            # the chunks' slices that hold them.
            lo, hi = topo.node * n, (topo.node + 1) * n
            pieces = [
                shard[max(s, lo) - s : min(e, hi) - s]
                for (s, e), (_, shard) in zip(itertools.pairwise(bounds), chunks, strict=True)
                if max(s, lo) < min(e, hi)
            ]
            result = pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else flat[:0]
            out.copy_(plan.finish(result).reshape(out.shape))
            return
        work_bytes = flat.numel() * torch.empty((), dtype=plan.work_dtype).element_size()
        if self._flat_ok(work_bytes, plan):
            # One gloo reduce_scatter over every rank: each rank receives only its block.
            self.route_counts["flat"] += 1
            if n == 0:
                return
            # gloo may flip the input's sign bits (uint64 MIN/MAX): a buffer of this call's.
            host_in = self._staging.host(plan.prepare(flat, always_copy=not owned))
            # In place into `out` when the reduction's dtype is out's (then finish() returns
            # its argument, or a new tensor for AVG, copied in by commit).
            host_out = (
                self._staging.host(out, fill=False).view(-1)
                if plan.work_dtype == out.dtype
                else torch.empty(n, dtype=plan.work_dtype)
            )
            view_in, flip = _gloo_view(host_in, plan.local_op)
            view_out = torch.view_as_real(host_out) if host_out.is_complex() else host_out
            if host_out.dtype == torch.uint64:
                view_out = host_out.view(torch.int64)
            rs = c10d.ReduceScatterOptions()
            rs.reduceOp = plan.local_op
            self._gloo(lambda: self._flat._reduce_scatter_base(view_out, view_in, rs))
            if flip:
                view_out.bitwise_xor_(_SIGN_BIT)
            self._staging.commit(out, plan.finish(host_out))
            return
        if not owned:
            flat = flat.clone()
        self._all_reduce_into(flat, op)
        r = self._topo.rank
        out.copy_(flat[r * n : (r + 1) * n].reshape(out.shape))

    def _reduce_scatter_by_node(self, flat: torch.Tensor, plan: _Plan, out: torch.Tensor) -> bool:
        """The sharded reduce_scatter on nodes that hold consecutive ranks (False, nothing
        done, otherwise): node k's ranks' blocks are contiguous in `flat`, so every node
        reduce-scatters that region straight from the input, which leaves local rank j with
        its node's partial sum of rank k L + j's block; then the ranks of each local index
        reduce those partials between the nodes to node k's (one gloo reduce per node,
        posted as soon as its region's on-node stage is done). Each block crosses between
        nodes once, to where it is needed, and the input is not regrouped (the general
        path below copies it and all-reduces twice the bytes between the nodes)."""
        topo = self._topo
        if not self._nodes_in_order or self._cross is None:
            return False
        self.route_counts["sharded"] += 1
        n, width, nodes = out.numel(), len(topo.local_ranks), len(topo.nodes)
        work = plan.prepare(flat, always_copy=False)  # only read: no copy unless widened
        mine = torch.empty(nodes * n, dtype=work.dtype, device=work.device)
        parts = [mine[k * n : (k + 1) * n] for k in range(nodes)]
        # Every region's on-node stage is queued at once (spyreccl's progress thread runs them
        # back to back) while gloo's thread reduces the regions done. Running them on this
        # thread instead was 8 % slower at 16 MiB on the 2-CPU VM (two alternated runs).
        scatters = [
            self._local._reduce_scatter_base(
                parts[k],
                work[k * width * n : (k + 1) * width * n],
                self._rs_opts(plan.local_op, False),
            )
            for k in range(nodes)
        ]
        stages: list[_Stage] = []
        try:
            for k in range(nodes):
                self._wait(scatters[k])
                stages.append(self._start_host_reduce(self._cross, parts[k], plan.cross_op, k))
            for stage in stages:
                self._finish_stage(stage)
        except BaseException:
            self._abandon_stages(stages)
            raise
        out.copy_(plan.finish(parts[topo.node]).reshape(out.shape))
        return True

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if not self._on_spyre(outputs):
            return self._flat.reduce_scatter(outputs, input_lists, opts)

        def body() -> list[torch.Tensor]:
            out = outputs[0]
            ins = input_lists[0]
            self._check_list("reduce_scatter", "input_list", ins, out)
            flat = torch.cat([t.detach().reshape(-1) for t in ins])
            self._reduce_scatter_flat(flat, opts.reduceOp, out, owned=True)
            return outputs

        return self._run("reduce_scatter", body, _sig(outputs, opts.reduceOp), opts)

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if not self._on_spyre([output]):
            return self._flat._reduce_scatter_base(output, inp, opts)

        def body() -> list[torch.Tensor]:
            self._check_numel("reduce_scatter_tensor", inp, output.numel() * self._topo.size)
            flat = inp.detach().contiguous().view(-1)
            self._reduce_scatter_flat(flat, opts.reduceOp, output, owned=False)
            return [output]

        return self._run("reduce_scatter_tensor", body, _sig([output], opts.reduceOp), opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if not self._on_spyre(outputs):
            return self._flat.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

        def body() -> list[torch.Tensor]:
            for out, inp in zip(outputs, inputs, strict=True):
                self._check_numel("reduce_scatter_tensor", inp, out.numel() * self._topo.size)
                flat = inp.detach().contiguous().view(-1)
                self._reduce_scatter_flat(flat, opts.reduceOp, out, owned=False)
            return outputs

        return self._run(
            "reduce_scatter_tensor_coalesced", body, _sig(outputs, opts.reduceOp), opts
        )

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.GatherOptions()
        if not self._on_spyre(inputs):
            return self._flat.gather(output_lists, inputs, opts)

        def body() -> list[torch.Tensor]:
            # One gloo gather over every rank on host bytes: each block travels once, to the
            # root (a hierarchical all-gather would send every block to every node).
            inp = inputs[0]
            is_root = self._topo.rank == opts.rootRank
            if is_root:
                self._check_list("gather", "gather_list", output_lists[0], inp)
            host_in = self._staging.host_bytes(inp)
            host_outs = (
                [self._staging.host_bytes(out, fill=False) for out in output_lists[0]]
                if is_root
                else []
            )
            gopts = c10d.GatherOptions()
            gopts.rootRank = opts.rootRank
            self.route_counts["flat"] += 1
            self._gloo(lambda: self._flat.gather([host_outs] if is_root else [], [host_in], gopts))
            if not is_root:
                return []
            for out, host in zip(output_lists[0], host_outs, strict=True):
                self._staging.commit(out, host)
            return output_lists[0]

        return self._run("gather", body, _sig(inputs, None, opts.rootRank), opts)

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.ScatterOptions()
        if not self._on_spyre(outputs):
            return self._flat.scatter(outputs, input_lists, opts)

        def body() -> list[torch.Tensor]:
            # One gloo scatter over every rank on host bytes: each rank's block travels once,
            # from the root (a broadcast of the whole list would send all of it everywhere).
            out = outputs[0]
            is_root = self._topo.rank == opts.rootRank
            host_ins: list[torch.Tensor] = []
            if is_root:
                self._check_list("scatter", "scatter_list", input_lists[0], out)
                host_ins = [self._staging.host_bytes(t) for t in input_lists[0]]
            host_out = self._staging.host_bytes(out, fill=False)
            sopts = c10d.ScatterOptions()
            sopts.rootRank = opts.rootRank
            self.route_counts["flat"] += 1
            self._gloo(lambda: self._flat.scatter([host_out], [host_ins] if is_root else [], sopts))
            self._staging.commit(out, host_out)
            return outputs

        return self._run("scatter", body, _sig(outputs, None, opts.rootRank), opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        if not self._on_spyre([output, inp]):
            return self._flat.alltoall_base(
                output, inp, output_split_sizes, input_split_sizes, opts
            )
        if self._a2a_carried(output, inp, output_split_sizes, input_split_sizes):
            return self._carried_all_to_all(output, inp, opts)

        def body() -> list[torch.Tensor]:
            # gloo on host bytes: splits count rows (dim 0), scaled to bytes per row.
            def byte_splits(t: torch.Tensor, splits: list[int]) -> list[int]:
                if not splits:
                    return []
                row = (t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0) * t.element_size()
                return [int(s) * row for s in splits]

            host_in = self._staging.host_bytes(inp)
            # gloo must not write the output over input it has not sent yet.
            in_place = output.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
            host_out = (
                torch.empty(output.numel() * output.element_size(), dtype=torch.uint8)
                if in_place and output.numel()
                else self._staging.host_bytes(output, fill=False)
            )
            self._gloo(
                lambda: self._flat.alltoall_base(
                    host_out,
                    host_in,
                    byte_splits(output, list(output_split_sizes)),
                    byte_splits(inp, list(input_split_sizes)),
                    c10d.AllToAllOptions(),
                )
            )
            self._staging.commit(output, host_out)
            return [output]

        return self._run("all_to_all_single", body, _sig([], None, -1, inp.dtype), opts)

    all_to_all_single = alltoall_base

    def _a2a_carried(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> bool:
        """Whether an all_to_all_single travels in the check (_carried_all_to_all): checking
        on, 2 to EXCHANGE_MAX_LEADERS nodes, no split sizes (equal blocks), and what a node
        sends to the others at most CARRY_MAX_BYTES on every node. Decided alike on every rank
        from the call and the topology."""
        if not isinstance(self._checker, NodeChecker) or output_split_sizes or input_split_sizes:
            return False
        topo = self._topo
        if not 1 < len(topo.nodes) <= EXCHANGE_MAX_LEADERS:
            return False
        if output.dtype != inp.dtype or output.numel() != inp.numel():
            return False  # gloo's own error on the usual path names it
        world = topo.size
        nbytes = inp.numel() * inp.element_size()
        if nbytes == 0 or nbytes % world:
            return False
        widest = max(len(m) * (world - len(m)) for m in topo.nodes)
        return widest * (nbytes // world) <= CARRY_MAX_BYTES

    def _carried_all_to_all(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
        """A small all_to_all_single between nodes in the check's exchange: the node's ranks
        all-gather their inputs in shared memory (each then holds its blocks from its own
        node), the leaders exchange what their node sends to the others in the check's frame
        (_carry), and each leader broadcasts what its node received. Otherwise the check's
        round trip among the leaders and the outcome come first, then one gloo all_to_all
        over every rank (on the 2-CPU VM 2.8 ms against gloo's 1.2 ms for 8 bytes a pair:
        docs/performance.md, "Small all_to_all in the check")."""
        topo = self._topo
        world, me = topo.size, topo.rank
        members = topo.local_ranks
        width = len(members)
        plan = self._a2a_layout()

        def body() -> list[torch.Tensor]:
            flat_in = inp.detach().reshape(-1).view(torch.uint8)
            block = flat_in.numel() // world
            if width > 1:
                node_in = torch.empty(width * world * block, dtype=torch.uint8, device=inp.device)
                self._wait(
                    self._local._allgather_base(node_in, flat_in, self._ag_opts(blocking=True))
                )
            else:
                node_in = flat_in
            rows = self._staging.host_bytes(node_in).view(width, world, block)
            received = torch.empty(
                plan.received_blocks * block, dtype=torch.uint8, device=inp.device
            )
            leader = topo.local_rank == 0
            if leader:
                # What this node sends to the other nodes' ranks: sender by sender (local
                # order), receivers in rank order. Taken before the output is written (the
                # output may be the input).
                expected = [len(m) * (world - len(m)) * block for m in topo.nodes]
                payload = rows[:, plan.remote_of_mine, :].reshape(-1)
                parts = self._carry(payload, "all_to_all_single", expected)
                received_host = self._staging.host_bytes(received, fill=False)
                torch.cat([parts[k] for k in plan.other_nodes], out=received_host)
                self._staging.commit(received, received_host)
            if width > 1:
                self._local_broadcast(received, 0)
                if not leader:
                    received_host = self._staging.host_bytes(received)
            out = self._staging.host_bytes(output, fill=False).view(world, block)
            out[plan.local_senders] = rows[:, me, :]
            out[plan.remote_senders] = received_host.view(-1, block)[plan.remote_slots]
            self._staging.commit(output, out.reshape(-1))
            return [output]

        # The element count is part of what the ranks must agree on here (equal blocks): a
        # rank that passed split sizes while another did not is a mismatch on this path.
        sig = _sig([inp], None, -1, inp.dtype)
        return self._run("all_to_all_single", body, sig, opts, carry=True)

    def _a2a_layout(self) -> _A2ALayout:
        """Where a carried all_to_all's blocks go (_carried_all_to_all); the group's topology
        alone decides it, so it is worked out once."""
        if self._a2a_plan is None:
            self._a2a_plan = _A2ALayout(self._topo)
        return self._a2a_plan

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        if not self._on_spyre(outputs + inputs):
            return self._flat.alltoall(outputs, inputs, opts)

        def body() -> list[torch.Tensor]:
            host_in = self._staging.concat_bytes(inputs)
            out_sizes = [t.numel() * t.element_size() for t in outputs]
            in_sizes = [t.numel() * t.element_size() for t in inputs]
            host_out = torch.empty(sum(out_sizes), dtype=torch.uint8)
            self._gloo(
                lambda: self._flat.alltoall_base(
                    host_out, host_in, out_sizes, in_sizes, c10d.AllToAllOptions()
                )
            )
            offset = 0
            for t, size in zip(outputs, out_sizes, strict=True):
                self._staging.commit(t, host_out[offset : offset + size])
                offset += size
            return outputs

        return self._run(
            "all_to_all", body, _sig([], None, -1, inputs[0].dtype if inputs else None), opts
        )

    def barrier(self, opts: Any = None) -> dist.Work:
        def body() -> list[torch.Tensor]:
            # The control exchange over every rank is the barrier: a rank's all_reduce
            # completes once every rank has posted its part.
            pending, self._gate = self._exchange, None
            self._checker.verify(pending)
            return []

        return self._run("barrier", body, (), opts, exchange=True)

    # -- point to point --------------------------------------------------------------------

    def _p2p_error(self, what: str) -> Callable[[BaseException], BaseException]:
        def describe(error: BaseException) -> BaseException:
            self._failed = what
            return RuntimeError(f"spyreccl: {what} failed on {self._label()}: {error}")

        return describe

    def _post(self, what: str, post: Callable[[], Any]) -> tuple[AsyncWork, Callable[[], list]]:
        """Posts a point-to-point transfer through the executor, so that it reaches its
        sub-group after every collective issued before it (the peer issues them in the same
        order); posting does not wait for the transfer. Returns the posting's Work and a
        getter for the posted Work."""
        posted: list[Any] = []
        work = AsyncWork(what, self._p2p_seq, self._timeout, self._timed_out)

        def job() -> None:
            try:
                posted.append(post())
            except Exception as error:
                work.fail(error)
                return
            work.complete(None)

        self._executor.submit(job, inline_ok=True)
        return work, lambda: posted

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        if not self._on_spyre(tensors):
            return self._flat.send(tensors, dst, tag)
        self._p2p_seq += 1
        keep: list[torch.Tensor] = []
        if self._is_local(dst):
            where = "on the node"

            def post() -> Any:
                return self._local.send(tensors, self._topo.local_rank_of[dst], tag)
        else:
            where = "between nodes"

            def post() -> Any:
                # gloo reads it until the send completes (a view keeps the spyre memory).
                keep.append(self._staging.host_bytes(tensors[0]))
                return self._flat.send(keep[-1:], dst, tag)

        what = f"send seq {self._p2p_seq} to rank {dst} (tag {tag}, {where})"
        posting, posted = self._post(what, post)
        work = ThenWork(
            posted, None, tensors, keep=keep, describe=self._p2p_error(what), before=[posting]
        )
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        if not self._on_spyre(tensors):
            return self._flat.recv(tensors, src, tag)
        self._p2p_seq += 1
        t = tensors[0]
        after: Callable[[], None] | None = None
        host: torch.Tensor | None = None
        if self._is_local(src):
            where = "on the node"

            def post() -> Any:
                return self._local.recv(tensors, self._topo.local_rank_of[src], tag)
        else:
            where = "between nodes"
            host = self._staging.host_bytes(t, fill=False)

            def post() -> Any:
                return self._flat.recv([host], src, tag)

            def after() -> None:
                self._staging.commit(t, host)

        what = f"recv seq {self._p2p_seq} from rank {src} (tag {tag}, {where})"
        posting, posted = self._post(what, post)
        work = ThenWork(
            posted, after, tensors, keep=host, describe=self._p2p_error(what), before=[posting]
        )
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        raise RuntimeError(
            f"spyreccl: recv from any source (dist.recv without src) is not supported on "
            f"{self._label()}, whose ranks span several nodes; name the sender"
        )

    # -- coalescing: every operation above is queued (or posted) when issued, so a batch only
    # has to collect the Works and wait for all of them at its end.

    def _start_coalescing(self, device: torch.device) -> None:
        if self._coalesced is not None:
            raise RuntimeError(f"spyreccl: coalescing already started on {self._label()}")
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        works, self._coalesced = self._coalesced or [], None
        return ThenWork(works)

    # -- what torch's Python code asks of a group's backend, and split_group ---------------

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
            return HierarchicalProcessGroup(
                store, topo, options, name, global_ranks, options.timeout
            )
        backend = _C.ProcessGroupSpyreccl(store, topo.rank, topo.size, options)
        pg = dist.ProcessGroup(store, topo.rank, topo.size)
        backend_type = dist.ProcessGroup.BackendType.CUSTOM
        pg._register_backend(torch.device(_SPYRE), backend_type, backend)
        pg._set_default_backend(backend_type)
        pg._set_group_name(name)
        return pg

    # -- lifecycle -------------------------------------------------------------------------

    def abort(self) -> None:
        if self._failed is None:
            # As a single-node group's abort fails its peers' operations: the other ranks'
            # stages that wait for this one stop on the published failure.
            self._board.publish(ABORT_OP, self._seq, "abort() was called on the group")
            self._board.report()
        self._failed = self._failed or "aborted"
        self._stop("the group was aborted")
        self._abort_children()
        self._executor.close(0)

    def shutdown(self) -> None:
        if self._shut_down:
            return  # destroy_process_group, then the exit hook (see shut_down_live_groups)
        self._shut_down = True
        # Queued operations finish first (bounded: each stage has the group timeout).
        self._executor.close(self._timeout.total_seconds())
        self._local.shutdown()
        if self._check_local is not None:
            self._check_local.shutdown()
        gloo = [
            g
            for g in (self._cross, self._flat, self._check_group, self._check_leaders)
            if g is not None
        ]
        abandoned = [w for w in self._abandoned if not w.is_completed()]
        self._abandoned = []
        if self._stopped is not None or abandoned:
            # An abandoned gloo operation stays pending until gloo's timeout, and a gloo
            # group's destructor waits for it: a thread of its own keeps the groups until
            # then, so that destroy_process_group does not wait. It keeps the abandoned Works
            # too. Such a Work ends when its peer's process exits (the connection closes),
            # which may be while this interpreter finalizes (tests/reliability,
            # _exit_scenarios.py, scenario 3). Were gloo's worker to hold the last reference
            # then, it would release the stage's tensors on its own thread, and a tensor with
            # a Python object needs the GIL to be released, which Python refuses a thread
            # during finalization by ending it (an abort from C++ frames). With a reference
            # here, the Work is released by that thread while the interpreter is whole, or
            # never (a daemon thread's frame outlives the interpreter). The 2 x 2 test job
            # with a busy loop beside it aborted at exit after clean reports in 6 of 12 runs
            # without this, in none of 12 with it (2026-11-27). A core dump of one showed
            # the path: ProcessGroupGloo::runLoop destroying an AsyncAlltoallWork, whose
            # tensor's Python object (dead, kept by C++) went with it and took the GIL in
            # TensorImpl::decref_pyobject; Python ended the thread there. The window is a
            # release that starts just before the runtime flags itself as finalizing and
            # waits for the GIL across that moment (later ones leak the object instead);
            # tests/reliability/_exit_abandoned_stage.py opens it every time.
            self._cross = self._flat = self._check_group = self._check_leaders = None
            self._checker = None
            linger = self._timeout.total_seconds() + 5.0
            threading.Thread(
                target=_release_later,
                args=(gloo + abandoned, linger),
                name="spyreccl release",
                daemon=True,
            ).start()
            return
        for child in gloo:
            try:
                child.shutdown()
            except Exception:
                pass
        # Drop the gloo groups now, while the interpreter is whole: the last reference going
        # runs each one's destructor (torch releases the GIL for it), which joins gloo's
        # worker threads. Kept until finalization, a worker may still be releasing a finished
        # stage's tensors then; their Python objects need the GIL, which Python refuses by
        # ending the thread, and the process aborts (seen 1 run in 8 of a 2 x 2 job whose
        # script ended right after its last all_reduce).
        self._cross = self._flat = self._check_group = self._check_leaders = None
        self._checker = None
        child = None
        gloo.clear()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout
        for child in self._children():
            if child is not None:
                child.set_timeout(timeout)

    # -- argument checks -------------------------------------------------------------------

    def _check_list(
        self, op: str, arg: str, tensors: Sequence[torch.Tensor], like: torch.Tensor
    ) -> None:
        if len(tensors) != self._topo.size:
            raise ValueError(
                f"spyreccl: {op}: argument '{arg}' has {len(tensors)} tensors, expected one "
                f"per rank ({self._topo.size})"
            )
        for i, t in enumerate(tensors):
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(
                    f"spyreccl: {op}: {arg}[{i}] has {t.numel()} elements of {t.dtype}, "
                    f"expected {like.numel()} of {like.dtype}"
                )

    def _check_numel(self, op: str, t: torch.Tensor, expected: int) -> None:
        if t.numel() != expected:
            raise ValueError(
                f"spyreccl: {op}: the tensor has {t.numel()} elements, expected {expected} "
                f"(world size {self._topo.size} times the per-rank size)"
            )
