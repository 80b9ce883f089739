"""How a hierarchical group (hierarchical.py) fails: the error a failed operation reports (the
mismatch behind it, the first failure any rank published, the ranks that stayed silent), a
wait() that ran out of time, stopping the group and aborting its sub-groups so that every
rank's stages stop within moments, and the gloo Works a rank stops waiting for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from . import flight, stage_flight
from .failures import FailureBoard, PeerFailure
from .fingerprint import MismatchError, PendingCheck
from .stages import _Stage
from .works import AsyncWork


class FailureHandling:
    """The failure handling of HierarchicalProcessGroup (a mixin of it: it uses the group's
    failure board, checker and sub-groups)."""

    def _mismatch_behind(
        self, pending: PendingCheck | None, error: Exception, wait_s: float | None
    ) -> Exception:
        """The MismatchError behind `error` when this operation's fingerprints disagreed
        (waiting up to `wait_s` for them, None: the failure window), else `error`."""
        if pending is None or not pending.compare or isinstance(error, MismatchError):
            return error
        if wait_s is None:
            wait_s = min(self._failure_window_s, self._timeout.total_seconds())
        checker = self._checker
        if checker is None or not checker.settle(pending, wait_s):
            return error
        try:
            checker.verify(pending)
        except MismatchError as mismatch:
            return mismatch
        except Exception:
            pass
        return error

    def _on_mismatch(self, pending: PendingCheck) -> None:
        """The checker saw the ranks disagree (on gloo's thread): stop this operation's data
        stages now, which may be waiting for peers busy with something else."""
        self._mismatch = pending
        try:
            self._local.abort()  # its waiters on this node stop too
        except Exception:
            pass

    def _timed_out(self, work: AsyncWork, limit: float) -> BaseException:
        """A wait() on `work` ran out of time: the group fails (its sub-groups are aborted, so
        the executor's stage stops too)."""
        what = f"{work.op_name} seq {work.seq}"
        error = dist.DistBackendError(
            f"spyreccl: {what} did not complete within {limit:g} s on {self._label()} "
            f"(the group timeout, or the wait's); the group is aborted"
        )
        # The Work carries the timeout before the aborts below make its running stage fail
        # with an error of its own.
        work.fail(error)
        if self._failed is None:
            self._failed = f"{what} timed out"
        self._stop(f"{what} timed out")
        self._abort_children()
        # The other ranks may wait for this one in a stage it will not finish: they stop on
        # the published failure instead of waiting for their own timeout.
        self._board.publish(
            work.op_name, work.seq, f"a wait() ran out after {limit:g} s; the group was aborted"
        )
        self._board.report()  # not silent: the others need not wait for this rank's report
        return error

    def _fail(self, op_name: str, seq: int, error: BaseException) -> RuntimeError:
        first = self._failed is None
        self._failed = self._failed or f"{op_name} seq {seq}"
        mismatch = self._mismatch
        mismatched = isinstance(error, MismatchError) or (
            mismatch is not None and mismatch.message is not None
        )
        if first and not mismatched and not isinstance(error, PeerFailure):
            # Published before the aborts below, so that a rank of this node that they stop
            # finds this failure as the cause (see _published_cause).
            self._board.publish(op_name, seq, error)
        # This node's ranks that wait for this one in an on-node stage fail at once (the
        # core reports the abort to them), the other nodes' through the published failure.
        self._abort_children()
        if mismatched:
            # Every rank sees a mismatch in the exchange: nothing to publish, nobody silent to
            # wait for; the flight recorder dumps here (once per group) on every rank.
            flight.failed(self)
        if isinstance(error, MismatchError):
            return error
        if mismatch is not None and mismatch.message is not None:
            # A stage stopped because the checker aborted it: the mismatch is the cause.
            return MismatchError(mismatch.message)
        if not first:
            return dist.DistBackendError(
                f"spyreccl: {op_name} seq {seq} failed on {self._label()}: {error}"
            )
        silent = self._who_failed()
        # The failure that started it all, when this rank's error is a consequence of it (a
        # stage aborted by a peer, a gloo error because a peer gave up, or what this rank's
        # exchange saw on gloo's thread): a store lookup, on the failure path only.
        record = self._board.published()
        origin = ""
        if (
            record is not None
            and not isinstance(error, PeerFailure)  # that one names it already
            and record["error"].removesuffix("...") not in " ".join(str(error).split())
        ):
            origin = f"; first failure reported: {FailureBoard.describe(record)}"
        return dist.DistBackendError(
            f"spyreccl: {op_name} seq {seq} failed on {self._label()}: {error}{silent}{origin}"
        )

    def _who_failed(self) -> str:
        """Which ranks did not fail along: every rank that sees the group fail says so in
        the store and waits a moment for the others. The aborts and the published failure
        (failures.py) make the failure reach every live rank within a fraction of a second,
        so the ranks that stay silent are the dead (or stuck) ones. gloo's errors name a
        socket address and the node's spyreccl names local ranks; this names group ranks.
        Best effort: the store may be gone with the failed process."""
        topo = self._topo
        window = min(self._failure_window_s, self._timeout.total_seconds())
        silent = self._board.silent_ranks(window)
        if not silent:
            return ""
        names = ", ".join(f"rank {r} (node {topo.node_of[r]})" for r in silent)
        return (
            f"; ranks that did not report this failure within {window:g} s (failed, or "
            f"stuck elsewhere): {names}"
        )

    def _children(self) -> tuple[Any, ...]:
        """The sub-groups (None where this rank has none)."""
        return (
            self._local,
            self._check_local,
            self._cross,
            self._flat,
            self._check_group,
            self._check_leaders,
        )

    def _abort_children(self) -> None:
        for child in self._children():
            if child is None:
                continue
            try:
                child.abort()
            except Exception:
                pass

    def _published_cause(self, error: BaseException | None) -> BaseException | None:
        """The failure another rank published, as the reason this rank stopped waiting
        (PeerFailure); `error` when none was published."""
        record = self._board.published()
        if record is None:
            return error
        return PeerFailure(f"stopped waiting for the other ranks: {FailureBoard.describe(record)}")

    def _abandon_stages(self, stages: Sequence[_Stage]) -> None:
        """Notes the posted gloo stages of an operation that failed on this rank (_abandon)."""
        for stage in stages:
            if stage.work is not None:
                self._abandon(stage.work)

    def _abandon(self, work: Any) -> None:
        """Notes a gloo Work that this rank no longer waits for (see shutdown)."""
        if work is None:
            return  # a check that posted no gloo operation on this rank (node_check.py)
        stage_flight.forget(work)  # its flight recorder entry stays started
        self._abandoned = [w for w in self._abandoned if not w.is_completed()]
        if not work.is_completed():
            self._abandoned.append(work)

    def _on_exchange_error(self, pending: PendingCheck, error: BaseException) -> None:
        """The control exchange of an operation failed on this rank (on gloo's thread): a
        peer died, or gave up on the exchange. This rank may be waiting in an on-node stage
        for a rank of its node that waits in a gloo stage for this rank's exchange data:
        publish the failure (the gloo stage's waiter stops on it) and stop this rank's
        on-node stage."""
        if self._failed is not None or self._stopped is not None:
            return
        self._board.publish(pending.op_name, pending.mine[1], error)
        try:
            self._local.abort()
        except Exception:
            pass

    def _stop(self, why: str) -> None:
        """Marks the group stopped: no further gloo stage starts (see _post_gloo)."""
        self._stopped = self._stopped or why
