"""Observations of a process' footprint: /dev/shm segments, fds, threads, RSS, file modes."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "spyreccl-"


def shm_segments() -> set[str]:
    """Names of spyreccl segments currently in /dev/shm."""
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SEGMENT_PREFIX)}
    except FileNotFoundError:
        return set()


def new_segments(before: set[str], settle_s: float = 1.0) -> list[str]:
    """Segments that appeared since `before` and are still there after `settle_s`: other
    jobs on the machine may be forming communicators right now (spyreccl unlinks a segment
    once every rank attached), so only persistent ones count as ours."""
    appeared = shm_segments() - before
    deadline = time.monotonic() + settle_s
    while appeared and time.monotonic() < deadline:
        time.sleep(0.05)
        appeared &= shm_segments()
    return sorted(appeared)


def mapped_segments(pid: int | str = "self") -> set[str]:
    """/dev/shm paths of the spyreccl segments process `pid` maps (unlinked ones too)."""
    paths = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(str(SHM_DIR / SEGMENT_PREFIX)):
                paths.add(fields[5].split(" (deleted)")[0].strip())
    return paths


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
