"""The machine's single-thread memcpy bandwidth: the yardstick for a shared-memory busbw.

A shared-memory collective moves every byte through memory at least once per hop, with one
thread per rank, so a single thread's memcpy bandwidth is what one rank can hope to reach;
busbw is reported as a fraction of it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["MemcpyResult", "measure_memcpy"]


@dataclass(frozen=True)
class MemcpyResult:
    nbytes: int
    repeats: int
    median_gbps: float  # bytes copied per second / 1e9 (reads and writes not double-counted)
    p10_gbps: float
    p90_gbps: float

    def to_dict(self) -> dict:
        return asdict(self)


def measure_memcpy(nbytes: int = 128 << 20, repeats: int = 15) -> MemcpyResult:
    """Times ``np.copyto`` (a plain memcpy for contiguous arrays) of ``nbytes``.

    The size is far beyond the last-level cache so that DRAM is measured, and both arrays
    are written before timing so that no page fault lands in the timed copies.
    """
    if nbytes < 64 << 20:
        raise ValueError(
            f"measure_memcpy: use at least 64 MiB to defeat the caches, got {nbytes} B"
        )
    if repeats < 3:
        raise ValueError(f"measure_memcpy: need at least 3 repeats, got {repeats}")
    src = np.empty(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    src.fill(1)
    dst.fill(0)
    np.copyto(dst, src)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    p10, p50, p90 = np.percentile(rates, [10, 50, 90])
    return MemcpyResult(nbytes, repeats, float(p50), float(p10), float(p90))
