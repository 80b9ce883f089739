"""Reduction plans of a hierarchical group (see hierarchical.py).

gloo moves host memory and reduces fewer dtypes than spyreccl: a :class:`Plan` says in which
dtype a reduction is computed across the stages and which op each stage applies, so that the
result matches the single-node path's (16- and 8-bit floats in float32 rounded once, AVG
dividing the exact total once, booleans as bytes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_NARROW_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2})
_RedOp = dist.ReduceOp.RedOpType


def op_kind(op: Any) -> Any:
    """The RedOpType of a reduce op given as a ReduceOp (which PREMUL_SUM's factor makes an
    object) or as its RedOpType."""
    return op.op if hasattr(op, "op") else op


def validate_reduction(kind: Any, dtype: torch.dtype) -> None:
    """Rejects what spyreccl.h does not define, before anything is communicated, with the
    single-node backend's message: bitwise ops on floats, AVG of booleans, PREMUL_SUM on
    anything but floats."""
    is_float = dtype.is_floating_point or dtype.is_complex
    bad = (
        (kind in (_RedOp.BAND, _RedOp.BOR, _RedOp.BXOR) and is_float)
        or (kind == _RedOp.AVG and dtype == torch.bool)
        or (kind == _RedOp.PREMUL_SUM and not is_float)
    )
    if bad:
        raise ValueError(f"spyreccl: ReduceOp.{kind.name} is not supported for dtype {dtype}")


class Plan:
    """How one reduction is carried out: the dtype it is computed in, and the ops for the
    on-node and the between-nodes stages."""

    def __init__(self, op: Any, dtype: torch.dtype, size: int) -> None:
        kind = op_kind(op)
        validate_reduction(kind, dtype)
        self.kind = kind
        self.dtype = dtype
        self.size = size
        self.work_dtype = dtype
        if dtype in _NARROW_FLOATS:
            self.work_dtype = torch.float32
        elif dtype == torch.int16:  # gloo has no int16 kernels; wraps the same in int32
            self.work_dtype = torch.int32
        elif dtype == torch.bool:
            self.work_dtype = torch.uint8
        elif dtype == torch.complex32:
            self.work_dtype = torch.complex64
        elif dtype == torch.uint32:  # gloo has no uint32; int64 holds every value
            self.work_dtype = torch.int64
        if kind == _RedOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
            if dtype == torch.uint64:
                raise ValueError(
                    "spyreccl: ReduceOp.AVG of torch.uint64 is not supported when the group's "
                    "ranks span several nodes (the exact total needs more than 64 bits); "
                    "reduce with SUM and divide"
                )
            self.work_dtype = torch.int64  # the exact total, truncated once at the end
        self.local_op = op
        self.cross_op: Any = op
        if kind == _RedOp.AVG:
            self.local_op = self.cross_op = dist.ReduceOp.SUM
        elif kind == _RedOp.PREMUL_SUM:
            # The factor applies once, to every input, on its node; the node totals add up.
            self.cross_op = dist.ReduceOp.SUM
        if dtype == torch.bool:
            # Booleans: SUM is a logical or, PRODUCT a logical and (on 0/1 bytes).
            mapped = {_RedOp.SUM: dist.ReduceOp.MAX, _RedOp.PRODUCT: dist.ReduceOp.MIN}
            if kind in mapped:
                self.local_op = self.cross_op = mapped[kind]

    def prepare(self, t: torch.Tensor, always_copy: bool) -> torch.Tensor:
        if self.work_dtype != t.dtype:
            return t.to(self.work_dtype)
        return t.clone() if always_copy else t

    def finish(self, work: torch.Tensor) -> torch.Tensor:
        """The result in the caller's dtype."""
        if self.kind == _RedOp.AVG:
            if work.dtype.is_floating_point:
                work = work / self.size
            else:
                work = torch.div(work, self.size, rounding_mode="trunc")
        if self.dtype == torch.bool:
            return work != 0
        return work.to(self.dtype) if work.dtype != self.dtype else work


# How an exchange between nodes combines two contributions, by reduce op (exchange_ok).
_COMBINE = {
    _RedOp.SUM: torch.add,
    _RedOp.PRODUCT: torch.mul,
    _RedOp.MIN: torch.minimum,
    _RedOp.MAX: torch.maximum,
    _RedOp.BAND: torch.bitwise_and,
    _RedOp.BOR: torch.bitwise_or,
    _RedOp.BXOR: torch.bitwise_xor,
}
_EXCHANGE_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8}
)


def exchange_ok(dtype: torch.dtype, op: Any) -> bool:
    """Whether combine_in_order can reduce a stage's work tensor of `dtype` with `op` (a
    stage's op: AVG and PREMUL_SUM are SUM between nodes, see Plan)."""
    kind = op_kind(op)
    return kind in _COMBINE and dtype in _EXCHANGE_DTYPES


def combine_in_order(
    parts: list[torch.Tensor], op: Any, out: torch.Tensor | None = None
) -> torch.Tensor:
    """parts[0] op parts[1] op ... in list order: every rank that combines the same parts
    in the same order gets the same bits. Into `out` (shaped like the parts, not
    overlapping them) when given."""
    kind = op_kind(op)
    fn = _COMBINE[kind]
    if len(parts) == 1:
        return parts[0].clone() if out is None else out.copy_(parts[0])
    # The first two parts straight into the result: one operation fewer than copying the
    # first one there (small reductions of two nodes are a handful of operations in all).
    acc = fn(parts[0], parts[1]) if out is None else fn(parts[0], parts[1], out=out)
    for part in parts[2:]:
        fn(acc, part, out=acc)
    return acc
