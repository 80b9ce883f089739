"""Describing the machine and software a result was measured on (for the JSON document)."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
from typing import Any

__all__ = ["command_line", "describe_environment", "timestamp"]


def timestamp() -> str:
    """Local time, sortable and file-name safe: 20250101-120000."""
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def command_line(args: Any) -> str:
    """The command as typed (program name and the arguments main() parsed)."""
    program = os.path.basename(sys.argv[0])
    if program in ("__main__.py", "-m", "-c", ""):
        program = "python -m spyreccl_torch.bench"
    return " ".join([program, *args.argv])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError):
        return None


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    try:
        import numpy

        out["numpy"] = numpy.__version__
    except ImportError:
        out["numpy"] = None
    try:
        import spyreccl_core

        out["spyreccl_core"] = spyreccl_core.__version__
        out["libspyreccl"] = spyreccl_core.library_version()
    except (ImportError, AttributeError):
        out["spyreccl_core"] = None
    # torch is reported only when already imported: importing it just to print a version
    # would cost seconds and load the spyre device into the parent process.
    torch = sys.modules.get("torch")
    out["torch"] = getattr(torch, "__version__", None) if torch else None
    return out


def describe_environment() -> dict[str, Any]:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "memory_gib": _memory_gib(),
        # Other work on a shared machine distorts every number: keep the evidence with them.
        "loadavg_1_5_15": list(os.getloadavg()),
        "platform": platform.platform(),
        "versions": _versions(),
        "spyreccl_env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith(("SPYRECCL_", "OMP_NUM_THREADS", "TORCH_"))
        },
    }
