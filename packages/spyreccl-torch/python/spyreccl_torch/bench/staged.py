"""``--memory host,discrete``: the spyreccl level in each memory mode of the emulated device,
and what staging costs.

In ``discrete`` mode (``SPYRECCL_SPYRE_MEMORY=discrete``) spyre memory is declared not
host-addressable and the backend moves every spyre tensor through host buffers with the
device's copies (one copy each way up to one chunk, a chunk pipeline above). Beside each
operation's host-mode and discrete-mode medians the table shows the two copies the staged
path needs (device -> host of the input, host -> device of the output, timed here with
``copy_`` between a spyre tensor and a pinned host tensor) and the targets:

* at >= 4 MiB: staged <= 1.3 x max(the two copies, the host collective): the pipeline hides
  the smaller part;
* at <= 64 KiB: staged <= host collective + the two copies: the shortest route.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from .ops import layout
from .plan import DTYPES

__all__ = [
    "DISCRETE_LEVEL",
    "MEMORY_ENV",
    "MEMORY_MODES",
    "copy_times_us",
    "format_staging_table",
    "staging_rows",
]

MEMORY_ENV = "SPYRECCL_SPYRE_MEMORY"
MEMORY_MODES = ("host", "discrete")
# The level name of the spyreccl rows measured in discrete mode (beside "spyreccl").
DISCRETE_LEVEL = "spyreccl-discrete"
LARGE_BYTES = 4 << 20
SMALL_BYTES = 64 << 10
LARGE_FACTOR = 1.3


def _median_copy_us(torch: Any, dst: Any, src: Any, reps: int) -> float:
    dst.copy_(src)  # first touch
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def copy_times_us(nbytes_list: list[int], dtype: str) -> dict[int, tuple[float, float]]:
    """Median device -> host and host -> device copy_ times (us) of each size, between a
    spyre tensor and a pinned host tensor, in this process."""
    import torch

    torch_dtype = getattr(torch, dtype)
    itemsize = DTYPES[dtype].itemsize
    out: dict[int, tuple[float, float]] = {}
    for nbytes in sorted(set(nbytes_list)):
        numel = max(1, nbytes // itemsize)
        device = torch.randn(numel).to(torch_dtype).to("spyre")
        try:
            host = torch.empty(numel, dtype=torch_dtype, pin_memory=True)
        except RuntimeError:
            host = torch.empty(numel, dtype=torch_dtype)
        reps = 200 if nbytes <= SMALL_BYTES else 20
        out[nbytes] = (
            _median_copy_us(torch, host, device, reps),
            _median_copy_us(torch, device, host, reps),
        )
    return out


def _copy_bytes(row: dict) -> tuple[int, int]:
    """Bytes the staged path copies to and from the host for one rank in `row`'s case."""
    itemsize = DTYPES[row["dtype"]].itemsize
    lay = layout(row["op"], row["requested_bytes"], itemsize, row["nranks"])
    return lay.send_elems * itemsize, lay.recv_elems * itemsize


def label_memory(rows: list[dict], memory: str) -> None:
    """Records the memory mode of a sweep's rows; the spyreccl rows of a discrete-mode sweep
    get their own level (a column of their own in the tables), its other rows are dropped
    (see memory_configs)."""
    if memory == "discrete":
        rows[:] = [r for r in rows if r["level"] == "spyreccl"]
    for r in rows:
        r["memory"] = memory
        if memory == "discrete":
            r["level"] = DISCRETE_LEVEL


def staging_rows(rows: list[dict]) -> tuple[list[dict], list[int]]:
    """Pairs host and discrete rows of the spyreccl level by (nranks, op, bytes): the cases to
    report, and the copy sizes to time."""
    by_mode: dict[str, dict[tuple, dict]] = {m: {} for m in MEMORY_MODES}
    for r in rows:
        if r["level"] in ("spyreccl", DISCRETE_LEVEL):
            by_mode[r.get("memory", "host")][(r["nranks"], r["op"], r["bytes"])] = r
    pairs = []
    copy_sizes: list[int] = []
    for key, host in by_mode["host"].items():
        discrete = by_mode["discrete"].get(key)
        if discrete is None or host["op"] == "barrier":
            continue
        to_host, from_host = _copy_bytes(host)
        copy_sizes += [to_host, from_host]
        pairs.append({"host": host, "discrete": discrete, "copy_bytes": (to_host, from_host)})
    return pairs, copy_sizes


def evaluate(pairs: list[dict], copies: dict[int, tuple[float, float]]) -> list[dict]:
    """One result per pair: medians, copy times, overhead and the target check."""
    results = []
    for p in pairs:
        host_us = p["host"]["time_us"]["median_us"]
        staged_us = p["discrete"]["time_us"]["median_us"]
        to_host, from_host = p["copy_bytes"]
        d2h_us = copies[to_host][0]
        h2d_us = copies[from_host][1]
        nbytes = p["host"]["bytes"]
        if nbytes >= LARGE_BYTES:
            target = LARGE_FACTOR * max(d2h_us + h2d_us, host_us)
        elif nbytes <= SMALL_BYTES:
            target = host_us + d2h_us + h2d_us
        else:
            target = None
        results.append(
            {
                "nranks": p["host"]["nranks"],
                "op": p["host"]["op"],
                "bytes": nbytes,
                "host_us": host_us,
                "staged_us": staged_us,
                "d2h_us": d2h_us,
                "h2d_us": h2d_us,
                "overhead_us": staged_us - host_us,
                "target_us": target,
                "meets_target": None if target is None else staged_us <= target,
            }
        )
    return results


def format_staging_table(results: list[dict]) -> str:
    from .report import format_bytes

    lines = [
        "# staging overhead: spyreccl in discrete memory mode vs host mode (median us)",
        "# target: >= 4 MiB staged <= 1.3 x max(d2h + h2d, host); <= 64 KiB staged <= host "
        "+ d2h + h2d",
        f"{'op':<24} {'n':>2} {'size':>9} | {'host':>9} {'staged':>9} {'d2h':>8} {'h2d':>8} "
        f"{'overhead':>9} {'target':>9} ok",
    ]
    lines.append("-" * len(lines[-1]))
    for r in sorted(results, key=lambda r: (r["nranks"], r["op"], r["bytes"])):
        target = f"{r['target_us']:9.1f}" if r["target_us"] is not None else f"{'-':>9}"
        ok = {True: "yes", False: "NO", None: "-"}[r["meets_target"]]
        lines.append(
            f"{r['op']:<24} {r['nranks']:>2} {format_bytes(r['bytes']):>9} | "
            f"{r['host_us']:9.1f} {r['staged_us']:9.1f} {r['d2h_us']:8.1f} {r['h2d_us']:8.1f} "
            f"{r['overhead_us']:9.1f} {target} {ok}"
        )
    return "\n".join(lines)


def memory_configs(configs: list, modes: list[str]) -> list[tuple[Any, str]]:
    """The sweep configurations per memory mode: host mode as given (every level), discrete
    mode for the torch levels only (the core levels do not touch spyre memory). The discrete
    run keeps gloo beside spyreccl so that both modes measure spyreccl under the same
    conditions (paired levels alternate case by case); :func:`label_memory` drops its gloo
    rows, which measure nothing new."""
    import dataclasses

    from .sweep import TORCH_LEVELS

    out: list[tuple[Any, str]] = []
    for cfg in configs:
        if "host" in modes:
            out.append((dataclasses.replace(cfg, env={**cfg.env, MEMORY_ENV: "host"}), "host"))
        if "discrete" in modes and "spyreccl" in cfg.levels:
            levels = tuple(lv for lv in cfg.levels if lv in TORCH_LEVELS)
            discrete = dataclasses.replace(
                cfg, levels=levels, env={**cfg.env, MEMORY_ENV: "discrete"}
            )
            out.append((discrete, "discrete"))
    return out


def staging_report(rows: list[dict], dtype: str) -> tuple[str, list[dict]] | None:
    """The staging-overhead table and its results when both modes ran, else None."""
    pairs, copy_sizes = staging_rows(rows)
    if not pairs:
        return None
    results = evaluate(pairs, copy_times_us(copy_sizes, dtype))
    return format_staging_table(results), results
