"""The stages of a hierarchical group's operations (hierarchical.py): the on-node spyreccl
stages, the gloo stages between nodes (posted only once the operation's check passed, waited
for in slices that stop when the group fails), the reductions between nodes (gloo's ring, an
exchange, or carried in the check's exchange among the leaders) and _Stage, a posted gloo
stage with what completes its result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from . import stage_flight
from .failures import wait_sliced
from .node_check import NodeChecker
from .reduction import combine_in_order as _combine_in_order
from .reduction import exchange_ok as _exchange_ok
from .reduction import op_kind as _op_kind

_SPYRE = "spyre"


_RedOp = dist.ReduceOp.RedOpType


_SIGN_BIT = -(2**63)  # int64 with only the sign bit set


class _Stage:
    """A posted gloo stage: its Work (None: nothing was posted) and what completes its
    result once the Work is done."""

    __slots__ = ("after", "work")

    def __init__(self, work: Any, after: Callable[[], None]) -> None:
        self.work = work
        self.after = after


def _gloo_view(host: torch.Tensor, op: Any) -> tuple[torch.Tensor, bool]:
    """A view of `host` that gloo can reduce with `op`, and whether its sign bits were
    flipped (flip them back in the result). gloo reduces neither complex nor uint64
    tensors: complex sums are sums of (real, imaginary) pairs; uint64 wraps like int64 for
    SUM/PRODUCT/bitwise ops, and keeps its order for MIN/MAX once the sign bit is flipped."""
    kind = _op_kind(op)
    if host.is_complex():
        return torch.view_as_real(host), False
    if host.dtype == torch.uint64:
        view = host.view(torch.int64)
        flip = kind in (_RedOp.MIN, _RedOp.MAX)
        if flip:
            view.bitwise_xor_(_SIGN_BIT)
        return view, flip
    return host, False


class Stages:
    """The stage plumbing of HierarchicalProcessGroup (a mixin of it: it uses the group's
    sub-groups, host staging and checker, and its failure handling)."""

    @staticmethod
    def _wait(work: Any) -> None:
        """Waits for an on-node (spyreccl) stage: aborting the node's group stops it."""
        if work is not None:
            work.wait()

    def _gloo(self, post: Callable[[], Any]) -> None:
        """Posts a gloo stage (`post` returns its Work, see _post_gloo) and waits for it."""
        self._wait_gloo_work(self._post_gloo(post))

    def _post_gloo(self, post: Callable[[], Any]) -> Any:
        """Posts a gloo stage and returns its Work. The first gloo stage of an operation
        waits for the operation's fingerprints first: a rank posts gloo operations only once
        every rank was seen to call the same collective, so a mismatch never leaves a gloo
        operation that no peer will match (gloo cannot cancel one: it would stay pending
        until gloo's timeout). The on-node stages before it overlap the exchange. A stage
        is never started once the group was stopped (an expired wait() on this group's
        Work, abort()): the check comes before post(), since the peers would complete a
        posted stage with this rank's data (the check exchange may complete after the group
        stopped, within one slice of its wait)."""
        if self._gate is not None:
            pending, self._gate = self._gate, None
            self._checker.verify(pending, before_stage=True)
        if self._stopped is not None:
            raise RuntimeError(f"stopped before a stage: {self._stopped}")
        return post()

    def _wait_gloo_work(self, work: Any) -> None:
        """Waits for a gloo Work in gloo's own blocking wait (the GIL is released; gloo's
        timeout, the group's, bounds it), in slices (failures.wait_sliced): between slices
        it stops when another rank published a failure of the group or this group was
        stopped, instead of waiting for gloo's timeout. The Work stays pending (gloo cannot
        cancel it; see shutdown). Waking through the Work's future instead cost two GIL
        hand-offs and a condition wake-up per stage: an 8-byte flat all_reduce took 618 us
        against gloo's 304 on an idle 16-core machine; a sliced wait is gloo's wait."""

        def between() -> None:
            why = None
            if self._stopped is not None:
                why = RuntimeError(f"stopped while waiting for a gloo stage: {self._stopped}")
            else:
                why = self._published_cause(None)
            if why is not None:
                self._abandon(work)
                raise why

        try:
            wait_sliced(work, between)
        except BaseException:
            stage_flight.forget(work)
            raise
        stage_flight.completed(work)

    @staticmethod
    def _on_spyre(tensors: Sequence[torch.Tensor]) -> bool:
        return all(t.device.type == _SPYRE for t in tensors)

    # The on-node stages that this thread waits for at once are posted as blocking calls
    # (asyncOp False): spyreccl then runs them on this thread when its progress thread is
    # idle, instead of handing each to that thread and being woken when it is done.

    @staticmethod
    def _rs_opts(op: Any, blocking: bool) -> Any:
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = op
        opts.asyncOp = not blocking
        return opts

    @staticmethod
    def _ag_opts(blocking: bool) -> Any:
        opts = c10d.AllgatherOptions()
        opts.asyncOp = not blocking
        return opts

    def _local_reduce_to_leader(self, t: torch.Tensor, op: Any, leader: int = 0) -> None:
        if self._alone and _op_kind(op) != _RedOp.PREMUL_SUM:
            # The node's only rank holds its node's part already (PREMUL_SUM's reduce still
            # applies the factor).
            return
        opts = c10d.ReduceOptions()
        opts.reduceOp = op
        opts.rootRank = leader
        opts.rootTensor = 0
        opts.asyncOp = False
        self._wait(self._local.reduce([t], opts))

    def _local_broadcast(self, t: torch.Tensor, root: int) -> None:
        if self._alone:
            return  # nobody else on the node to receive it
        opts = self._broadcast_opts.get(root)
        if opts is None:  # made once per root: options cost microseconds to build
            opts = self._broadcast_opts[root] = c10d.BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            opts.asyncOp = False
        self._wait(self._local.broadcast([t], opts))

    def _cross_all_reduce(self, t: torch.Tensor, op: Any) -> None:
        """All-reduces `t` (spyre or host) among this rank's cross group, through the host."""
        self._finish_stage(self._start_cross_all_reduce(t, op))

    def _start_cross_all_reduce(self, t: torch.Tensor, op: Any) -> _Stage:
        """Posts the all_reduce of `t` among this rank's cross group (see _cross_all_reduce);
        `t` holds the result once the returned stage is finished (_finish_stage)."""
        if self._cross is None:
            return _Stage(None, lambda: None)
        nbytes = t.numel() * t.element_size()
        size = self._cross.size()
        if _exchange_ok(t.dtype, op) and size <= 8 and nbytes <= self._exchange_max_bytes:
            self.cross_counts["exchange"] += 1
            return self._start_exchange_reduce(self._cross, t, op)
        self.cross_counts["ring"] += 1
        return self._start_host_reduce(self._cross, t, op)

    def _finish_stage(self, stage: _Stage) -> None:
        """Waits for a posted gloo stage (see _wait_gloo_work) and completes its result."""
        if stage.work is not None:
            self._wait_gloo_work(stage.work)
        stage.after()

    def _start_exchange_reduce(self, group: Any, t: torch.Tensor, op: Any) -> _Stage:
        """Posts the all_reduce of `t` over the gloo `group` by exchanging contributions:
        one gloo all_to_all gives every rank every rank's host copy, which each combines in
        group-rank order (the same bits everywhere). gloo's all_to_all is a direct exchange,
        its all_reduce a ring of 2 (n - 1) steps: measured here with torch 2.13's gloo, 16
        float64 took 90-118 us against 191-327 us between 2 ranks, 0.6-0.7 ms against
        4.6-5.1 ms between 4 (docs/performance.md). Between 2 nodes it moves the same bytes
        as the ring."""
        host = self._staging.host(t)
        n = group.size()
        flat = host.reshape(-1)
        sent = flat.unsqueeze(0).expand(n, -1).contiguous().reshape(-1)
        got = torch.empty_like(sent)
        splits = [flat.numel()] * n

        def after() -> None:
            # Combined straight into `host` (t's memory where it is a view): `sent` holds
            # the contribution, so t may be overwritten.
            _combine_in_order(list(got.view(n, -1).unbind(0)), op, out=flat)
            self._staging.commit(t, host)

        post = lambda: group.alltoall_base(got, sent, splits, splits, c10d.AllToAllOptions())  # noqa: E731
        return _Stage(self._post_gloo(post), after)

    def _host_reduce(self, group: Any, t: torch.Tensor, op: Any, root: int | None = None) -> None:
        """All-reduces `t` (spyre or host, contiguous) over the gloo `group` in place, or
        reduces it to `root`: then only the root's `t` holds the result, and the other
        ranks' `t` is scratch (gloo's reduce may write partial results into its buffer;
        callers reduce buffers of their own)."""
        self._finish_stage(self._start_host_reduce(group, t, op, root))

    def _start_host_reduce(
        self, group: Any, t: torch.Tensor, op: Any, root: int | None = None
    ) -> _Stage:
        """Posts _host_reduce's gloo stage; `t` holds the result once it is finished."""
        host = self._staging.host(t)
        view, flip = _gloo_view(host, op)
        if root is None:
            opts = c10d.AllreduceOptions()
            opts.reduceOp = op
            post = lambda: group.allreduce([view], opts)  # noqa: E731
        else:
            ropts = c10d.ReduceOptions()
            ropts.reduceOp = op
            ropts.rootRank = root
            ropts.rootTensor = 0
            post = lambda: group.reduce([view], ropts)  # noqa: E731

        def after() -> None:
            if root is not None and group.rank() != root:
                return
            if flip:
                view.bitwise_xor_(_SIGN_BIT)
            self._staging.commit(t, host)

        return _Stage(self._post_gloo(post), after)

    def _carry_capable(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether this rank's stage between the nodes for one tensor could travel in the
        check's exchange at all (a leader of up to EXCHANGE_MAX_LEADERS, checking on)."""
        checker = self._checker
        return isinstance(checker, NodeChecker) and checker.carries and len(tensors) == 1

    def _carrying(self) -> bool:
        """Whether the running operation's check exchange waits for data to carry (it was
        deferred for it: _carries, _carries_gather)."""
        return NodeChecker.waiting_to_carry(self._gate)

    def _carry(
        self, payload: torch.Tensor | None, what: str, expected: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Sends `payload` (flat uint8 on the host, None: nothing) in this operation's check
        exchange among the leaders and returns every leader's, in node order (only while
        _carrying()). `expected`: the bytes each node's leader must have carried for the
        operation `what`, the same calls on every rank (the check said so); other sizes mean
        the group's settings differ between ranks (they must not: user guide)."""
        if self._stopped is not None:
            raise RuntimeError(f"stopped before a stage: {self._stopped}")  # as _post_gloo
        pending, self._gate = self._gate, None
        parts = self._checker.carry(pending, payload)
        self.cross_counts["carried"] += 1
        sizes = [part.numel() for part in parts]
        if expected is not None and sizes != list(expected):
            raise RuntimeError(
                f"the leaders carried {sizes} bytes of the same {what}, expected "
                f"{list(expected)}; SPYRECCL_MULTINODE_* settings must be the same on every rank"
            )
        return parts
