"""The optional ``mpi`` level: Open MPI next to spyreccl_core, interleaved case by case.

Runs ``mpi_worker.py`` under ``mpirun`` (one process per rank) and turns what rank 0
reports into the sweep's result rows: level ``mpi`` (Open MPI through mpi4py) and level
``core-host-vs-mpi`` (spyreccl_core on the same numpy arrays, in the same processes,
alternating with Open MPI case by case). Open MPI is told to use its shared-memory
transport with cross-memory attach (``btl self,vader``, ``btl_vader_single_copy_mechanism
cma``), its single-copy path for large messages.

The level needs ``mpi4py`` importable by this interpreter and ``mpirun`` on PATH; without
them :func:`unavailable` says why and the sweep skips the level with that message (CI
has no MPI). Running as root adds ``--allow-run-as-root``; ``--oversubscribe`` lets the
world size exceed the cores, as the other levels do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LEVELS", "mpirun_command", "rows_from_report", "run_mpi_level", "unavailable"]

# The rows a run of the level produces.
LEVELS = ("core-host-vs-mpi", "mpi")

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_worker.py")

# Open MPI's shared-memory transport with its single-copy mechanism (CMA), pinned so that
# the comparison does not depend on what Open MPI would pick by default.
MCA = (("btl", "self,vader"), ("btl_vader_single_copy_mechanism", "cma"))


def unavailable() -> str | None:
    """Why the level cannot run here, or None when it can."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not importable (pip install mpi4py, with Open MPI installed)"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (install Open MPI, e.g. apt-get install openmpi-bin)"
    return None


def mpirun_command(nranks: int, args_path: str, out_path: str, *, as_root: bool) -> list[str]:
    # --bind-to none: mpirun pins each rank to one core by default, while the sweep's other
    # levels run unpinned: both libraries get the whole machine, as in the other levels.
    # (spyreccl_core handles bound ranks too: it counts the union of the ranks' CPUs.)
    cmd = ["mpirun", "-n", str(nranks), "--oversubscribe", "--bind-to", "none"]
    if as_root:
        cmd.append("--allow-run-as-root")
    for key, value in MCA:
        cmd += ["--mca", key, value]
    return cmd + [sys.executable, _WORKER, args_path, out_path]


def rows_from_report(report: Mapping[str, Any], cases: Sequence[Any], make_row: Any) -> list[dict]:
    """Result rows from rank 0's report. ``make_row(level, case, per_rank_samples)`` is
    the sweep's row builder (sweep._row bound to the config)."""
    rows = []
    for entry in report["results"]:
        case = cases[entry["index"]]
        rows.append(make_row(entry["level"], case, entry["samples"]))
    return rows


def run_mpi_level(
    nranks: int,
    cases: Sequence[Any],
    *,
    policy: Mapping[str, Any],
    numpy_dtype: str,
    timeout_s: float,
    make_row: Any,
    env: Mapping[str, str | None] | None = None,
) -> tuple[list[dict], dict[str, Any]]:
    """Runs every case under mpirun; returns the rows and the MPI library's description."""
    with tempfile.TemporaryDirectory(prefix="spyreccl-bench-mpi-") as workdir:
        args_path = os.path.join(workdir, "args.json")
        out_path = os.path.join(workdir, "out.json")
        with open(args_path, "w") as f:
            json.dump(
                {
                    "cases": [c.to_dict() for c in cases],
                    "policy": dict(policy),
                    "numpy_dtype": numpy_dtype,
                    "timeout_s": timeout_s,
                },
                f,
            )
        child_env = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                child_env.pop(key, None)
            else:
                child_env[key] = value
        cmd = mpirun_command(nranks, args_path, out_path, as_root=os.geteuid() == 0)
        # Generous: every case is bounded by the timing policy; this only catches a hang.
        budget = 60 + len(cases) * 4 * (float(policy.get("max_case_s", 2.0)) + 5)
        proc = subprocess.run(
            cmd, env=child_env, capture_output=True, text=True, timeout=budget, check=False
        )
        if proc.returncode != 0 or not os.path.exists(out_path):
            from .launcher import BenchError

            raise BenchError(
                f"mpi level: {' '.join(cmd)} exited with {proc.returncode}\n"
                f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
            )
        with open(out_path) as f:
            report = json.load(f)
    info = dict(report.get("info", {}))
    info["mca"] = dict(MCA)
    return rows_from_report(report, cases, make_row), info
