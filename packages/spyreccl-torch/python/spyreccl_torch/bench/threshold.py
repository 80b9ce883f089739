"""``--mode threshold``: where should all_reduce switch from one-shot to two-phase?

spyreccl_core picks its all_reduce algorithm by size: up to SPYRECCL_ALLREDUCE_ONESHOT_MAX
bytes (capped by the staging chunk, 1 MiB by default) every rank publishes its whole input and
reduces all n copies (one synchronisation, n-fold reads); above it, a pipelined reduce-scatter +
all-gather (each byte reduced once, but two exchanges per block). The variable is read when a
communicator is created, so each candidate value runs in its own set of rank processes.

The run times the core-level all_reduce for every size under each value, at every requested
world size, and reports per world size the crossover: the smallest size from which the
two-phase algorithm (value 0) is at least as fast as one-shot (the largest value) for every
larger size measured.
"""

from __future__ import annotations

import argparse
import os

from .machine import command_line, describe_environment, timestamp
from .memcpy import measure_memcpy
from .options import plot_path, policy_from, sizes_from
from .report import format_bytes, write_json
from .sweep import SweepConfig, plan_for, progress_bar, run_level

__all__ = ["crossover", "run_threshold"]

_VAR = "SPYRECCL_ALLREDUCE_ONESHOT_MAX"
_DEFAULT_MIN = 256
_DEFAULT_MAX = 4 << 20


def crossover(
    sizes: list[int], oneshot_us: dict[int, float], twophase_us: dict[int, float]
) -> int | None:
    """Smallest size s such that two-phase <= one-shot for s and every larger size."""
    best = None
    for s in sorted(sizes, reverse=True):
        if s in oneshot_us and s in twophase_us and twophase_us[s] <= oneshot_us[s]:
            best = s
        else:
            break
    return best


def _label(value: int | None) -> str:
    return "default" if value is None else format_bytes(value)


def run_threshold(args: argparse.Namespace) -> int:
    sizes = sizes_from(args, _DEFAULT_MIN, _DEFAULT_MAX)
    values: list[int | None] = list(args.oneshot_values or [0, 1 << 20]) + [None]
    policy = policy_from(args)
    memcpy = measure_memcpy()
    configs = []
    for n in args.nproc:
        for v in values:
            env = {_VAR: None if v is None else str(v)}
            configs.append(
                (
                    v,
                    SweepConfig(
                        nranks=n,
                        ops=["all_reduce"],
                        sizes=sizes,
                        dtype=args.dtype,
                        levels=("core-host",),
                        policy=policy,
                        timeout_s=args.timeout,
                        env=env,
                        check=not args.no_check,
                    ),
                )
            )
    plans = [plan_for(cfg) for _, cfg in configs]
    rows: list[dict] = []
    with progress_bar(sum(len(p) for p in plans), enabled=not args.no_progress) as bar:
        for (value, cfg), plan in zip(configs, plans):
            level_rows, _ = run_level("core-host", cfg, plan, bar)
            for r in level_rows:
                r["oneshot_max"] = value
                r["busbw_frac_memcpy"] = r["busbw_gbps"] / memcpy.median_gbps
            rows.extend(level_rows)

    summary = {}
    lines = [
        f"# core all_reduce {args.dtype}: median time (us) per {_VAR} value",
        "# (0 B: always two-phase; the core caps the value at its staging chunk, 1 MiB by "
        "default, so 1 MiB means one-shot whenever allowed; default: variable unset)",
    ]
    for n in args.nproc:
        head = f"{'size':>9} |" + "".join(f" {_label(v):>10}" for v in values) + " | fastest"
        lines += ["", f"## {n} ranks", head, "-" * len(head)]
        times = {
            v: {
                r["bytes"]: r["time_us"]["median_us"]
                for r in rows
                if r["nranks"] == n and r["oneshot_max"] == v
            }
            for v in values
        }
        all_sizes = sorted({s for t in times.values() for s in t})
        for s in all_sizes:
            cells = [times[v].get(s) for v in values]
            fastest = min((t, i) for i, t in enumerate(cells) if t is not None)[1]
            lines.append(
                f"{format_bytes(s):>9} |"
                + "".join(f" {t:10.2f}" if t is not None else f" {'-':>10}" for t in cells)
                + f" | {_label(values[fastest])}"
            )
        explicit = [v for v in values if v is not None]
        if 0 in explicit and len(explicit) > 1:
            # Above the largest value (and the 1 MiB chunk cap) every column is two-phase:
            # those sizes say nothing about the choice, only about the noise.
            cap = min(max(explicit), 1 << 20)
            x = crossover([s for s in all_sizes if s <= cap], times[max(explicit)], times[0])
            summary[n] = x
            lines.append(
                f"two-phase is at least as fast as one-shot from {format_bytes(x)} up"
                if x is not None
                else "one-shot is faster than two-phase at the largest size measured: no crossover"
            )
    text = "\n".join(lines)
    print(text)
    json_path = args.json or os.path.join("bench-results", f"threshold-{timestamp()}.json")
    write_json(
        json_path,
        {
            "schema": "spyreccl-bench/1",
            "mode": "threshold",
            "command": command_line(args),
            "timestamp": timestamp(),
            "machine": describe_environment(),
            "memcpy": memcpy.to_dict(),
            "config": {
                "nproc": args.nproc,
                "dtype": args.dtype,
                "sizes": sizes,
                "values": values,
                "policy": vars(policy),
            },
            "crossover_bytes": {str(k): v for k, v in summary.items()},
            "results": rows,
        },
    )
    print(f"results: {json_path}")
    plot = plot_path(args, json_path)
    if plot:
        _plot(plot, rows, values, args)
        print(f"plot: {plot}")
    return 0


def _plot(path: str, rows: list[dict], values: list[int | None], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.nproc), figsize=(5.5 * len(args.nproc), 4), squeeze=False)
    for ax, n in zip(axes[0], args.nproc):
        for v in values:
            sel = sorted(
                (r for r in rows if r["nranks"] == n and r["oneshot_max"] == v),
                key=lambda r: r["bytes"],
            )
            ax.plot(
                [r["bytes"] for r in sel],
                [r["time_us"]["median_us"] for r in sel],
                marker="o",
                markersize=3,
                label=f"{_VAR}={_label(v)}",
                linestyle="--" if v is None else "-",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("median time (us)")
        ax.set_title(f"core all_reduce, {n} ranks, {args.dtype}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
