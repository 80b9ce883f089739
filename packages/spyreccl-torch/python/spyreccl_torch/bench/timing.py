"""The timed loop shared by every benchmark level (core, spyreccl, gloo).

This module must stay importable without torch and without numpy: the rank processes of
the ``core`` level load it by file path (see ``core_worker.py``) so that they never import
the ``spyreccl_torch`` package, whose ``__init__`` imports torch.

Methodology (in the spirit of nccl-tests, with per-iteration samples):

1. ``warmup`` untimed iterations (a size-dependent constant, identical on every rank, so
   that every rank issues the same number of collectives).
2. The per-iteration time of the last warm-up iterations is estimated on every rank and the
   ranks agree on the maximum (through the level's own collective), so that every rank runs
   the same number of timed iterations: ``target_s / estimate`` clamped to
   ``[min_iters, max_iters]``.
3. The timed iterations run in batches; the ranks are aligned by a barrier before each
   batch, and each call is timed individually (``perf_counter_ns`` around the call and the
   device synchronisation), which gives a distribution rather than only a mean.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LoopPolicy", "measure", "measure_case", "warmup_iters"]

# Number of timed batches (each preceded by a barrier) a case is split into at most.
_MAX_BATCHES = 20

# Fewest timed iterations of a case, whatever its cost (see LoopPolicy.max_case_s).
_FLOOR_ITERS = 5

# Iterations a sample loop needs before the per-iteration estimate is trusted.
_ESTIMATE_SKIP = 1


def warmup_iters(nbytes: int) -> int:
    """Untimed warm-up iterations for a message of ``nbytes``.

    Small messages need many iterations to reach a steady state (caches, branch predictors,
    the transport's spin/yield heuristics); a large one is dominated by its first-touch page
    faults, which one or two calls absorb. The count only depends on the size so that every
    rank computes the same value without communicating.
    """
    if nbytes <= 64 << 10:
        return 20
    if nbytes <= 1 << 20:
        return 10
    if nbytes <= 16 << 20:
        return 4
    return 2


@dataclass(frozen=True)
class LoopPolicy:
    """How long a (level, op, size) case runs."""

    target_s: float = 0.2  # wall time of the timed iterations per case
    min_iters: int = 10  # at least this many samples (p10/p90 need a handful) ...
    max_iters: int = 2000  # bound on samples per case (memory, total run time)
    # ... unless min_iters calls would take longer than this: very large messages on a slow
    # backend (gloo, 256 MiB) then get fewer, but at least _FLOOR_ITERS, samples.
    max_case_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.target_s > 0:
            raise ValueError(f"LoopPolicy: target_s must be > 0 seconds, got {self.target_s}")
        if self.min_iters < 1 or self.max_iters < self.min_iters:
            raise ValueError(
                "LoopPolicy: expected 1 <= min_iters <= max_iters, got "
                f"min_iters={self.min_iters}, max_iters={self.max_iters}"
            )

    def iterations(self, estimate_s: float) -> int:
        """Timed iterations for a call that takes about ``estimate_s`` seconds."""
        if estimate_s <= 0 or not math.isfinite(estimate_s):
            return self.max_iters
        floor = self.min_iters
        if estimate_s * floor > self.max_case_s:
            floor = max(min(_FLOOR_ITERS, self.min_iters), int(self.max_case_s / estimate_s))
        return max(floor, min(self.max_iters, int(self.target_s / estimate_s)))


def measure_case(
    step: Callable[[], object] | None,
    barrier: Callable[[], object],
    agree_max: Callable[[float], float],
    *,
    nbytes: int,
    policy: LoopPolicy,
) -> list[int] | None:
    """:func:`measure` of one sweep case of ``nbytes`` with its size's warm-up.

    ``step`` None: this rank has no part in the case (the idle ranks of a send/recv ping-pong);
    it still joins every barrier and agreement of the loop, and reports None.
    """
    samples = measure(
        step if step is not None else (lambda: None),
        barrier,
        agree_max,
        warmup=warmup_iters(nbytes),
        policy=policy,
    )
    return samples if step is not None else None


def measure(
    step: Callable[[], object],
    barrier: Callable[[], object],
    agree_max: Callable[[float], float],
    *,
    warmup: int,
    policy: LoopPolicy,
    fixed_iters: int | None = None,
) -> list[int]:
    """Runs one case and returns the per-iteration times in nanoseconds.

    ``step`` performs one complete operation (including the device synchronisation when the
    level has one). ``barrier`` aligns the ranks. ``agree_max`` returns the maximum of a float
    over all ranks; it is a collective, so every rank must call ``measure`` with the same
    ``warmup`` and ``policy``. With ``fixed_iters`` the estimate/agreement phase is skipped.
    """
    if warmup < 1:
        raise ValueError(f"measure: warmup must be >= 1 iteration, got {warmup}")
    clock = time.perf_counter_ns
    warm: list[int] = []
    barrier()
    for _ in range(warmup):
        t0 = clock()
        step()
        warm.append(clock() - t0)

    if fixed_iters is not None:
        iters = fixed_iters
    else:
        # The median of the warm-up tail is robust to the first-touch outlier; agreeing on
        # the maximum makes the slowest rank's view decide, and keeps the counts identical.
        tail = sorted(warm[_ESTIMATE_SKIP:] or warm)
        local_estimate = tail[len(tail) // 2] * 1e-9
        iters = policy.iterations(agree_max(local_estimate))

    batches = min(_MAX_BATCHES, iters)
    per_batch, extra = divmod(iters, batches)
    samples: list[int] = []
    for b in range(batches):
        barrier()
        for _ in range(per_batch + (1 if b < extra else 0)):
            t0 = clock()
            step()
            samples.append(clock() - t0)
    return samples
