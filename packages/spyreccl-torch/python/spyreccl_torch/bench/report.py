"""Presenting results: text tables, the JSON document and the PNG plot."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "format_bytes",
    "format_markdown",
    "format_scaling_table",
    "format_sweep_tables",
    "plot_sweep",
    "write_json",
]

# spyreccl-discrete: the spyreccl level with the emulated device in discrete memory mode
# (--memory, staged.py).
_LEVEL_ORDER = (
    "core",
    "core-host",
    "core-host-vs-mpi",
    "mpi",
    "spyreccl",
    "spyreccl-discrete",
    "gloo",
)
_LEVEL_STYLE = {
    "core": ("tab:green", "s"),
    "core-host": ("tab:olive", "D"),
    "core-host-vs-mpi": ("tab:cyan", "v"),
    "mpi": ("tab:purple", "x"),
    "spyreccl": ("tab:blue", "o"),
    "spyreccl-discrete": ("tab:brown", "P"),
    "gloo": ("tab:red", "^"),
}


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def _num(v: float | None, width: int, digits: int = 2) -> str:
    if v is None:
        return " " * (width - 1) + "-"
    if abs(v) >= 10 ** (width - digits - 2):
        return f"{v:{width}.0f}"
    return f"{v:{width}.{digits}f}"


def _levels_in(rows: Iterable[dict]) -> list[str]:
    present = {r["level"] for r in rows}
    return [lv for lv in _LEVEL_ORDER if lv in present]


def format_routes(rows: Sequence[dict]) -> str:
    """The routes a multi-node group took, per level, op and world size, as size ranges
    ("8 B-256 B inline, 512 B-64 KiB flat, ...")."""
    out = ["routes of the multi-node groups (rank 0; see the user guide, Multiple nodes):"]
    keys: list[tuple] = []
    for r in rows:
        k = (r["level"], r["nranks"], r["op"])
        if "route" in r and k not in keys:
            keys.append(k)
    for level, nranks, op in keys:
        sel = sorted(
            (r for r in rows if (r["level"], r["nranks"], r["op"]) == (level, nranks, op)),
            key=lambda r: r["bytes"],
        )
        spans: list[list] = []  # [first size, last size, route]
        for r in sel:
            route = r.get("route", "-")
            if spans and spans[-1][2] == route:
                spans[-1][1] = r["bytes"]
            else:
                spans.append([r["bytes"], r["bytes"], route])
        text = ", ".join(
            f"{format_bytes(a)}{'' if a == b else '-' + format_bytes(b)} {route}"
            for a, b, route in spans
        )
        out.append(f"  {level} x{nranks} {op}: {text}")
    return "\n".join(out) if keys else "routes of the multi-node groups: none recorded"


def format_sweep_tables(rows: Sequence[dict], memcpy_gbps: float | None) -> str:
    """One table per (world size, operation), levels side by side, nccl-tests flavoured."""
    out: list[str] = []
    levels = _levels_in(rows)
    keys = []
    for r in rows:
        k = (r["nranks"], r["op"], r["dtype"])
        if k not in keys:
            keys.append(k)
    for nranks, op, dtype in keys:
        sel = [r for r in rows if (r["nranks"], r["op"], r["dtype"]) == (nranks, op, dtype)]
        by = {(r["level"], r["bytes"]): r for r in sel}
        sizes = sorted({r["bytes"] for r in sel})
        head1 = f"{'':>9} |"
        head2 = f"{'size':>9} |"
        for lv in levels:
            head1 += f" {lv + ' (time us, busbw GB/s)':^48}|"
            head2 += f" {'median':>8} {'p10':>7} {'p90':>8} {'mean':>8} {'busbw':>6} {'%mcpy':>5} |"
        others = [lv for lv in levels if lv != "gloo"] if "gloo" in levels else []
        if others:
            head1 += f" {'x gloo':^{9 * len(others)}}"
            head2 += "".join(f" {lv:>8}" for lv in others)
        title = f"# {op}  {dtype}  {nranks} rank{'s' if nranks > 1 else ''}"
        if memcpy_gbps:
            title += f"   (%mcpy: busbw / single-thread memcpy {memcpy_gbps:.2f} GB/s)"
        out += [title, head1, head2, "-" * len(head2)]
        for size in sizes:
            line = f"{format_bytes(size) if op != 'barrier' else '-':>9} |"
            for lv in levels:
                r = by.get((lv, size))
                if r is None:
                    line += f" {'':>8} {'':>7} {'':>8} {'':>8} {'':>6} {'':>5} |"
                    continue
                t = r["time_us"]
                frac = (100 * r["busbw_gbps"] / memcpy_gbps) if memcpy_gbps and size else None
                busbw = r["busbw_gbps"] if size else None
                line += (
                    f" {_num(t['median_us'], 8)} {_num(t['p10_us'], 7)} "
                    f"{_num(t['p90_us'], 8)} {_num(t['mean_us'], 8)} {_num(busbw, 6)} "
                    f"{_num(frac, 5, 0)} |"
                )
            for lv in others:
                r = by.get((lv, size))
                s = r.get("speedup_vs_gloo") if r else None
                line += f" {_num(s, 7, 1)}x" if s is not None else f" {'-':>8}"
            out.append(line)
        out.append("")
    return "\n".join(out)


_SCALING_SIZES = (8, 64 << 10, 1 << 20, 16 << 20, 128 << 20)


def format_scaling_table(rows: Sequence[dict]) -> str:
    """Median time and busbw per world size at a few landmark sizes, for every operation."""
    nranks_list = sorted({r["nranks"] for r in rows})
    levels = _levels_in(rows)
    by = {(r["level"], r["op"], r["nranks"], r["requested_bytes"]): r for r in rows}
    ops = []
    for r in rows:
        if r["op"] not in ops:
            ops.append(r["op"])
    out = ["# scaling: median time (us) / busbw (GB/s) per world size"]
    head = f"{'op':<23} {'level':<9} {'size':>8} |" + "".join(
        f" {'n=' + str(n):^17}|" for n in nranks_list
    )
    out += [head, "-" * len(head)]
    for op in ops:
        sizes = (
            [0]
            if op == "barrier"
            else [s for s in _SCALING_SIZES if any(k[1] == op and k[3] == s for k in by)]
        )
        for lv in levels:
            for size in sizes:
                line = f"{op:<23} {lv:<9} {format_bytes(size) if size else '-':>8} |"
                for n in nranks_list:
                    r = by.get((lv, op, n, size))
                    if r is None:
                        line += f" {'-':^17}|"
                        continue
                    bw = f"{r['busbw_gbps']:6.2f}" if size else f"{'':6}"
                    line += f" {_num(r['time_us']['median_us'], 9)} {bw} |"
                out.append(line)
    out.append("")
    return "\n".join(out)


def format_markdown(rows: Sequence[dict], memcpy_gbps: float | None) -> str:
    """The sweep as Markdown tables (one per world size and operation), for the docs."""
    levels = _levels_in(rows)
    out: list[str] = []
    keys = []
    for r in rows:
        k = (r["nranks"], r["op"], r["dtype"])
        if k not in keys:
            keys.append(k)
    for nranks, op, dtype in keys:
        sel = [r for r in rows if (r["nranks"], r["op"], r["dtype"]) == (nranks, op, dtype)]
        by = {(r["level"], r["bytes"]): r for r in sel}
        head = ["size"]
        for lv in levels:
            head += [f"{lv} µs median (p10-p90), mean"] + (
                [f"{lv} busbw GB/s"] if op != "barrier" else []
            )
        others = [lv for lv in levels if lv != "gloo"] if "gloo" in levels else []
        head += [f"{lv} x gloo" for lv in others]
        out += [
            f"**{op}**, {dtype}, {nranks} ranks",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for size in sorted({r["bytes"] for r in sel}):
            cells = [format_bytes(size) if op != "barrier" else "-"]
            for lv in levels:
                r = by.get((lv, size))
                if r is None:
                    cells += ["-"] * (2 if op != "barrier" else 1)
                    continue
                t = r["time_us"]
                spread = f"({t['p10_us']:.1f}-{t['p90_us']:.1f})"
                cells.append(f"{t['median_us']:.1f} {spread}, {t['mean_us']:.1f}")
                if op != "barrier":
                    bw = r["busbw_gbps"]
                    frac = f" ({100 * bw / memcpy_gbps:.0f}%)" if memcpy_gbps else ""
                    cells.append(f"{bw:.3f}{frac}" if bw < 0.1 else f"{bw:.2f}{frac}")
            for lv in others:
                r = by.get((lv, size))
                s = r.get("speedup_vs_gloo") if r else None
                cells.append(f"{s:.1f}x" if s else "-")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def write_json(path: str, document: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(document, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def plot_sweep(path: str, rows: Sequence[dict], memcpy_gbps: float | None, title: str) -> None:
    """Latency (log-log) and busbw (log-x) against size, one row of panels per operation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nranks_list = sorted({r["nranks"] for r in rows})
    ops = []
    for r in rows:
        if r["op"] != "barrier" and r["op"] not in ops:
            ops.append(r["op"])
    if not ops:
        raise ValueError("plot_sweep: no sized operation to plot")
    levels = _levels_in(rows)
    fig, axes = plt.subplots(len(ops), 2, figsize=(12, 3.1 * len(ops)), squeeze=False)
    linestyles = ["-", "--", ":", "-."]
    for i, op in enumerate(ops):
        ax_t, ax_bw = axes[i]
        for j, nranks in enumerate(nranks_list):
            for lv in levels:
                sel = sorted(
                    (
                        r
                        for r in rows
                        if r["op"] == op and r["level"] == lv and r["nranks"] == nranks
                    ),
                    key=lambda r: r["bytes"],
                )
                if not sel:
                    continue
                color, marker = _LEVEL_STYLE[lv]
                x = [r["bytes"] for r in sel]
                label = lv if len(nranks_list) == 1 else f"{lv} n={nranks}"
                style = dict(
                    color=color,
                    marker=marker,
                    markersize=3,
                    linestyle=linestyles[j % len(linestyles)],
                    label=label,
                )
                ax_t.plot(x, [r["time_us"]["median_us"] for r in sel], **style)
                ax_t.fill_between(
                    x,
                    [r["time_us"]["p10_us"] for r in sel],
                    [r["time_us"]["p90_us"] for r in sel],
                    color=color,
                    alpha=0.12,
                )
                ax_bw.plot(x, [r["busbw_gbps"] for r in sel], **style)
        if memcpy_gbps:
            ax_bw.axhline(
                memcpy_gbps,
                color="gray",
                linestyle="--",
                linewidth=1,
                label=f"memcpy 1 thread ({memcpy_gbps:.1f} GB/s)",
            )
        for ax in (ax_t, ax_bw):
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("size (bytes)")
        ax_t.set_yscale("log")
        ax_t.set_ylabel("time (us, median, p10-p90 band)")
        ax_bw.set_ylabel("busbw (GB/s)")
        ax_t.set_title(f"{op}: latency")
        ax_bw.set_title(f"{op}: bus bandwidth")
        ax_bw.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.25 / len(ops)))  # leave the top to the title
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
