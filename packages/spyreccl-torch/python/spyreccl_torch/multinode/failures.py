"""How a failure on one rank of a hierarchical group reaches every other rank quickly.

A hierarchical operation is a chain of stages, and the ranks of one operation are not all
in the same stage at the same time. When a stage fails on one rank (a peer on its node died,
a gloo error, a timed-out wait), the others may be waiting in a stage that this rank will
never enter. Two mechanisms bring them out:

- **On the node**: the failing rank aborts its node's spyreccl communicator; the core then
  fails its node peers' waits on it at once (spyrecclRemoteError: the peer left).
- **Between nodes**: gloo cannot be told to stop a pending operation, and gloo only notices
  a dead peer whose socket it reads from: a rank whose gloo peer is alive but never enters
  the stage (it failed in an on-node stage), or whose gloo peer gave up on the operation
  (its own gloo error), waits until gloo's timeout. So the failing rank *publishes* the
  failure in the group's c10d store (one key, first writer wins: the operation, its
  sequence number, the rank, its node and its error), and a rank waiting in a gloo stage
  waits in slices of SLICE_S (gloo's Work.wait(timeout) raises on timeout and the Work
  stays pending, so it can be waited for again) and looks for a published failure between
  slices: one store lookup per slice, and none at all for a stage that completes within
  the first slice (the fast path costs nothing). It then stops waiting and fails with the
  published failure as its cause, and aborts its own node's communicator in turn.

The gloo operation a rank stopped waiting for stays pending until gloo's timeout (gloo
cannot cancel it): the group keeps those gloo groups alive on a thread of its own until
then (HierarchicalProcessGroup.shutdown), so that the process does not wait for them.

After a failure every rank also reports it under a key of its own and waits a moment
(SPYRECCL_MULTINODE_FAILURE_WINDOW_S) for the others' reports, so that its error can name
the ranks that never reported: the dead (or stuck) ones.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

# How long a gloo stage is waited for before the waiter looks for a published failure (and
# between two looks). Each look is one store round trip.
SLICE_S = 0.1
_SLICE = datetime.timedelta(seconds=SLICE_S)

_KEY = "spyreccl/failure"
ABORT_OP = "abort"  # the operation name of a failure published by abort()
_REPORT_PREFIX = "spyreccl/failed/"
_MESSAGE_CHARS = 600  # a published error is cut to this (spyreccl's carry state dumps)


class PeerFailure(dist.DistBackendError):
    """This rank stopped waiting because another rank published a failure of the group."""


def _first_lines(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


class FailureBoard:
    """The group's failure records in its c10d store (see the module docstring)."""

    def __init__(self, store: Any, rank: int, node_of: list[int] | tuple[int, ...]) -> None:
        self._store = store
        self._rank = rank
        self._node_of = node_of
        self._seen: dict | None = None
        # Set when a lookup failed: the store is gone (with the process that hosted it) or
        # unreachable, and each further lookup could block up to the store's timeout;
        # waiters then rely on gloo's own errors and timeout alone.
        self._unusable = False
        # Called when this rank sees the group fail (the flight recorder's dump, flight.py).
        self.on_failure: Callable[[], None] | None = None

    def clear(self) -> None:
        """Removes what an earlier group of the same name left in the same store (a group
        re-created after a failure, whose store outlived it: torchrun's agent's store keeps
        its keys). Called by every rank before it connects the group's gloo sub-groups:
        that connection waits for every rank, so no rank of the new group publishes before
        every rank has cleared."""
        for key in (_KEY, f"{_REPORT_PREFIX}{self._rank}"):
            try:
                self._store.delete_key(key)
            except Exception:
                pass

    def publish(self, op_name: str, seq: int, error: BaseException | str) -> None:
        """Records that `op_name` seq `seq` failed on this rank, unless a failure is
        recorded already (the first one is the cause the others report). Best effort: the
        store may be gone with the process that hosted it."""
        record = {
            "op": op_name,
            "seq": seq,
            "rank": self._rank,
            "node": self._node_of[self._rank],
            "error": _first_lines(str(error)),
        }
        try:
            self._store.compare_set(_KEY, "", json.dumps(record))
        except Exception:
            pass

    def published(self) -> dict | None:
        """The failure another rank published, or None (one store lookup)."""
        if self._seen is not None or self._unusable:
            return self._seen
        try:
            if not self._store.check([_KEY]):
                return None
            record = json.loads(self._store.get(_KEY))
        except Exception:
            self._unusable = True
            return None
        self._seen = record
        return record

    def _on_failure(self) -> None:
        if self.on_failure is not None:
            try:
                self.on_failure()
            except Exception:
                pass

    @staticmethod
    def describe(record: dict) -> str:
        if record["op"] == ABORT_OP:
            return (
                f"the group was aborted on rank {record['rank']} (node {record['node']}) after "
                f"its seq {record['seq']}: {record['error']}"
            )
        return (
            f"{record['op']} seq {record['seq']} failed on rank {record['rank']} (node "
            f"{record['node']}): {record['error']}"
        )

    def report(self) -> None:
        """Records that this rank saw the group fail (see silent_ranks), without waiting."""
        self._on_failure()
        try:
            self._store.set(f"{_REPORT_PREFIX}{self._rank}", "1")
        except Exception:
            pass

    def silent_ranks(self, window_s: float) -> list[int] | None:
        """Reports this rank's failure and waits up to `window_s` for every other rank's
        report; returns the ranks that did not report (None: the store failed)."""
        self._on_failure()
        try:
            self._store.set(f"{_REPORT_PREFIX}{self._rank}", "1")
            deadline = time.monotonic() + window_s
            silent = [r for r in range(len(self._node_of)) if r != self._rank]
            while silent:
                silent = [r for r in silent if not self._store.check([f"{_REPORT_PREFIX}{r}"])]
                if not silent or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except Exception:
            return None
        return silent


def wait_sliced(work: Any, between: Callable[[], None]) -> None:
    """Waits for the gloo Work `work` in slices of SLICE_S, calling `between()` after each
    slice that ended without completion (it raises to stop waiting). gloo's own timeout
    still bounds the wait: the Work then completes with gloo's error, raised here."""
    while True:
        try:
            work.wait(_SLICE)
            return
        except Exception:
            # Either the slice ran out ("Operation timed out!", the Work still pending), or
            # the Work completed with an error (or completed just after the slice ran
            # out): a wait without limit then returns or raises gloo's own outcome.
            if work.is_completed():
                work.wait()
                return
        between()
