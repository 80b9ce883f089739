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
so a mismatch never returns data as if it were right. Small reductions and barriers ride
in the exchange itself (the inline route): their check costs nothing extra.

Why a separate gloo group: the data groups' operation order must not depend on whether
checking is on.
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
    """One operation's exchange in flight: every rank's record (fingerprint row, then the
    inline payload slot)."""

    def __init__(self, work: Any, everyone: torch.Tensor, mine: list[int], size: int) -> None:
        self.work = work
        self.everyone = everyone  # uint8, one record per rank
        self.mine = mine
        self.size = size
        self.compare = True
        self.watched = False  # compared by the gloo callback (else by verify)
        self.message: str | None = None  # set once the rows disagree
        self.done = threading.Event()

    @property
    def mismatched(self) -> bool:
        return self.message is not None

    def rows(self) -> list[list[int]]:
        records = self.everyone.view(self.size, -1)
        return records[:, :_ROW_BYTES].contiguous().view(torch.int64).tolist()

    def payloads(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Every rank's inline payload as a [ranks, numel] tensor of `dtype` (host)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        records = self.everyone.view(self.size, -1)
        return records[:, _ROW_BYTES : _ROW_BYTES + nbytes].contiguous().view(dtype)


_ROW_BYTES = _ROW * 8


class CallChecker:
    """The control group's exchanges: one gloo all-gather over every rank per operation, of
    a record per rank: the fingerprint row, then an inline slot where operations small
    enough put their data (HierarchicalProcessGroup's inline route; zeros otherwise).

    Every record has the same size (depending only on the slot), so that gloo matches the
    exchanges of ranks that called different operations, whatever they called. (An
    all-gather, not sums in an all_reduce: gloo's all_reduce of more elements than ranks
    took longer here than its all-gather of a few hundred bytes.)"""

    def __init__(
        self,
        group: Any,
        rank: int,
        size: int,
        inline_bytes: int,
        label: Callable[[], str],
        on_mismatch: Callable[[PendingCheck], None],
    ) -> None:
        self._group = group
        self._size = size
        self.inline_bytes = max(0, inline_bytes) // 8 * 8
        self._record = _ROW_BYTES + self.inline_bytes
        self._label = label
        self._on_mismatch = on_mismatch

    def post(
        self,
        op_name: str,
        seq: int,
        sig: Sequence[int],
        payload: torch.Tensor | None = None,
        compare: bool = True,
        watch: bool = True,
    ) -> PendingCheck:
        """Starts the exchange of this rank's record (`payload`: at most inline_bytes of
        host uint8). `compare` False only moves the payloads (checking is off). `watch`:
        compare as soon as the records arrive (on gloo's thread), so that a mismatch stops
        the operation's on-node stages at once; without it, verify() compares (cheaper: no
        hand-off between threads, for operations whose only stage is the exchange)."""
        row = [code(op_name), seq, len(sig), *sig, *([0] * (_ROW - 3 - len(sig)))]
        mine = torch.zeros(self._record, dtype=torch.uint8)
        mine[:_ROW_BYTES].view(torch.int64).copy_(torch.tensor(row, dtype=torch.int64))
        if payload is not None and payload.numel():
            mine[_ROW_BYTES : _ROW_BYTES + payload.numel()].copy_(payload)
        everyone = torch.empty(self._size * self._record, dtype=torch.uint8)
        work = self._group._allgather_base(everyone, mine, c10d.AllgatherOptions())
        pending = PendingCheck(work, everyone, row, self._size)
        pending.compare = compare
        if not watch:
            return pending

        def received(future: Any) -> None:
            try:
                future.value()
            except Exception:
                pending.done.set()  # the exchange itself failed: verify() reports it
                return
            if compare:
                pending.message = self._compare(pending, seq)
            pending.done.set()
            if pending.message is not None:
                self._on_mismatch(pending)

        pending.watched = True
        work.get_future().add_done_callback(received)
        return pending

    def verify(self, pending: PendingCheck, timeout_s: float) -> None:
        """Waits for the exchange (within `timeout_s`; a failed exchange raises gloo's
        error) and raises MismatchError when the fingerprints disagreed."""
        if not pending.watched:
            pending.work.wait()  # gloo's own timeout raises its error
            if pending.compare:
                pending.message = self._compare(pending, pending.mine[1])
            pending.done.set()
        elif not pending.done.wait(timeout_s):
            pending.work.wait()  # gloo's own timeout raises its error
        if pending.message is None:
            pending.work.wait()  # raises when the exchange failed
        if pending.message is not None:
            raise MismatchError(pending.message)

    def _compare(self, pending: PendingCheck, seq: int) -> str | None:
        rows = pending.rows()
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
