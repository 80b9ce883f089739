"""The nccl-tests-style sweep: every (level, op, size) case at one world size."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .launcher import RankJob
from .ops import OPS
from .plan import DTYPES, Case, build_plan
from .stats import bandwidths, combine_ranks, summarize
from .timing import LoopPolicy
from .torch_env import LEVELS as TORCH_LEVELS

__all__ = [
    "ALL_LEVELS",
    "CORE_LEVELS",
    "DEFAULT_LEVELS",
    "TORCH_LEVELS",
    "SweepConfig",
    "level_groups",
    "run_sweep",
]

# core: spyreccl_core on arrays from spyreccl_core.empty (the memory arena: large collectives
# read peers' buffers in place); core-host: the same on ordinary numpy arrays (staged through
# shared memory); spyreccl: torch.distributed on spyre tensors; gloo: CPU tensors (baseline);
# mpi (optional, not in the default): Open MPI through mpi4py interleaved with spyreccl_core
# on the same numpy arrays (mpi_level.py), skipped with a message when mpi4py or mpirun is
# missing.
ALL_LEVELS = ("core", "core-host", "spyreccl", "gloo", "mpi")
DEFAULT_LEVELS = ("core", "core-host", "spyreccl", "gloo")
CORE_LEVELS = ("core", "core-host")
# Levels that connect the ranks of one node only (no --nodes).
_ONE_NODE_LEVELS = (*CORE_LEVELS, "mpi")
_CORE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "core_worker.py")


@dataclass
class SweepConfig:
    nranks: int
    ops: list[str]
    sizes: list[int]
    dtype: str = "float32"
    levels: tuple[str, ...] = DEFAULT_LEVELS
    policy: LoopPolicy = field(default_factory=LoopPolicy)
    timeout_s: float = 300.0  # per collective wait (c10d / spyreccl timeout) and per stall
    # spyreccl and gloo share rank processes and alternate case by case (torch_worker.py);
    # False: every level in its own processes, one level after the other.
    pair_torch_levels: bool = True
    check: bool = True  # verify every case's result once before timing it (check.py)
    env: Mapping[str, str | None] = field(default_factory=dict)  # applied to every rank
    # Simulated nodes (bench/nodes.py): > 1 runs the torch levels' groups across nodes.
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.nranks < 1:
            raise ValueError(f"sweep: the world size must be >= 1, got {self.nranks}")
        if not 1 <= self.nodes <= self.nranks:
            raise ValueError(
                f"sweep: --nodes must be between 1 and the world size {self.nranks}, "
                f"got {self.nodes}"
            )
        if self.nodes > 1 and any(lv in _ONE_NODE_LEVELS for lv in self.levels):
            raise ValueError(
                "sweep: the core and mpi levels connect one node only; with --nodes use "
                "--levels spyreccl,gloo"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"sweep: unknown dtype {self.dtype!r}; expected one of {list(DTYPES)}")
        bad = [lv for lv in self.levels if lv not in ALL_LEVELS]
        if bad:
            raise ValueError(f"sweep: unknown level(s) {bad}; expected some of {ALL_LEVELS}")


class _Progress:
    """Thin wrapper so that a missing tqdm (or --no-progress) degrades to nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, unit="case", dynamic_ncols=True, leave=False)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=False)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def level_groups(cfg: SweepConfig) -> list[tuple[str, ...]]:
    """The jobs of a sweep, in order: the levels each job's rank processes run."""
    paired = tuple(lv for lv in cfg.levels if lv in TORCH_LEVELS)
    groups: list[tuple[str, ...]] = []
    for lv in cfg.levels:
        if cfg.pair_torch_levels and len(paired) > 1 and lv in TORCH_LEVELS:
            if paired not in groups:
                groups.append(paired)
        else:
            groups.append((lv,))
    return groups


def _job_args(
    levels: tuple[str, ...], cfg: SweepConfig, cases: list[Case], workdir: str
) -> dict[str, Any]:
    level = levels[0]
    info = DTYPES[cfg.dtype]
    args: dict[str, Any] = {
        "nranks": cfg.nranks,
        "dtype": cfg.dtype,
        "cases": [c.to_dict() for c in cases],
        "policy": dataclasses.asdict(cfg.policy),
        "timeout_s": cfg.timeout_s,
        "check": cfg.check,
    }
    if level in CORE_LEVELS:
        import spyreccl_core

        args.update(
            unique_id=spyreccl_core.UniqueId().to_bytes(),
            numpy_dtype=info.numpy,
            reinterpret=info.reinterpret,
            memory="arena" if level == "core" else "host",
        )
    else:
        args.update(
            levels=list(levels),
            init_method=f"file://{os.path.join(workdir, 'store')}",
            nodes=cfg.nodes,
        )
    return args


def _start(levels: tuple[str, ...], cfg: SweepConfig, cases: list[Case], workdir: str) -> RankJob:
    args = _job_args(levels, cfg, cases, workdir)
    name = f"{'+'.join(levels)} x{cfg.nranks}"
    if levels[0] in CORE_LEVELS:
        return RankJob(name, cfg.nranks, args, script=_CORE_SCRIPT, env=cfg.env)
    from .torch_worker import run_rank

    return RankJob(name, cfg.nranks, args, target=run_rank, env=cfg.env)


def run_level(
    level: str, cfg: SweepConfig, cases: list[Case], progress: _Progress
) -> tuple[list[dict], dict[str, Any]]:
    """Runs every case of one level; returns its result rows and the ranks' 'ready' info."""
    return run_job((level,), cfg, cases, progress)


def run_job(
    levels: tuple[str, ...], cfg: SweepConfig, cases: list[Case], progress: _Progress
) -> tuple[list[dict], dict[str, Any]]:
    """Runs every case on every level of ``levels`` in one set of rank processes (see
    :func:`level_groups`); returns the result rows and the ranks' 'ready' info."""
    rows: list[dict] = []
    pending: dict[tuple[str, int], list] = {}
    routes: dict[tuple[str, int], str] = {}
    ready: dict[str, Any] = {}
    name = f"{'+'.join(levels)} x{cfg.nranks}"
    with (
        tempfile.TemporaryDirectory(prefix="spyreccl-bench-") as workdir,
        _start(levels, cfg, cases, workdir) as job,
    ):
        progress.describe(f"{name}: starting ranks")
        for rank, msg in job.messages(stall_timeout_s=cfg.timeout_s):
            if msg[0] == "ready" and rank == 0:
                ready = msg[1]
            if msg[0] != "case":
                continue
            # ("case", index, samples[, level[, routes]]): the level is implied for one-level
            # jobs; routes: what a multi-node group did (rank 0's is reported).
            index, samples = msg[1], msg[2]
            level = msg[3] if len(msg) > 3 else levels[0]
            if len(msg) > 4 and rank == 0 and msg[4]:
                routes[(level, index)] = "+".join(msg[4])
            per_rank = pending.setdefault((level, index), [None] * cfg.nranks)
            per_rank[rank] = samples if samples is not None else ()
            if any(s is None for s in per_rank):
                continue
            del pending[(level, index)]
            case = cases[index]
            rows.append(_row(level, cfg, case, [s if s != () else None for s in per_rank]))
            if (level, index) in routes:
                rows[-1]["route"] = routes.pop((level, index))
            progress.advance()
            if index + 1 < len(cases):
                nxt = cases[index + 1]
                progress.describe(f"{name} {nxt.op} {nxt.nbytes} B")
    return rows, ready


def _row(level: str, cfg: SweepConfig, case: Case, per_rank: list) -> dict:
    spec = OPS[case.op]
    summary = summarize(combine_ranks(per_rank) / spec.per_step)
    factor = spec.bus_factor(cfg.nranks)
    algbw, busbw = bandwidths(case.nbytes, summary.median_us, factor)
    return {
        "level": level,
        "nranks": cfg.nranks,
        "nodes": cfg.nodes,
        "op": case.op,
        "dtype": cfg.dtype,
        "bytes": case.nbytes,
        "requested_bytes": case.requested,
        "count": case.unit,
        "time_us": summary.to_dict(),
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        "bus_factor": factor,
    }


def plan_for(cfg: SweepConfig) -> list[Case]:
    return build_plan(cfg.ops, cfg.sizes, DTYPES[cfg.dtype].itemsize, cfg.nranks)


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[_Progress]:
    bar = _Progress(total, enabled)
    try:
        yield bar
    finally:
        bar.close()


def run_sweep(cfg: SweepConfig, progress: _Progress) -> tuple[list[dict], dict[str, Any]]:
    """All levels of ``cfg``; rows of every level, plus per-level rank info."""
    cases = plan_for(cfg)
    rows: list[dict] = []
    info: dict[str, Any] = {}
    for levels in level_groups(cfg):
        if levels == ("mpi",):
            mpi_rows, mpi_info = run_mpi(cfg, cases, progress)
            rows.extend(mpi_rows)
            info["mpi"] = mpi_info
            continue
        job_rows, ready = run_job(levels, cfg, cases, progress)
        rows.extend(job_rows)
        for level in levels:
            info[level] = ready
    add_ratios(rows)
    return rows, info


def run_mpi(cfg: SweepConfig, cases: list[Case], progress: _Progress) -> tuple[list[dict], dict]:
    """The optional mpi level (mpi_level.py); skipped, with the reason printed and
    returned, when mpi4py or mpirun is missing."""
    from . import mpi_level

    why = mpi_level.unavailable()
    if why is None and DTYPES[cfg.dtype].reinterpret:
        why = f"{cfg.dtype} has no MPI or numpy type"
    if why is not None:
        print(f"sweep: skipping the mpi level: {why}", flush=True)
        for _ in cases:
            progress.advance()
        return [], {"skipped": why}
    progress.describe(f"mpi x{cfg.nranks}: Open MPI and spyreccl_core interleaved")
    rows, info = mpi_level.run_mpi_level(
        cfg.nranks,
        cases,
        policy=dataclasses.asdict(cfg.policy),
        numpy_dtype=DTYPES[cfg.dtype].numpy,
        timeout_s=cfg.timeout_s,
        make_row=lambda level, case, per_rank: _row(level, cfg, case, per_rank),
        env=cfg.env,
    )
    for _ in cases:
        progress.advance()
    return rows, info


def add_ratios(rows: list[dict]) -> None:
    """speedup_vs_gloo = gloo's median time / this level's median time (same op/size/n)."""
    gloo = {
        (r["nranks"], r["op"], r["bytes"], r["dtype"]): r["time_us"]["median_us"]
        for r in rows
        if r["level"] == "gloo"
    }
    for r in rows:
        ref = gloo.get((r["nranks"], r["op"], r["bytes"], r["dtype"]))
        r["speedup_vs_gloo"] = (
            ref / r["time_us"]["median_us"] if ref and r["time_us"]["median_us"] > 0 else None
        )
