"""Detecting collectives that the ranks of a hierarchical group called differently.

Every collective's fingerprint (operation, sequence number, element count, dtype, reduce op,
root) is all-gathered over a gloo group of its own, *posted when the operation starts and
not waited for before data moves*: the exchange travels while the operation's stages run,
so a matching call pays no extra round trip on its path. When the fingerprints disagree,
the gloo callback that receives them aborts the group's data sub-groups at once (a stage
that waits for a peer busy with another operation stops instead of waiting for the
timeout), and the operation fails on every rank with a message that names each rank's
call. An operation that completes is only reported complete after its fingerprints were
seen to agree, so a mismatch never returns data as if it were right.

Why a separate gloo group: the data groups are aborted on a mismatch, and their operation
order must not depend on whether checking is on.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

_RedOp = dist.ReduceOp.RedOpType
_NAMES: dict[int, str] = {}
_ROW = 9  # op, seq, number of signature fields, up to 6 fields


def code(text: str) -> int:
    """A stable integer for a name (the same in every process, unlike hash())."""
    value = zlib.crc32(text.encode())
    _NAMES.setdefault(value, text)
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
    kind = (op.op if hasattr(op, "op") else op) if op is not None else None
    return (
        sum(t.numel() for t in tensors),
        code(str(dtype)),
        code(str(kind)),
        int(root),
    )


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
    """One operation's fingerprint exchange in flight."""

    def __init__(self, work: Any, everyone: torch.Tensor, mine: list[int]) -> None:
        self.work = work
        self.everyone = everyone
        self.mine = mine
        self.message: str | None = None  # set once the rows disagree
        self.done = threading.Event()


class CallChecker:
    """Posts every collective's fingerprint exchange and reports disagreements."""

    def __init__(
        self,
        group: Any,
        size: int,
        label: Callable[[], str],
        on_mismatch: Callable[[PendingCheck], None],
    ) -> None:
        self._group = group  # gloo over every rank of the hierarchical group
        self._size = size
        self._label = label
        self._on_mismatch = on_mismatch

    def post(self, op_name: str, seq: int, sig: Sequence[int]) -> PendingCheck:
        row = [code(op_name), seq, len(sig), *sig, *([0] * (_ROW - 3 - len(sig)))]
        mine = torch.tensor(row, dtype=torch.int64)
        everyone = torch.empty(self._size * _ROW, dtype=torch.int64)
        work = self._group._allgather_base(everyone, mine, c10d.AllgatherOptions())
        pending = PendingCheck(work, everyone, row)

        def received(future: Any) -> None:
            try:
                future.value()
            except Exception:
                pending.done.set()  # the exchange itself failed: verify() reports it
                return
            pending.message = self._compare(pending, seq)
            pending.done.set()
            if pending.message is not None:
                self._on_mismatch(pending)

        work.get_future().add_done_callback(received)
        return pending

    def verify(self, pending: PendingCheck, timeout_s: float) -> None:
        """Raises MismatchError when the fingerprints disagreed (waiting for them, within
        `timeout_s`; a failed exchange raises gloo's error)."""
        if not pending.done.wait(timeout_s):
            pending.work.wait()  # gloo's own timeout raises its error
        if pending.message is None:
            pending.work.wait()  # raises when the exchange failed
        if pending.message is not None:
            raise MismatchError(pending.message)

    def _compare(self, pending: PendingCheck, seq: int) -> str | None:
        rows = pending.everyone.view(self._size, _ROW).tolist()
        if all(row == rows[0] for row in rows):
            return None
        seqs_differ = any(row[1] != rows[0][1] for row in rows)
        calls = "; ".join(
            f"rank {r}: {describe_call(row)}" + (f" as seq {row[1]}" if seqs_differ else "")
            for r, row in enumerate(rows)
        )
        return (
            f"spyreccl: mismatched collectives on {self._label()} at seq {seq} "
            f"({_differences(rows)} differ): {calls}"
        )
