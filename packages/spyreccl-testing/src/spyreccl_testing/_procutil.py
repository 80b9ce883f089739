"""Process hygiene: workers that die with their parent, and /dev/shm leak detection."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "spyreccl"


def die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Makes the calling (worker) process exit as soon as `parent_pid` is gone.

    Two mechanisms, because each alone has a hole:
    - PR_SET_PDEATHSIG delivers SIGKILL the moment the parent dies, even if this process is
      stuck inside a C++ collective. But it fires when the parent *thread* that spawned us
      exits, so it is only armed when the pool was started from the main thread.
    - A daemon thread polls getppid() once a second and covers the other cases (and the race
      where the parent died before prctl ran).
    """
    if use_pdeathsig:
        libc_name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(libc_name, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # not Linux/glibc: the watcher thread below still applies
    if os.getppid() != parent_pid:
        os._exit(70)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(70)

    threading.Thread(target=watch, name="spyreccl-parent-watch", daemon=True).start()


def free_tcp_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def list_spyreccl_shm() -> set[str]:
    """Names of spyreccl shared-memory segments currently in /dev/shm."""
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def new_shm_leftovers(baseline: set[str], settle_s: float = 0.5) -> set[str]:
    """Segments that appeared since `baseline` and are still there after `settle_s`.

    The short settle time lets segments of a communicator that another process on this machine
    is creating right now be unlinked (spyreccl unlinks as soon as every rank attached), so a
    concurrent job is not mistaken for a leak of ours.
    """
    appeared = list_spyreccl_shm() - baseline
    if not appeared:
        return set()
    time.sleep(settle_s)
    return appeared & list_spyreccl_shm()


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exit code {exitcode}"
