"""Detecting collectives that the ranks of a hierarchical group called differently.

Every collective's fingerprint (operation, sequence number, element count, dtype, reduce op,
root) is exchanged over a gloo group of its own (the control group), *posted when the
operation starts*: the on-node stages run while it travels, and the operation's first gloo
stage waits for it (HierarchicalProcessGroup._gloo), so a rank never posts a gloo operation
that its peers called differently (gloo cannot cancel one). When the fingerprints
disagree, the gloo callback that receives them aborts the node's spyreccl group at once (a
stage that waits for a peer busy with another operation stops instead of waiting for the
timeout), and the operation fails on every rank with a message that names each rank's
call. An operation is only reported complete after its fingerprints were seen to agree,
so a mismatch never returns data as if it were right. A barrier is the exchange alone.

Why a separate gloo group: the data groups' operation order must not depend on whether
checking is on.

With checking on, a group compares the digests node by node instead (node_check.py: shared
memory within a node, gloo among the leaders only); this module's exchange over every rank
still names the calls of a mismatch and serves barriers when checking is off.

Why the first gloo stage waits for the exchange instead of being posted alongside it (which
would hide the exchange's round trip, 300-400 us on an idle 16-core machine, behind the
data stage): gloo does not survive mismatched operations. Measured with torch 2.13's gloo
(2 and 4 ranks, one rank calling differently): all_reduce of 7 against 8 elements, or of 7
against 100000, terminates the receiving process (gloo::EnforceNotMet "Received data size
doesn't match expected size", thrown on gloo's thread: std::terminate); all_reduce against
broadcast or all-gather hangs until gloo's timeout and leaves the gloo group unusable
("Application timeout caused pair closure"); broadcasts from different roots over 4 ranks
completed on every rank with wrong data. Checking the fingerprints before returning would
still catch the last kind, and sliced waits the second, but nothing can catch a process
that gloo aborts: a mismatch must fail on every rank with MismatchError, so no gloo data
operation is posted before the fingerprints were seen to agree. What does overlap the
exchange: the operation's on-node stages before its first gloo stage (the leader and
sharded routes start with one), and with async_op=True the caller's computation.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .reduction import op_kind

_RedOp = dist.ReduceOp.RedOpType
_NAMES: dict[int, str] = {}
_ROW = 9  # op, seq, number of signature fields, up to 6 fields


def code(text: str) -> int:
    """A stable integer for a name (the same in every process, unlike hash())."""
    value = _CODES.get(text)
    if value is None:
        value = _CODES[text] = zlib.crc32(text.encode())
        _NAMES.setdefault(value, text)
    return value


# Every operation's fingerprint is computed on the critical path of a small collective (tens of
# microseconds of Python per call add up: docs/notes/multinode-small-messages.md, "The small path's
# Python cost"), so the codes of names, dtypes and reduce ops are looked up, not recomputed.
_CODES: dict[str, int] = {}
_OBJECT_CODES: dict[Any, int] = {}


def _code_of(obj: Any) -> int:
    """code(str(obj)) for a dtype or a reduce-op kind, cached by the object."""
    value = _OBJECT_CODES.get(obj)
    if value is None:
        value = _OBJECT_CODES[obj] = code(str(obj))
    return value


# Names another rank may send that this one has not used yet (for describe_call).
for _name in [
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "gather",
    "scatter",
    "all_to_all_single",
    "all_to_all",
    "barrier",
    "None",
]:
    code(_name)
for _value in vars(torch).values():
    if isinstance(_value, torch.dtype):
        code(str(_value))
for _kind in _RedOp.__members__.values():
    code(str(_kind))


def signature(
    tensors: Sequence[torch.Tensor],
    op: Any = None,
    root: int = -1,
    dtype: torch.dtype | None = None,
) -> tuple[int, ...]:
    """What every rank of a collective must agree on: element count, dtype, reduce op, root."""
    if dtype is None and tensors:
        dtype = tensors[0].dtype
    kind = op_kind(op) if op is not None else None
    numel = tensors[0].numel() if len(tensors) == 1 else sum(t.numel() for t in tensors)
    return (numel, _code_of(dtype), _code_of(kind), int(root))


def describe_call(row: list[int]) -> str:
    op, _seq, n = row[0], row[1], row[2]
    name = _NAMES.get(op, f"operation #{op}")
    if n < 4:
        return f"{name}()"
    numel, dtype, kind, root = row[3:7]
    text = f"{name}(numel={numel}, {_NAMES.get(dtype, dtype)}"
    if _NAMES.get(kind, "None") != "None":
        text += f", {_NAMES.get(kind, kind)}"
    return text + (f", root={root})" if root >= 0 else ")")


def _differences(rows: list[list[int]]) -> str:
    """Which fields differ, in words (the first thing a reader looks for)."""
    fields = ["operation", "sequence number", "", "element count", "dtype", "reduce op", "root"]
    names = [
        name for i, name in enumerate(fields) if name and any(row[i] != rows[0][i] for row in rows)
    ]
    return ", ".join(names) or "call"


class MismatchError(RuntimeError):
    """The ranks of a group called different collectives (or the same one differently)."""


class PendingCheck:
    """One operation's exchange in flight (see CallChecker)."""

    def __init__(
        self,
        work: Any,
        sums: torch.Tensor | list[int],
        mine: list[int],
        digest: int,
        op_name: str = "",
    ) -> None:
        self.work = work
        self.op_name = op_name
        self.sums = sums  # after the exchange: [max digest, max -digest] over every rank
        self.mine = mine
        self.digest = digest
        self.compare = True
        self.mismatched = False  # set by the gloo callback or verify()
        self.message: str | None = None  # once the fingerprints were gathered
        self.done = threading.Event()


def fingerprint_row(op_name: str, seq: int, sig: Sequence[int]) -> list[int]:
    """One operation's fingerprint: operation, sequence number, the signature's length and
    fields, zero-padded to a fixed row (all-gathered to name each rank's call)."""
    return [code(op_name), seq, len(sig), *sig, *([0] * (_ROW - 3 - len(sig)))]


def digest_of(row: list[int]) -> int:
    """62 bits of a hash of the fingerprint (so that its negation is exact in int64)."""
    data = struct.pack(f"<{len(row)}q", *row)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


class CallChecker:
    """The control group's exchanges: one gloo all_reduce (MAX) of two int64 per operation,
    [d, -d] where d is a 62-bit digest of the fingerprint. Every rank gets max(d) and
    -min(d), so every rank sees whether all digests are equal (max = min = its own); only
    then, on every rank alike, are the fingerprints themselves all-gathered, to name each
    rank's call.

    Two elements, an all_reduce: measured here, gloo's all_reduce of fewer elements than ranks takes
    about a third of the time of its all-gather of the whole fingerprints
    (docs/notes/multinode-small-messages.md). Every exchange has the same shape whatever the
    operation, so gloo matches the exchanges of ranks that called different operations.

    Why a small reduction's data does not ride in the exchange (which would save its own
    gloo stage): the exchange must have one shape for every call (above), so the data would
    need a fixed frame of free slots in every exchange, and gloo reduces fewer elements than
    ranks with a faster algorithm than more. 4 ranks on a 2-vCPU machine, gloo all_reduce of
    float64, median µs, two runs: 2 elements 510 / 499, 3: 1099 / 855, 4: 3085 / 2308,
    16: 3862 / 4799, 134: 7586 / 4289. Tried on 2026-11-26 with a 134-element frame (a
    digest and 128 payload slots): 8-512 B all_reduces were no faster
    (`spyreccl-bench --nodes 2 --nproc 2`, three interleaved runs: 4.2-7.7 ms against
    4.4-5.4 ms), and every other operation's check became several times slower."""

    def __init__(
        self,
        group: Any,
        size: int,
        label: Callable[[], str],
        on_mismatch: Callable[[PendingCheck], None],
        on_error: Callable[[PendingCheck, BaseException], None] | None = None,
        wait: Callable[[Any], None] | None = None,
    ) -> None:
        self._group = group
        self._size = size
        self._label = label
        self._on_mismatch = on_mismatch
        self._on_error = on_error
        # How to wait for an exchange (the group's sliced gloo wait: it stops when another
        # rank published a failure); a plain wait() by default.
        self._wait = wait or (lambda work: work.wait())
        from .. import _C  # loaded before this package (spyreccl_torch/__init__.py)

        # Not the Work's future.add_done_callback: an exchange abandoned after a failure stays
        # pending in gloo until its timeout, and a Python callback that gloo's thread runs
        # while the interpreter exits aborts the process (see the backend's exit_guard.h).
        self._add_callback = _C._add_guarded_callback

    def post(self, op_name: str, seq: int, sig: Sequence[int], compare: bool = True) -> Any:
        """Starts the exchange of this rank's fingerprint; `compare` False: only the
        exchange (a barrier; checking is off)."""
        row = fingerprint_row(op_name, seq, sig)
        digest = digest_of(row) if compare else 0
        sums = torch.tensor([digest, -digest], dtype=torch.int64)
        opts = c10d.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        work = self._group.allreduce([sums], opts)
        pending = PendingCheck(work, sums, row, digest, op_name)
        pending.compare = compare
        if not compare:
            pending.done.set()
            return pending

        def received(failure: str | None) -> None:
            if failure is not None:
                pending.done.set()  # the exchange itself failed: verify() reports it
                if self._on_error is not None:
                    self._on_error(pending, RuntimeError(failure))
                return
            pending.mismatched = self._differs(pending)
            pending.done.set()
            if pending.mismatched:
                self._on_mismatch(pending)

        self._add_callback(work, received)
        return pending

    def verify(self, pending: PendingCheck, before_stage: bool = False) -> None:
        """Waits for the exchange (gloo's timeout bounds it; a failed exchange raises gloo's
        error) and raises MismatchError when the fingerprints disagreed (every rank does:
        they all see it, and gather the fingerprints to name the calls). `before_stage` is
        NodeChecker's; every rank waits in gloo here."""
        self._wait(pending.work)
        if not pending.compare or not self._differs(pending):
            return
        pending.mismatched = True
        if pending.message is None:
            pending.message = self.describe(pending)
        raise MismatchError(pending.message)

    def settle(self, pending: PendingCheck, wait_s: float) -> bool:
        """Waits up to `wait_s` for the exchange's outcome (after a stage failed: was a
        mismatch the cause?); whether the fingerprints disagreed."""
        pending.done.wait(wait_s)
        return pending.mismatched

    def finish(self, pending: PendingCheck) -> None:
        """Completes this rank's part of an exchange whose operation ended early (arguments
        rejected before anything moved; the group stays usable). Every rank posted its part
        already: nothing is left to do."""

    @staticmethod
    def _differs(pending: PendingCheck) -> bool:
        sums = pending.sums
        top, neg_bottom = sums if isinstance(sums, list) else sums.tolist()
        return top != pending.digest or -neg_bottom != pending.digest

    def describe(self, pending: PendingCheck) -> str:
        """Gathers every rank's fingerprint and names each rank's call."""
        seq = pending.mine[1]
        mine = torch.tensor(pending.mine, dtype=torch.int64)
        everyone = torch.empty(self._size * _ROW, dtype=torch.int64)
        try:
            self._group._allgather_base(everyone, mine, c10d.AllgatherOptions()).wait()
        except Exception as error:
            return (
                f"spyreccl: mismatched collectives on {self._label()} at seq {seq}: this rank "
                f"called {describe_call(pending.mine)}; the others' calls could not be "
                f"gathered ({error})"
            )
        rows = everyone.view(self._size, _ROW).tolist()
        seqs_differ = any(row[1] != rows[0][1] for row in rows)
        calls = "; ".join(
            f"rank {r}: {describe_call(row)}" + (f" as seq {row[1]}" if seqs_differ else "")
            for r, row in enumerate(rows)
        )
        return (
            f"spyreccl: mismatched collectives on {self._label()} at seq {seq} "
            f"({_differences(rows)} differ): {calls}"
        )
