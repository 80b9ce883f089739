"""The benchmarked operations: buffer layouts and bus-bandwidth factors.

Importable without torch and numpy (the torch-free core rank processes load it by path).

Size semantics follow nccl-tests, so that our busbw numbers can be compared with theirs and
with the published numbers of other libraries:

========================  ===================================  ==========================
operation                  "size" of a row                     busbw = algbw x
========================  ===================================  ==========================
all_reduce                 bytes of the (in = out) buffer      2 (n-1) / n
all_reduce_inplace         bytes of the one buffer             2 (n-1) / n
all_gather_into_tensor     bytes of the gathered output        (n-1) / n
reduce_scatter_tensor      bytes of the scattered input        (n-1) / n
broadcast                  bytes of the buffer                 1
all_to_all_single          bytes each rank sends (all peers)   (n-1) / n
sendrecv                   bytes of one message                1 (time = half round trip)
barrier                    0                                   -
========================  ===================================  ==========================

algbw = size / time. busbw scales algbw so that it reflects the bytes each rank must move
through the interconnect (here: memory) regardless of n, which makes it comparable with the
bandwidth of the medium, here the single-thread memcpy bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPS", "Layout", "OpSpec", "layout", "op_names"]


@dataclass(frozen=True)
class OpSpec:
    name: str
    sized: bool  # False for barrier: it has no payload and is measured once
    description: str
    # Operations one timed step performs: a ping-pong step is two messages, and the time of
    # a row is per message (half the round trip, as in the OSU latency test).
    per_step: int = 1

    def bus_factor(self, nranks: int) -> float:
        n = nranks
        if self.name in ("all_reduce", "all_reduce_inplace"):
            return 2.0 * (n - 1) / n
        if self.name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            return (n - 1) / n
        return 1.0


OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec("all_reduce", True, "sum all-reduce, out of place (core) / in place (torch)"),
        # torch's all_reduce is in place; the core's and Open MPI's are timed in place here
        # too, so that the levels compare the same operation: a buffer reduced back to back
        # in place is read by the peers right after its owner wrote it, which an input that
        # never changes (all_reduce, core level) spares.
        OpSpec("all_reduce_inplace", True, "sum all-reduce in place, at every level"),
        OpSpec("all_gather_into_tensor", True, "all-gather into one flat tensor"),
        OpSpec("reduce_scatter_tensor", True, "sum reduce-scatter of one flat tensor"),
        OpSpec("broadcast", True, "broadcast from rank 0, in place"),
        OpSpec("all_to_all_single", True, "all-to-all of equal blocks of one flat tensor"),
        OpSpec("sendrecv", True, "ping-pong between ranks 0 and 1 (others idle)", per_step=2),
        OpSpec("barrier", False, "barrier"),
    )
}


def op_names() -> list[str]:
    return list(OPS)


@dataclass(frozen=True)
class Layout:
    """Element counts of one case. ``unit`` is the per-rank (or per-peer) element count."""

    op: str
    nbytes: int  # actual "size" of the row (nccl-tests semantics), after rounding
    unit: int  # elements: buffer (all_reduce, broadcast, sendrecv), per-rank or per-peer block
    send_elems: int
    recv_elems: int


def layout(op: str, nbytes: int, itemsize: int, nranks: int) -> Layout:
    """Buffer element counts for ``op`` at a requested size of ``nbytes``.

    Sizes are rounded down to whole elements (whole per-rank blocks for the collectives that
    split the buffer), with at least one element per block, so the reported size can differ
    from the requested one for tiny messages; duplicates are removed by the planner.
    """
    if op not in OPS:
        raise ValueError(f"layout: unknown operation {op!r}; expected one of {op_names()}")
    if itemsize < 1 or nranks < 1 or nbytes < 0:
        raise ValueError(
            f"layout({op}): expected itemsize >= 1, nranks >= 1, nbytes >= 0; got "
            f"itemsize={itemsize}, nranks={nranks}, nbytes={nbytes}"
        )
    if op == "barrier":
        return Layout(op, 0, 0, 0, 0)
    if op in ("all_reduce", "all_reduce_inplace", "broadcast", "sendrecv"):
        count = max(1, nbytes // itemsize)
        return Layout(op, count * itemsize, count, count, count)
    block = max(1, nbytes // (itemsize * nranks))
    total = block * nranks
    if op == "all_gather_into_tensor":
        return Layout(op, total * itemsize, block, block, total)
    if op == "reduce_scatter_tensor":
        return Layout(op, total * itemsize, block, total, block)
    # all_to_all_single: every rank sends one block to each rank (itself included).
    return Layout(op, total * itemsize, block, total, total)
