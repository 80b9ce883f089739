"""Observations of a process' footprint: /dev/shm segments, fds, threads, RSS, file modes."""

from __future__ import annotations

import os
import stat
import time

from spyreccl_testing._procutil import list_spyreccl_shm, new_shm_leftovers
from spyreccl_testing.shm import mapped_segments

__all__ = [
    "mapped_segments",
    "new_segments",
    "open_fds",
    "read_dumps",
    "rss_bytes",
    "shm_segments",
    "thread_count",
    "world_writable",
]

# The segment helpers are spyreccl-testing's (one implementation for every test suite);
# re-exported under the names this suite uses.
shm_segments = list_spyreccl_shm


def new_segments(before: set[str], settle_s: float = 1.0) -> list[str]:
    """Segments that appeared since `before` and are still there after `settle_s` (other jobs
    on the machine may be forming communicators right now), sorted."""
    return sorted(new_shm_leftovers(before, settle_s))


def open_fds() -> dict[int, str]:
    """This process' open file descriptors and what they point to."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the fd listing the directory itself, closed meanwhile
    return fds


def thread_count(settle_s: float = 2.0) -> int:
    """Threads of this process once the count is steady: a thread that was just joined (or a
    progress thread just stopped) can stay listed in /proc for a moment while it exits, which
    would make a before/after comparison flaky. Returns after three equal readings 20 ms
    apart, or the last reading at `settle_s`."""
    deadline = time.monotonic() + settle_s
    readings = [len(os.listdir("/proc/self/task"))]
    while time.monotonic() < deadline and (len(readings) < 3 or len(set(readings[-3:])) > 1):
        time.sleep(0.02)
        readings.append(len(os.listdir("/proc/self/task")))
    return readings[-1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def world_writable(paths: list[str]) -> list[str]:
    """The entries under `paths` (recursively) that anyone may write, symlinks excepted."""
    found = []
    for root in paths:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue  # removed meanwhile
                if stat.S_ISLNK(st.st_mode):
                    continue
                # A sticky world-writable directory (/tmp) is the accepted exception.
                if st.st_mode & stat.S_IWOTH and not (
                    stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
                ):
                    found.append(f"{path} (mode {stat.S_IMODE(st.st_mode):o})")
    return found


def read_dumps(directory: str) -> dict[str, str]:
    """The state dumps spyreccl wrote to `directory` (SPYRECCL_DUMP_DIR), by file name."""
    dumps = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), errors="replace") as f:
            dumps[name] = f.read()
    return dumps
