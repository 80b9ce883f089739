"""What the modes read from the parsed command line: the size series, the timing policy,
the plot path. Below ``cli`` (which builds the parser) and the modes (which import this), so
that no mode imports the command line module."""

from __future__ import annotations

import argparse
import os

from .plan import pow2_sizes
from .timing import LoopPolicy

__all__ = ["matplotlib_missing", "plot_path", "policy_from", "sizes_from"]


def sizes_from(args: argparse.Namespace, default_min: int, default_max: int) -> list[int]:
    """The size series of --min/--max/--factor, each bound defaulting per mode."""
    lo = default_min if args.min_bytes is None else args.min_bytes
    hi = default_max if args.max_bytes is None else args.max_bytes
    return pow2_sizes(lo, hi, args.factor)


def policy_from(args: argparse.Namespace) -> LoopPolicy:
    return LoopPolicy(
        target_s=args.time_per_size,
        min_iters=args.min_iters,
        max_iters=args.max_iters,
        max_case_s=max(2.0, 10 * args.time_per_size),
    )


def plot_path(args: argparse.Namespace, json_path: str) -> str | None:
    """The PNG to draw, or None (--no-plot, or matplotlib missing: see matplotlib_missing)."""
    if args.no_plot:
        return None
    return args.plot or os.path.splitext(json_path)[0] + ".png"


def matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False
