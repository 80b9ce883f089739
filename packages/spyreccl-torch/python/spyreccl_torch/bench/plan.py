"""What a sweep measures: message sizes, data types and the list of cases."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .ops import OPS, layout

__all__ = ["DTYPES", "Case", "DTypeInfo", "build_plan", "parse_size", "pow2_sizes"]


@dataclass(frozen=True)
class DTypeInfo:
    name: str
    itemsize: int
    numpy: str  # numpy dtype of the core-level buffers (bfloat16 travels as uint16 bits)
    reinterpret: bool  # True when spyreccl_core must be told the real type explicitly


DTYPES: dict[str, DTypeInfo] = {
    d.name: d
    for d in (
        DTypeInfo("float32", 4, "float32", False),
        DTypeInfo("float64", 8, "float64", False),
        DTypeInfo("float16", 2, "float16", False),
        DTypeInfo("bfloat16", 2, "uint16", True),
        DTypeInfo("int32", 4, "int32", False),
        DTypeInfo("int64", 8, "int64", False),
        DTypeInfo("int8", 1, "int8", False),
        DTypeInfo("uint8", 1, "uint8", False),
    )
}

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """'8', '8B', '64K', '1M', '256MiB' -> bytes (binary units, as nccl-tests' -b/-e)."""
    s = text.strip().lower().replace(" ", "")
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits) :]
    if not digits or unit not in _UNITS:
        raise ValueError(
            f"size {text!r}: expected a number with an optional unit B, K, M or G (e.g. 64K)"
        )
    try:
        value = float(digits)
    except ValueError:
        raise ValueError(f"size {text!r}: {digits!r} is not a number") from None
    nbytes = int(value * _UNITS[unit])
    if nbytes < 0:
        raise ValueError(f"size {text!r}: must not be negative")
    return nbytes


def pow2_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Geometric size series min, min*factor, ... <= max (nccl-tests' -b/-e/-f)."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(
            f"sizes: expected 1 <= min <= max, got min={min_bytes} B, max={max_bytes} B"
        )
    if factor < 2:
        raise ValueError(f"sizes: the multiplication factor must be >= 2, got {factor}")
    sizes = []
    s = min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


@dataclass(frozen=True)
class Case:
    index: int
    op: str
    requested: int  # the size asked for (bytes)
    nbytes: int  # the size measured, nccl-tests semantics (see ops.py)
    unit: int
    send_elems: int
    recv_elems: int

    def to_dict(self) -> dict:
        return asdict(self)


def build_plan(ops: list[str], sizes: list[int], itemsize: int, nranks: int) -> list[Case]:
    """Cases in measurement order: op-major, sizes ascending, duplicates removed.

    Rounding to whole elements/blocks can map two requested sizes onto the same buffers
    (e.g. 8 B and 16 B of float32 all-gather at 3 ranks): such a case is measured once.
    barrier is a single case. sendrecv needs ranks 0 and 1, so it is dropped at one rank.
    """
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown operation(s) {unknown}; expected some of {list(OPS)}")
    cases: list[Case] = []
    for op in ops:
        if op == "sendrecv" and nranks < 2:
            continue
        seen: set[int] = set()
        for requested in sizes if OPS[op].sized else [0]:
            lay = layout(op, requested, itemsize, nranks)
            if lay.nbytes in seen:
                continue
            seen.add(lay.nbytes)
            cases.append(
                Case(
                    len(cases), op, requested, lay.nbytes, lay.unit, lay.send_elems, lay.recv_elems
                )
            )
    return cases
