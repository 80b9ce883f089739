"""Turning per-rank samples into the numbers of a result row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Summary", "combine_ranks", "summarize"]


@dataclass(frozen=True)
class Summary:
    """Distribution of per-iteration times, in microseconds."""

    iters: int
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    max_us: float
    mean_us: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def combine_ranks(per_rank: Sequence[Sequence[int] | None]) -> np.ndarray:
    """Per-iteration time of the operation from the samples (ns) of every rank.

    Like nccl-tests, which averages each rank's time over the ranks, the time of iteration i
    is the mean over the ranks that took part (sendrecv: ranks 0 and 1 only). Every rank ran
    the same number of iterations (they agreed on it), which is checked here.
    """
    arrays = [np.asarray(s, dtype=np.float64) for s in per_rank if s is not None]
    if not arrays:
        raise ValueError("combine_ranks: no rank reported samples for this case")
    lengths = {a.size for a in arrays}
    if len(lengths) != 1:
        raise ValueError(
            f"combine_ranks: ranks reported different iteration counts {sorted(lengths)}; "
            "the ranks must agree on the loop length"
        )
    return np.mean(np.stack(arrays), axis=0)


def summarize(samples_ns: np.ndarray) -> Summary:
    if samples_ns.size == 0:
        raise ValueError("summarize: no samples")
    us = samples_ns * 1e-3
    p10, p50, p90 = np.percentile(us, [10, 50, 90])
    return Summary(
        iters=int(us.size),
        median_us=float(p50),
        p10_us=float(p10),
        p90_us=float(p90),
        min_us=float(us.min()),
        max_us=float(us.max()),
        mean_us=float(us.mean()),
    )


def bandwidths(nbytes: int, time_us: float, bus_factor: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second, as nccl-tests)."""
    if time_us <= 0 or nbytes == 0:
        return 0.0, 0.0
    algbw = nbytes / (time_us * 1e-6) / 1e9
    return algbw, algbw * bus_factor
