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

This module holds the group's construction, its dispatch of operations to the executor
(_run), coalescing and its lifecycle (abort, shutdown); the class is assembled from one mixin
per concern: the routes of the reductions (reduction_routes.py), of broadcast, all_gather,
gather and scatter (gather_routes.py) and of all_to_all (all_to_all.py), send and recv
(point_to_point.py), split_group (splitting.py), the stages they are built from (stages.py)
and the failure handling (failure_handling.py). The settings read from the environment are
in settings.py.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._group_identity import SelfNamedGroup
from . import flight
from .all_to_all import AllToAllRoutes, _A2ALayout
from .executor import OrderedExecutor
from .failure_handling import FailureHandling
from .failures import ABORT_OP, FailureBoard
from .fingerprint import CallChecker, MismatchError, PendingCheck
from .gather_routes import GatherRoutes
from .gloo_groups import gloo_group
from .node_check import NodeChecker
from .pipeline import agree_chunk_bytes, proposed_chunk_bytes
from .point_to_point import PointToPoint
from .reduction import Plan as _Plan
from .reduction_routes import ReductionRoutes
from .settings import (
    CHECK_ENV,
    DEFAULT_EXCHANGE_MAX_BYTES,
    DEFAULT_FLAT_MAX_BYTES,
    DEFAULT_SHARDED_MIN_BYTES,
    EXCHANGE_MAX_BYTES_ENV,
    FAILURE_WINDOW_ENV,
    FLAT_MAX_BYTES_ENV,
    SHARDED_MIN_BYTES_ENV,
    _timeout_of,
    _yield_ns_from_env,
)

# Read from here by importers of this module (the tests among them).
from .settings import YIELD_NS_ENV as YIELD_NS_ENV
from .splitting import Splitting
from .stage_flight import RecordedGloo
from .stages import _SPYRE, Stages
from .staging import HostStaging, zero_copy_available
from .topology import Topology
from .works import AsyncWork, ThenWork

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


class HierarchicalProcessGroup(
    ReductionRoutes,
    GatherRoutes,
    AllToAllRoutes,
    PointToPoint,
    Splitting,
    Stages,
    FailureHandling,
    SelfNamedGroup,
    dist.ProcessGroup,
):
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
        # The data groups between nodes record their stages (stage_flight.py).
        if len(cross_ranks) > 1:
            self._cross = RecordedGloo(
                gloo_group(
                    dist.PrefixStore(f"spyreccl/cross{topology.local_rank}/", store),
                    cross_ranks.index(topology.rank),
                    len(cross_ranks),
                    self._timeout,
                    self,
                ),
                self,
                f"cross{topology.local_rank}",
                [self._global_ranks[r] for r in cross_ranks],
            )
        self._flat = RecordedGloo(
            gloo_group(
                dist.PrefixStore("spyreccl/flat/", store),
                topology.rank,
                topology.size,
                self._timeout,
                self,
            ),
            self,
            "flat",
            self._global_ranks,
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

    # getBackendName, name and the group name/description getters: SelfNamedGroup.

    @property
    def topology(self) -> Topology:
        return self._topo

    def __repr__(self) -> str:
        return (
            f"HierarchicalProcessGroup('{self._name}', rank {self._topo.rank} of "
            f"{self._topo.size}, {len(self._topo.nodes)} nodes)"
        )

    # -- dispatch ------------------------------------------------------------------------

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
        call = flight.take_issued()  # this call's flight recorder entry, if recorded

        def job() -> None:
            previous = flight.enter(call)  # started; its gloo stages are its children
            try:
                run()
            finally:
                flight.leave(previous)

        def run() -> None:
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

    def barrier(self, opts: Any = None) -> dist.Work:
        def body() -> list[torch.Tensor]:
            # The control exchange over every rank is the barrier: a rank's all_reduce
            # completes once every rank has posted its part.
            pending, self._gate = self._exchange, None
            self._checker.verify(pending)
            return []

        return self._run("barrier", body, (), opts, exchange=True)

    # -- coalescing: every operation above is queued (or posted) when issued, so a batch only
    # has to collect the Works and wait for all of them at its end.

    def _start_coalescing(self, device: torch.device) -> None:
        if self._coalesced is not None:
            raise RuntimeError(f"spyreccl: coalescing already started on {self._label()}")
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        works, self._coalesced = self._coalesced or [], None
        return ThenWork(works)

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
